"""Properties of prefix caching, swap preemption and the policies, driven without a model.

A fake runner samples one fixed token; hypothesis draws the cache shape, limits,
mode, policy, preemption mode, a small CPU swap pool, and requests whose prompts
share prefixes (so blocks are shared, cached, evicted and copied on write). Every
step is checked:

- refcounts equal the number of block tables holding each block; a block is free
  (or cached) exactly when nobody references it, so no shared block is ever freed
  while referenced;
- eviction takes only unreferenced blocks (an allocation never takes a block with
  a refcount);
- no step writes into a shared or cached block (copy-on-write happened first);
- the swap pool never leaks: its used blocks are exactly the SWAPPED requests';
- with a sliding window w (every layer slides), each scheduled query's keys
  (positions p-w+1 .. p) lie in blocks the request holds, and after each step a
  request holds no block wholly before its window;
- sjf keeps WAITING sorted by remaining work minus aging, so a request is passed
  only by requests that arrived within its aging bound;
- priority preempts only strictly lower priorities for an arrival, and for a block
  only a priority no higher than the requester's.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.engine.kv.block_manager import BlockManager, blocks_needed
from kvscope.engine.config import EngineConfig
from kvscope.engine.kv.events import BlockCopied, BlockDeltaFold, BlockRemoved
from kvscope.engine.sched.policies import SJF, remaining_work
from kvscope.engine.request import Request, RequestStatus
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.sched.scheduler import Scheduler

TOKEN = 7
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class CheckedBlockManager(BlockManager):
    """Asserts, at the moment of allocation, that the block taken is unreferenced."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        pool, take = self.pool, self.pool.take

        def checked_take(req_id: int, keep: int | None = None) -> int:
            if not pool.free:
                assert all(pool.ref_counts[b] == 0 for b in pool.evictable), "eviction could take a referenced block"
            block = take(req_id, keep)
            assert pool.ref_counts[block] == 1 and block != keep
            assert sum(block in t for t in self.tables.values()) == 0, "allocated a block still in a table"
            return block

        pool.take = checked_take


@dataclass
class Arrival:
    step: int
    prefix: int  # which shared prefix (or -1: none)
    prefix_len: int
    suffix: list[int]
    max_tokens: int
    priority: int
    n: int = 1  # parallel sampling: the request forks into n samples
    stop_first: bool = False  # every sample stops at its first token (a stop id: the scheduler is told by abort)
    abort_root: int | None = None  # the first sample is aborted this many steps after arrival


@st.composite
def scenarios(draw, policy: str, forks: bool = False):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(3, 24))
    capacity = block_size * num_blocks
    max_model_len = draw(st.integers(min(4, capacity), capacity))
    prefixes = [draw(st.lists(st.integers(1, 3), min_size=1, max_size=24)) for _ in range(2)]
    arrivals = []
    for _ in range(draw(st.integers(1, 10))):
        pre = draw(st.integers(-1, 1))
        plen = draw(st.integers(0, len(prefixes[pre]))) if pre >= 0 else 0
        suffix = draw(st.lists(st.integers(1, 3), max_size=12))
        total = plen + len(suffix)
        if total == 0:
            suffix = [1]
            total = 1
        if total >= max_model_len:  # the engine rejects these
            cut = max_model_len - 1
            if plen > cut:
                plen, suffix = cut, []
            else:
                suffix = suffix[: cut - plen]
            if plen + len(suffix) == 0:
                suffix = [1]
        arrivals.append(Arrival(draw(st.integers(1, 25)), pre, plen, suffix, draw(st.integers(1, 16)),
                                draw(st.integers(0, 3))))
        if forks:
            a = arrivals[-1]
            a.n = draw(st.integers(1, 5))
            a.stop_first = draw(st.booleans())
            a.abort_root = draw(st.one_of(st.none(), st.integers(0, 6)))
    arrivals.sort(key=lambda a: a.step)
    return dict(
        policy=policy,
        mode=draw(st.sampled_from(["naive", "static", "continuous", "chunked"] if forks else ["continuous", "chunked"])),
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=draw(st.integers(1, 6)),
        budget=draw(st.integers(1, 48)),
        prefix_caching=draw(st.booleans()),
        window=draw(st.one_of(st.none(), st.integers(1, 20))),
        preemption=draw(st.sampled_from(["recompute", "swap"])),
        cpu_blocks=draw(st.integers(0, 12)),
        prefixes=prefixes,
        arrivals=arrivals,
    )


