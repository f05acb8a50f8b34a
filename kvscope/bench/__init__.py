"""Benchmarks: the harness, the mode/peer/feature/sim/event tables and their report."""

# `kvscope bench-features` experiments (kvscope.bench.features), named here so the CLI's parser lists them
# without importing the engine.
FEATURE_EXPERIMENTS = ("shared-prefix", "priority", "swap")

# `kvscope bench --modes` rows beyond the engine's modes, named here for the same reason: single-stream is
# chunked with one request running at a time (its ITL is one chat stream's, beside llama.cpp's one-at-a-time row)
SINGLE_STREAM = "single-stream"
