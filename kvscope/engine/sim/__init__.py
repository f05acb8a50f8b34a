"""The simulated backend: the real scheduler on a cost model of a GPU and a model, on a virtual clock.

- catalog:   GPUs and model shapes, every number with its source;
- cost:      the time of one iteration from the batch it runs;
- runner:    SimRunner, the ModelRunner stand-in (same run() interface, fake tokens);
- backend:   what LLMEngine needs to build a sim engine (KV sizing, hello info);
- calibrate: fit efficiencies and overhead from a real engine's trace;
- bench:     the sim bench presets (lesson, fragmentation).

See docs/SIM.md.
"""