def simulate(sc) -> dict:
    config = EngineConfig(mode=sc["mode"], block_size=sc["block_size"], num_blocks=sc["num_blocks"],
                          max_num_seqs=sc["max_num_seqs"], max_num_batched_tokens=sc["budget"],
                          policy=sc["policy"], prefix_caching=sc["prefix_caching"], preemption=sc["preemption"])
    config.validate()
    bm = CheckedBlockManager(sc["num_blocks"], sc["block_size"], enable_caching=sc["prefix_caching"],
                             sliding_window=sc.get("window"))
    sched = Scheduler(config, bm, sc["max_model_len"], num_cpu_blocks=sc["cpu_blocks"])
    pool = sched.swap_pool
    policy = sched.policy
    stats = dict(arrival_preemptions=0, swaps_out=0, swaps_in=0, hits=0, cow=0)

    # Watch every preemption decision the policy makes.
    orig_victim, orig_arrival = policy.victim, policy.arrival_victim

    def victim(running, needy):
        v = orig_victim(running, needy)
        if sc["policy"] == "priority":
            assert v.priority <= needy.priority, "a block request preempted a higher priority"
        return v

    def arrival_victim(head, running):
        v = orig_arrival(head, running)
        if v is not None:
            assert sc["policy"] == "priority", "only the priority policy preempts for an arrival"
            assert v.priority < head.priority, "priority preempted an equal or higher priority"
            stats["arrival_preemptions"] += 1
        return v

    policy.victim, policy.arrival_victim = victim, arrival_victim

    reqs: list[Request] = []
    arrival_of: dict[int, Arrival] = {}  # request id -> its arrival (every sample of it)
    aborted: set[int] = set()
    pending = list(sc["arrivals"])
    total = sum((len(a.suffix) + a.prefix_len + a.max_tokens) * a.n for a in pending)
    step_limit = pending[-1].step + 6 * total * (len(pending) + 1) + 20
    step = 0
    while pending or sched.has_unfinished():
        step += 1
        assert step <= step_limit, "no progress (deadlock or livelock)"
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            prompt = (sc["prefixes"][a.prefix][: a.prefix_len] if a.prefix >= 0 else []) + a.suffix
            req = Request(len(reqs), prompt, SamplingParams(max_tokens=a.max_tokens, ignore_eos=True, n=a.n),
                          arrival=float(step), priority=a.priority)
            reqs.append(req)
            sched.add(req)
            samples = [req.fork(len(reqs) + i, i + 1) for i in range(a.n - 1)]
            reqs.extend(samples)
            if samples:
                sched.add_forks(req, samples)
            for r in (req, *samples):
                arrival_of[r.req_id] = a
        for a in sc["arrivals"]:
            if a.abort_root is not None and a.step + a.abort_root == step:
                root = next(r for r in reqs if arrival_of[r.req_id] is a and r.fork_of is None)
                if sched.abort(root.req_id, float(step)) is not None:
                    aborted.add(root.req_id)
        if not sched.has_unfinished():
            continue
        out = sched.schedule(float(step))
        bm.check_invariants()
        if pool is not None:
            pool.check_invariants()
            assert set(pool.tables) == {r.req_id for r in sched.swapped}, "swap pool and SWAPPED disagree"
        else:
            assert not sched.swapped
        stats["swaps_out"] += sum(1 for s in out.swaps if s[1] == "out")
        stats["swaps_in"] += sum(1 for s in out.swaps if s[1] == "in")
        stats["hits"] += len(out.hits)
        stats["cow"] += len(out.blocks_to_copy)
        if not sc["prefix_caching"]:  # (samples of n copy the block holding the last prompt token)
            assert not out.hits and bm.num_cached == 0
            assert not out.blocks_to_copy or any(a.n > 1 for a in sc["arrivals"])
        if sc["mode"] == "chunked":
            assert out.num_tokens <= sc["budget"]
        bs = sc["block_size"]
        for s in out.seqs:
            req = sched.requests[s.req_id]
            assert req.status is RequestStatus.RUNNING and s.start_pos == req.num_computed_tokens
            assert s.block_table == bm.table(s.req_id)
            first_key = max(0, s.start_pos - (sc.get("window") or s.start_pos + 1) + 1)
            held = set(bm.tables[s.req_id])
            for pos in range(first_key, s.start_pos + len(s.token_ids)):
                assert s.block_table[pos // bs] in held, f"position {pos} is read but its block is not held"
            for pos in range(s.start_pos, s.start_pos + len(s.token_ids)):
                block = s.block_table[pos // bs]
                assert bm.ref_counts[block] == 1, "a write into a shared block (copy-on-write missing)"
                assert bm.prefix_key(block) is None, "a write into a cached prefix block"
        for i, (src, dst) in enumerate(out.blocks_to_copy):
            # (src may have been evicted and handed out later in the step: copies run before any write)
            assert src != dst and bm.ref_counts[dst] == 1
            # the copies of a step run at once: none may read a block an earlier one writes
            assert src not in {d for _, d in out.blocks_to_copy[:i]}, "a copy of a copy made in the same step"
        for r, direction, n in out.swaps:
            if direction == "out":
                assert sched.requests[r].status in (RequestStatus.SWAPPED, RequestStatus.RUNNING)
        for gpu, cpu in out.blocks_to_swap_out:
            assert 0 <= cpu < pool.num_blocks
        if sc["policy"] == "sjf":
            keys = [policy.score(r, sched.step_count) for r in sched.waiting]
            assert keys == sorted(keys), "sjf: WAITING is not in score order"
            # the aging bound: r is never behind a request that arrived more than w(r)/aging steps later
            waiting = list(sched.waiting)
            for i, r in enumerate(waiting):
                for q in waiting[:i]:
                    assert q.arrival_step - r.arrival_step <= remaining_work(r) / SJF.aging, "sjf starved a request"
        if sc["policy"] == "priority":
            prios = [r.priority for r in sched.waiting]
            assert prios == sorted(prios, reverse=True), "priority: WAITING not highest first"
        sched.update(out, {s.req_id: TOKEN for s in out.seqs if s.sample}, float(step), frozenset())
        bm.check_invariants()
        for s in out.seqs:  # a stop id ends a request after update(), through abort (engine/outputs.py)
            req = sched.requests.get(s.req_id)
            if s.sample and req is not None and arrival_of[req.req_id].stop_first and req.finish_reason is None:
                sched.abort(req.req_id, float(step), "stop")
        bm.check_invariants()
        for req in sched.running:
            gone = bm.outside_window(req.num_computed_tokens)
            assert len(bm.tables[req.req_id]) == len(bm.table(req.req_id)) - gone, "a block outside the window is held"

    assert bm.num_free == bm.num_blocks and not bm.tables and not sched.requests
    assert not (sched._families or sched._forks or sched._unforked or sched._lingering), "fork bookkeeping leaked"
    assert bm.num_used == 0
    if pool is not None:
        assert pool.num_used == 0 and not pool.tables, "swap pool leaked"
        assert pool.blocks_out == pool.blocks_in or aborted  # (an aborted swapped request's copy is dropped)
    for req in reqs:
        assert req.status is RequestStatus.FINISHED
        assert req.output_token_ids == [TOKEN] * req.num_output_tokens
        if req.req_id in aborted:
            continue
        want = min(req.params.max_tokens, sc["max_model_len"] - req.num_prompt_tokens)
        assert req.num_output_tokens == (min(1, want) if arrival_of[req.req_id].stop_first else want)
    return stats


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "priority"])
@PROPS
@given(data=st.data())
def test_feature_properties(policy, data):
    simulate(data.draw(scenarios(policy)))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@PROPS
