"""The step timer (kvscope/engine/worker/step_timer.py): off by default, and on it changes nothing the
engine computes while it splits every step at the forward's launch."""

from __future__ import annotations

import pytest

from conftest import token_prompts
from kvscope.engine import LLM, SamplingParams
from kvscope.engine.worker import step_timer

SETTINGS = dict(device="cpu", num_blocks=64, max_num_seqs=4, max_num_batched_tokens=24)


def test_split_step_adds_up_to_the_wall_time():
    # the GPU outlasts the launches: host after counts from the device's end
    parts = step_timer.split_step(0.0, 0.002, 0.0021, 0.012, device_ms=4.0)
    assert parts["host_before_ms"] == pytest.approx(2.0) and parts["host_after_ms"] == pytest.approx(6.0)
    # the launches outlast the GPU (an eager forward): host after counts from the last launch
    parts = step_timer.split_step(0.0, 0.002, 0.011, 0.016, device_ms=4.0)
    assert parts["launch_ms"] == pytest.approx(9.0) and parts["host_after_ms"] == pytest.approx(5.0)
    for parts in (step_timer.split_step(0.0, 0.002, 0.0021, 0.012, 4.0),
                  step_timer.split_step(0.0, 0.002, 0.011, 0.016, 4.0),
                  step_timer.split_step(0.0, 0.001, 0.003, 0.004, None)):  # a CPU: the device time is the call's
        wall = parts["host_before_ms"] + max(parts["launch_ms"], parts["device_ms"]) + parts["host_after_ms"]
        assert wall == pytest.approx(parts["wall_ms"])


def test_a_timed_engine_computes_the_same_tokens_and_times_every_step():
    prompts = token_prompts([5, 30, 11], 256, seed=3)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    plain = LLM("tiny", **SETTINGS)
    assert plain.engine.runner.step_timer is None  # off unless something asks for it
    expected = [o.token_ids for o in plain.generate(prompts, params)]

    timed = LLM("tiny", **SETTINGS)
    timer = step_timer.attach(timed.engine)
    assert [o.token_ids for o in timed.generate(prompts, params)] == expected
    kinds = {s.kind for s in timer.steps}
    assert {"prefill", "decode"} <= kinds and kinds <= set(step_timer.KINDS)  # 24-token budget: chunks, decodes
    assert "mixed" in kinds  # the 30-token prompt's chunks run beside the others' decodes
    for s in timer.steps:
        assert not s.graph and s.device_ms == s.launch_ms > 0  # a CPU: the forward runs as it is called
        assert s.host_before_ms >= 0 and s.host_after_ms >= 0 and s.wall_ms >= s.device_ms
    summary = timer.summary()
    assert summary["all"]["steps"] == len(timer.steps)
