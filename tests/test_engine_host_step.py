"""The engine's host work per step grows by no Python call per running request.

A step with N requests decoding must not call a Python function per request: at 1,024 running,
one call per request is about a millisecond of host time the GPU waits for. Counting calls is
exact and does not depend on the machine's speed or load (a speed ratio lives in
`kvscope bench --host-overhead` and benchmarks/host_loop.py)."""

from __future__ import annotations

import sys
from random import Random

from kvscope.bench import host_overhead
from kvscope.engine.sampling_params import SamplingParams


def _calls_in_a_full_decode_step(running: int, stop: list[str] | None = None) -> int:
    engine = host_overhead._engine(running)  # the sim with no compute: inputs built, events built and dropped
    engine.attach(host_overhead._DropSink())
    rng = Random(0)
    for _ in range(running):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(64, 192))]
        engine.add_request(prompt, SamplingParams(max_tokens=200, ignore_eos=True, stop=stop or []))
    while True:  # until every request decodes
        engine.step()
        out = engine.runner.last
        if len(out.seqs) == running and not any(s.is_prefill for s in out.seqs):
            break
    engine.step()
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
    return calls


def test_a_decode_step_calls_no_python_function_per_running_request():
    small, large = _calls_in_a_full_decode_step(32), _calls_in_a_full_decode_step(128)
    per_request = (large - small) / (128 - 32)
    # what grows with N: a request whose next token starts a block asks the block manager (1 in 16)
    assert per_request < 1.0, f"{per_request:.2f} Python calls per running request per step"


def test_the_count_sees_per_request_work_when_there_is_some():
    # stop strings are checked as each token comes: text is decoded per request, per step
    small = _calls_in_a_full_decode_step(32, stop=["\x00never"])
    large = _calls_in_a_full_decode_step(128, stop=["\x00never"])
    assert (large - small) / (128 - 32) >= 3
