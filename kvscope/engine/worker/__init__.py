"""The torch side of a step: inputs, the forward over the paged KV cache, sampling, attention plumbing, CUDA graphs,
swap copies, the GPU's KV budget and the CPU pool's allocation."""
