"""Numbers at every boundary: an integer that would reach an event out of int64 is refused where it
enters (the engine's add_request, the HTTP fields, workload files), in one line."""

from __future__ import annotations

import pytest

from kvscope.engine import LLMEngine, SamplingParams
from kvscope.engine.config import EngineConfig
from kvscope.engine.errors import RequestRejected
from kvscope.engine.request import PRIORITY_MAX, PRIORITY_MIN


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(num_blocks=32))


@pytest.mark.parametrize("priority, needle", [
    (2**63, "priority must be in"), (-(2**63), "priority must be in"), (2**64 - 1, "priority must be in"),
    (True, "must be an integer"), (0.5, "must be an integer"), ("1", "must be an integer"),
])
def test_the_engine_refuses_a_priority_its_events_cannot_hold(engine, priority, needle):
    with pytest.raises(RequestRejected, match=needle):
        engine.add_request("x", SamplingParams(max_tokens=1), priority)


@pytest.mark.parametrize("arrival", [float("inf"), float("nan"), "soon"])
def test_the_engine_refuses_an_arrival_that_is_not_a_finite_time(engine, arrival):
    with pytest.raises(RequestRejected, match="arrival must be a finite number"):
        engine.add_request("x", SamplingParams(max_tokens=1), 0, arrival=arrival)


def test_the_extreme_priorities_run_and_their_negation_fits():
    engine = LLMEngine(EngineConfig(num_blocks=32, policy="priority"))
    assert -PRIORITY_MIN == PRIORITY_MAX
    for p in (PRIORITY_MIN, PRIORITY_MAX, 0):
        engine.add_request("ab", SamplingParams(max_tokens=2, ignore_eos=True), p)
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert sorted(r.priority for r in done) == [PRIORITY_MIN, 0, PRIORITY_MAX]
