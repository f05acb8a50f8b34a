"""Triton kernels for CUDA: paged attention (prefill and decode) and the KV write."""
