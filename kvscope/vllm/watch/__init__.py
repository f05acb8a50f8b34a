"""A running vLLM watched from outside: its /metrics and KV events, recorded and replayed."""
