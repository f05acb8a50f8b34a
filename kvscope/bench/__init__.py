"""Benchmarks: the harness, the mode/peer/feature/sim/event tables and their report."""