@given(data=st.data())
def test_parallel_sampling_properties(policy, data):
    """The same checks with requests that fork into n samples, samples that stop at their first token, and
    first samples aborted at any point (waiting, mid-prefill, swapped, after their first token)."""
    simulate(data.draw(scenarios(policy, forks=True)))


def _fixed(policy="fcfs", **over):
    sc = dict(policy=policy, mode="chunked", block_size=4, num_blocks=8, max_model_len=32, max_num_seqs=4,
              budget=32, prefix_caching=True, preemption="swap", cpu_blocks=16,
              prefixes=[[1, 2, 3, 1, 2, 3, 1, 2], [3, 3, 3, 3]],
              arrivals=[Arrival(1, 0, 8, [1, 2, 3, 1], 10, 0), Arrival(1, 0, 8, [2], 10, 0),
                        Arrival(4, 0, 8, [], 10, 0), Arrival(6, 1, 4, [2, 2], 10, 3)])
    sc.update(over)
    return sc


def test_fixed_scenario_hits_shares_copies_and_swaps():
    stats = simulate(_fixed())
    assert stats["hits"] >= 1 and stats["cow"] >= 1, stats
    assert stats["swaps_out"] >= 1 and stats["swaps_out"] == stats["swaps_in"], stats


def test_fixed_scenario_with_a_window_still_hits_copies_and_swaps():
    """A 6-token window over 4-token blocks: blocks leave as the window moves, yet prefix hits,
    copy-on-write and swaps all still happen (the per-step checks above hold throughout)."""
    stats = simulate(_fixed(window=6))
    assert stats["hits"] >= 1 and stats["cow"] >= 1, stats
    assert stats["swaps_out"] >= 1 and stats["swaps_out"] == stats["swaps_in"], stats


