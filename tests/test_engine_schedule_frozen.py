"""The scheduler's fast paths keep the schedule: every step equals the records taken at 71b425a.

tests/fakes/schedule_records.py runs seeded workloads (every mode; FCFS, SJF and priority;
recompute and swap preemption; prefix caching with copy-on-write; max_model_len stops; a wide
decode batch) through the sim backend; the fixture holds each step's batch and a digest of the
rest of its step event as recorded on commit 71b425a, before the host-overhead work. Two steps of
chunked-prefix-swap (22 and 178) were recorded again when the block deltas stopped listing as freed a
block that is cached again by the end of its step (the old stream lost those blocks' cached state:
the last test here shows the stream now rebuilds the engine's own cached count); their batches and
everything else are unchanged.
"""

from __future__ import annotations

import gzip
import json
import os

import pytest

from fakes.schedule_records import CASES, run_case

FIXTURE = os.path.join(os.path.dirname(__file__), "fakes", "schedules_71b425a.json.gz")


@pytest.fixture(scope="module")
def recorded() -> dict:
    with gzip.open(FIXTURE, "rt", encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("name,settings,spec", CASES, ids=[c[0] for c in CASES])
def test_every_step_matches_the_schedule_recorded_before_the_fast_paths(recorded, name, settings, spec):
    want = recorded[name]
    got = run_case(settings, spec)
    assert len(got) == len(want), f"{name}: {len(got)} steps, recorded {len(want)}"
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert g[0] == w[0], f"{name}: step {step} batch differs: {g[0]} != {w[0]}"
        assert g[1] == w[1], f"{name}: step {step} queues, deltas, counters or finishes differ"


def test_a_watcher_of_the_stream_counts_the_cached_blocks_the_engine_counts():
    """Prefix caching with swap preemption, where blocks are evicted, reused and cached again within one step:
    a watcher that folds every step's deltas counts the cached blocks the engine's own counters say."""
    from kvscope.protocol.blockmap import BlockMap

    name, settings, spec = next(c for c in CASES if c[0] == "chunked-prefix-swap")
    events = []
    run_case(settings, spec, keep=events)
    watcher = BlockMap(settings["num_blocks"])
    for ev in events:
        watcher.apply_step(ev)
        assert sum(1 for c in watcher.cached if c) == ev.kv.cached, f"{name}: step {ev.step}"
    assert len(events) > 100 and max(ev.kv.cached for ev in events) > 0
