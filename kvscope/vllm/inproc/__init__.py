"""vLLM's scheduler in-process: inside kvscope's engine (--scheduler vllm), and kvscope inside a real vLLM (the watched scheduler, the stat-logger plugin)."""
