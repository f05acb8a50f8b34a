"""The torch side of a step: inputs, the forward over the paged KV cache, sampling, attention plumbing, CUDA graphs, and how big the KV pool can be."""
