"""A real vLLM server that kvscope starts, addresses, drives and stops (`serve --engine vllm`, `bench --peers vllm`)."""
