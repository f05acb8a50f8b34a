"""Benchmarks: the harness, the mode/peer/feature/sim/event tables and their report."""

# `kvscope bench-features` experiments (kvscope.bench.features), named here so the CLI's parser lists them
# without importing the engine.
FEATURE_EXPERIMENTS = ("shared-prefix", "priority", "swap")
