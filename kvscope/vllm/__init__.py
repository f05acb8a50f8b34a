"""A real vLLM in kvscope's terms: watched from outside (watch/), its scheduler in-process and kvscope inside
`vllm serve` (inproc/), diagnosed (diagnose/), started and stopped (launch/), and kvscope's own prefix cache
published in vLLM's KV-event format (publish.py).

vLLM itself is imported only by inproc/ (watched.py at its top, as vLLM loads it; the others where they use
it): watching, diagnosing and launching a vLLM need no vLLM in kvscope's own venv.
"""