def test_fixed_scenario_priority_preempts_for_arrival():
    stats = simulate(_fixed("priority", num_blocks=6, max_num_seqs=2, preemption="recompute"))
    assert stats["arrival_preemptions"] >= 1


def _req(i: int, tokens: list[int]) -> Request:
    return Request(i, tokens, SamplingParams(max_tokens=1), 0.0)


def test_lru_eviction_order_and_revival():
    bm = BlockManager(4, 2, enable_caching=True)
    fold = BlockDeltaFold(bm.num_blocks)
    first = [_req(r, toks) for r, toks in enumerate(([1, 2], [3, 4]))]
    for req in first:
        assert bm.admit(req, [], 0, 2)
        bm.commit(req, 2)
    bm.free(first[0])
    bm.free(first[1])
    assert bm.num_cached == 2 and bm.num_free == 4
    assert len(bm.match_prefix([1, 2, 9])) == 1
    hits = bm.match_prefix([3, 4, 5])
    assert len(hits) == 1
    assert bm.admit(_req(2, [3, 4, 5]), hits, 2, 3)  # revives the [3, 4] block, adds one more
    assert bm.ref_counts[hits[0]] == 1 and bm.num_cached == 1
    fold.fold(bm.take_events())  # a step boundary
    # two more blocks: one plain free block, then the least recently released cached one ([1, 2])
    assert bm.grow(_req(3, [5]), 4)
    assert bm.num_cached == 0 and bm.evictions == 1
    assert bm.match_prefix([1, 2]) == []
    bm.check_invariants()
    events = bm.take_events()
    assert [type(e) for e in events].count(BlockRemoved) == 1, "the eviction is in the queue, by key"
    deltas = fold.fold(events)
    evicted = [b for b, _ in deltas.alloc if b in deltas.freed]
    assert len(evicted) == 1, "an evicted cached block leaves the cache through freed (and is reused)"


def test_full_prompt_hit_copies_the_last_block():
    bm = BlockManager(6, 4, enable_caching=True)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    a, b = _req(0, prompt), _req(1, prompt)
    assert bm.admit(a, [], 0, 8)
    bm.commit(a, 8)
    hits = bm.match_prefix(prompt)
    assert len(hits) == 2
    bm.take_events()
    # computed = 7: the write of token 8 lands in the second block, which is copied
    assert bm.admit(b, hits, 7, 8) and b.num_computed_tokens == 7
    t0, t1 = a.block_table, b.block_table
    assert t1[0] == t0[0] and t1[1] != t0[1]
    assert bm.pop_copies() == [(t0[1], t1[1])] and bm.cow_copies == 1
    assert BlockCopied(t0[1], t1[1], 1) in bm.take_events(), "the copy is in the queue"
    assert bm.ref_counts[t0[0]] == 2 and bm.ref_counts[t0[1]] == 1
    bm.check_invariants()
    assert blocks_needed(8, 4) == 2
