"""Scheduler + block manager properties, driven without a model.

A fake runner "samples" one fixed token for every sequence the scheduler marks
for sampling. Hypothesis draws the cache shape, the limits, the mode and a
stream of requests that arrive between steps; every step is checked against
the scheduler's contract, and the run must drain in a bounded number of steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.engine.kv.block_manager import BlockManager, blocks_needed
from kvscope.engine.config import EngineConfig
from kvscope.engine.request import Request, RequestStatus
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.sched.scheduler import Scheduler

MODES = ("naive", "static", "continuous", "chunked")
TOKEN = 7  # what the fake runner samples, every time
PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Arrival:
    step: int  # added just before this step's schedule()
    prompt_len: int
    max_tokens: int
    ignore_eos: bool


@dataclass
class Scenario:
    mode: str
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int
    budget: int
    eos_is_token: bool  # when True, TOKEN is an eos id: requests without ignore_eos stop at their first token
    arrivals: list[Arrival]


@st.composite
def scenarios(draw, mode: str) -> Scenario:
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    num_blocks = draw(st.integers(1, 24))
    capacity = block_size * num_blocks
    if capacity < 2:
        num_blocks = 2 // block_size + 1
        capacity = block_size * num_blocks
    # The engine caps max_model_len at the KV capacity (and may be asked for less).
    max_model_len = draw(st.integers(2, capacity))
    # ... and rejects prompts that leave no room to generate.
    prompt_lens = st.integers(1, max_model_len - 1)
    arrivals = draw(st.lists(
        st.builds(Arrival, step=st.integers(1, 30), prompt_len=prompt_lens, max_tokens=st.integers(1, 24),
                  ignore_eos=st.booleans()),
        min_size=1, max_size=12,
    ))
    arrivals.sort(key=lambda a: a.step)  # stable: same-step arrivals keep their drawn order
    return Scenario(
        mode=mode,
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=draw(st.integers(1, 6)),
        budget=draw(st.integers(1, 64)),
        eos_is_token=draw(st.booleans()),
        arrivals=arrivals,
    )


def fake_run(out) -> dict[int, int]:
    return {s.req_id: TOKEN for s in out.seqs if s.sample}


def expected_output_len(req: Request, sc: Scenario) -> int:
    if sc.eos_is_token and not req.params.ignore_eos:
        return 1
    return min(req.params.max_tokens, sc.max_model_len - req.num_prompt_tokens)


def simulate(sc: Scenario) -> None:
    config = EngineConfig(mode=sc.mode, block_size=sc.block_size, num_blocks=sc.num_blocks,
                          max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.budget)
    config.validate()
    bm = BlockManager(sc.num_blocks, sc.block_size)
    sched = Scheduler(config, bm, sc.max_model_len)
    eos = frozenset({TOKEN}) if sc.eos_is_token else frozenset()
    max_seqs = 1 if sc.mode == "naive" else sc.max_num_seqs

    all_reqs: list[Request] = []
    add_order: list[int] = []
    first_scheduled: list[int] = []
    pending = list(sc.arrivals)
    total_work = sum(a.prompt_len + a.max_tokens for a in sc.arrivals)
    step_limit = sc.arrivals[-1].step + 4 * total_work * (len(sc.arrivals) + 1) + 10

    step = 0
    while pending or sched.has_unfinished():
        step += 1
        assert step <= step_limit, f"no progress after {step_limit} steps (deadlock or livelock)"
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            req = Request(len(all_reqs), [1] * a.prompt_len,
                          SamplingParams(max_tokens=a.max_tokens, ignore_eos=a.ignore_eos), arrival=float(step))
            all_reqs.append(req)
            add_order.append(req.req_id)
            sched.add(req)
        if not sched.has_unfinished():
            continue

        running_before = list(sched.running)
        decode_ready = {r.req_id for r in sched.running if r.is_decode}
        out = sched.schedule(float(step))
        bm.check_invariants()
        ids = [s.req_id for s in out.seqs]
        assert len(ids) == len(set(ids)), "a request was scheduled twice in one step"

        # token budget
        if sc.mode == "chunked":
            assert out.num_tokens <= sc.budget
        if sc.mode == "continuous" and sum(s.is_prefill for s in out.seqs) > 1:
            assert out.num_tokens <= sc.budget
        assert out.seqs or out.pad_rows or not sched.running, "requests are running but nothing was scheduled"
        kinds = {s.is_prefill for s in out.seqs}
        if sc.mode in ("naive", "continuous"):
            assert len(kinds) <= 1, "prefill-first modes never mix prefills and decodes in one step"
        if sc.mode == "chunked":
            skipped = decode_ready - {s.req_id for s in out.seqs} - set(out.preempted)
            if skipped:
                assert kinds <= {False}, "a prefill chunk took budget while a decode waited"
        assert len(sched.running) <= max_seqs

        # each scheduled sequence is consistent with its request and has blocks for what it computes
        for s in out.seqs:
            req = sched.requests[s.req_id]
            assert req.status is RequestStatus.RUNNING
            assert s.start_pos == req.num_computed_tokens
            assert s.token_ids == req.token_ids[s.start_pos : s.start_pos + len(s.token_ids)] and s.token_ids
            assert s.sample == (s.start_pos + len(s.token_ids) == req.num_tokens)
            assert s.block_table == bm.table(s.req_id)
            assert len(s.block_table) * sc.block_size >= s.start_pos + len(s.token_ids)
            if s.req_id in out.preempted:
                assert s.start_pos == 0, "a preempted request must recompute from the start"

        # FCFS: requests are first scheduled in the order they were added
        for r in out.admitted:
            if r not in first_scheduled:
                first_scheduled.append(r)
        assert first_scheduled == add_order[: len(first_scheduled)]

        # preemption: recompute, and back to the front of WAITING
        readmitted = set(out.admitted)
        requeued = [r for r in reversed(out.preempted) if r not in readmitted]
        assert [r.req_id for r in list(sched.waiting)[: len(requeued)]] == requeued
        for r in requeued:
            victim = sched.requests[r]
            assert victim.status is RequestStatus.PREEMPTED
            assert victim.num_computed_tokens == 0 and not bm.table(r)
            assert victim.num_preemptions >= 1

        if sc.mode == "static":
            if running_before:
                assert not out.admitted, "static mode admitted into a running batch"
                assert not out.preempted
            for req in sched.running:  # every row holds its full reservation until the batch ends
                reserve = min(req.num_prompt_tokens + req.params.max_tokens, sc.max_model_len)
                assert len(bm.table(req.req_id)) == blocks_needed(reserve, sc.block_size)

        batch = list(sched.running)
        finished = sched.update(out, fake_run(out), float(step), eos)
        bm.check_invariants()
        for req in finished:
            assert req.status is RequestStatus.FINISHED and not bm.table(req.req_id)
        if sc.mode == "static" and finished:
            assert {r.req_id for r in finished} == {r.req_id for r in batch}, "static batch released piecemeal"
            assert not sched.running
        if sc.mode == "static":
            for req in sched.running:
                if req.done_generating:
                    assert bm.table(req.req_id), "a finished static row gave up its blocks before batch end"

    # everything drained, nothing leaked
    assert bm.num_free == bm.num_blocks and not bm.tables and not sched.requests
    for req in all_reqs:
        assert req.status is RequestStatus.FINISHED
        assert req.num_output_tokens == expected_output_len(req, sc), (req.finish_reason, req.params)
        assert req.output_token_ids == [TOKEN] * req.num_output_tokens
        if sc.eos_is_token and not req.params.ignore_eos:
            assert req.finish_reason == "stop"
        elif req.num_output_tokens == req.params.max_tokens:
            assert req.finish_reason == "length"
        else:
            assert req.finish_reason == "max_model_len"
        if sc.mode in ("naive", "static"):
            assert req.num_preemptions == 0


@pytest.mark.parametrize("mode", MODES)
@PROPS
@given(data=st.data())
def test_scheduler_properties(mode, data):
    simulate(data.draw(scenarios(mode)))


@pytest.mark.parametrize("mode", ["continuous", "chunked"])
def test_preemption_happens_and_recomputes(mode):
    """A fixed scenario that must preempt: two long requests in a cache that holds one at full length."""
    sc = Scenario(mode=mode, block_size=4, num_blocks=6, max_model_len=24, max_num_seqs=4, budget=64,
                  eos_is_token=False,
                  arrivals=[Arrival(1, 9, 12, True), Arrival(1, 9, 12, True), Arrival(2, 3, 5, True)])
    simulate(sc)  # all checks, including requeue at the front and recompute from position 0

    config = EngineConfig(mode=mode, block_size=4, num_blocks=6, max_num_batched_tokens=64)
    bm = BlockManager(6, 4)
    sched = Scheduler(config, bm, 24)
    reqs = [Request(i, [1] * 9, SamplingParams(max_tokens=12, ignore_eos=True), 0.0) for i in range(2)]
    for r in reqs:
        sched.add(r)
    preempted = []
    for step in range(1, 200):
        if not sched.has_unfinished():
            break
        out = sched.schedule(float(step))
        preempted += out.preempted
        sched.update(out, fake_run(out), float(step), frozenset())
    assert preempted and set(preempted) == {1}, "the newest request is the victim"
    assert reqs[1].num_preemptions >= 1 and reqs[0].num_preemptions == 0
    assert reqs[0].finish_time < reqs[1].finish_time
    assert all(r.num_output_tokens == 12 for r in reqs)


def test_static_pads_to_longest_and_keeps_finished_rows():
    config = EngineConfig(mode="static", block_size=4, num_blocks=32, max_num_seqs=8)
    bm = BlockManager(32, 4)
    sched = Scheduler(config, bm, 128)
    short = Request(0, [1] * 3, SamplingParams(max_tokens=2, ignore_eos=True), 0.0)
    long = Request(1, [1] * 10, SamplingParams(max_tokens=6, ignore_eos=True), 0.0)
    for r in (short, long):
        sched.add(r)
    out = sched.schedule(0.0)
    assert out.admitted == [0, 1]
    assert out.pad_rows == [7], "the 3-token prompt is padded to the 10-token one"
    assert len(bm.table(0)) == blocks_needed(5, 4) and len(bm.table(1)) == blocks_needed(16, 4)
    sched.update(out, fake_run(out), 0.0, frozenset())
    late = Request(2, [1] * 2, SamplingParams(max_tokens=1), 0.0)
    sched.add(late)
    out = sched.schedule(1.0)
    assert not out.admitted and out.admission.reason == "static_batch_running"
    finished = sched.update(out, fake_run(out), 1.0, frozenset())
    assert not finished and short.done_generating and short.num_output_tokens == 2
    out = sched.schedule(2.0)
    assert out.pad_rows == [1] and [s.req_id for s in out.seqs] == [1], "the finished row still costs compute"
    assert bm.table(0), "the finished row keeps its blocks until the batch ends"
    for step in range(3, 10):
        finished = sched.update(out, fake_run(out), float(step), frozenset())
        if finished:
            break
        out = sched.schedule(float(step))
    assert {r.req_id for r in finished} == {0, 1}
    out = sched.schedule(20.0)
    assert out.admitted == [2]
