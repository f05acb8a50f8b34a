"""Prefix caching, swap preemption and the policies keep greedy outputs equal to transformers'.

Each test compares token for token with transformers' own `generate` (see conftest),
checks that the feature really happened (hits, copy-on-write, swaps, priority
preemptions), that the event stream says so, and that nothing leaked.
"""

from __future__ import annotations

import random
import sys
import types

import pytest

from conftest import token_prompts
from kvscope.engine import LLM, SamplingParams
from kvscope.errors import KvscopeError
from kvscope.engine.sched.policies import Policy
from kvscope.protocol.blockmap import BlockMap

MAX_TOKENS = 16
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def shared_prefix_prompts(vocab: int, seed: int = 3) -> list[list[int]]:
    """Prompts over two system prefixes (one exactly two 16-token blocks long), with repeats."""
    rng = random.Random(seed)
    sys_a = [rng.randrange(3, vocab) for _ in range(32)]
    sys_b = [rng.randrange(3, vocab) for _ in range(21)]
    tail = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    return [sys_a + tail(5), sys_a + tail(17), sys_a, sys_b + tail(9), sys_a + tail(1), sys_b + tail(30), sys_a]


def check_clean(llm) -> None:
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_used == 0 and not bm.tables, "blocks leaked after all requests finished"
    pool = llm.engine.scheduler.swap_pool
    if pool is not None:
        pool.check_invariants()
        assert pool.num_used == 0, "swap pool leaked"


def check_stream_blocks(recorder, llm) -> None:
    """Block owners and refcounts rebuilt from the first snapshot + step deltas equal the engine's own."""
    snaps = recorder.of_type("snapshot")
    live = BlockMap.from_snapshot(snaps[0])
    for ev in recorder.of_type("step"):
        live.apply_step(ev)
    final = BlockMap.from_snapshot(llm.engine.snapshot())
    assert live.refcounts() == final.refcounts()
    assert {b for b, o in live.owners().items() if o < 0} == {b for b, c in final.refcounts().items() if c == 0}
    # the claimer of every owned or cached block too: a seek to the snapshot shows what live showed
    assert (live.owner, live.refcount, live.cached) == (final.owner, final.refcount, final.cached)


@pytest.mark.parametrize("mode", ["naive", "continuous", "chunked"])
@pytest.mark.parametrize("model_name", ["tiny", "llama"])
def test_prefix_caching_matches_transformers(models, recorder, model_name, mode):
    model_arg, ref, vocab = models[model_name]
    prompts = shared_prefix_prompts(vocab)
    expected = ref.greedy_all(prompts, MAX_TOKENS)
    llm = LLM(model_arg, sink=recorder, mode=mode, device="cpu", dtype="float32", num_blocks=40, prefix_caching=True,
              max_num_batched_tokens=48)
    # the first prompt warms the cache; the rest are admitted together and share with each other too
    outs = llm.generate(prompts[:1], PARAMS) + llm.generate(prompts[1:], PARAMS)
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.token_ids == exp, f"prompt {i} diverged with prefix caching on"
    bm = llm.engine.block_manager
    assert bm.hit_tokens > 0 and bm.cow_copies >= 1, (bm.hit_tokens, bm.cow_copies)
    assert outs[2].metrics.num_cached_tokens == 31, "a fully cached prompt still computes its last token"
    hits = [h for e in recorder.of_type("step") for h in e.hits]
    assert sum(h.tokens for h in hits) == bm.hit_tokens
    assert {h.req: h.tokens for h in hits}.get(outs[2].req_id) == 31
    steps = recorder.of_type("step")
    assert steps[-1].kv.cached > 0
    if mode != "naive":  # naive runs one request at a time: cached blocks are revived, never shared
        assert max(e.kv.shared for e in steps) > 0
    assert steps[-1].kv.hit_tokens == bm.hit_tokens and steps[-1].kv.cow_copies == bm.cow_copies
    check_clean(llm)
    check_stream_blocks(recorder, llm)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no_cache", "cache"])
@pytest.mark.parametrize("mode", ["continuous", "chunked"])
def test_swap_preemption_matches_transformers(models, recorder, mode, prefix_caching):
    model_arg, ref, vocab = models["tiny"]
    prompts = token_prompts([30, 45, 20, 38, 50, 27], vocab, seed=6)
    if prefix_caching:
        prompts += [prompts[1][:40] + prompts[0][:9], list(prompts[4])]
    expected = ref.greedy_all(prompts, MAX_TOKENS + 8)
    llm = LLM(model_arg, sink=recorder, mode=mode, device="cpu", dtype="float32", num_blocks=10, preemption="swap",
              swap_space=0.05, prefix_caching=prefix_caching, max_num_batched_tokens=32)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS + 8, ignore_eos=True))
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.token_ids == exp, f"prompt {i} diverged with swap preemption"
    steps = recorder.of_type("step")
    pre = [p for e in steps for p in e.preemptions]
    swaps = [s for e in steps for s in e.swaps]
    assert pre and all(p.mode == "swap" for p in pre), "the tight cache was meant to force swap preemption"
    assert sum(s.blocks for s in swaps if s.direction == "out") == sum(s.blocks for s in swaps if s.direction == "in")
    assert any(e.swapped for e in steps) and max(e.kv.swap_used for e in steps) > 0
    assert llm.engine.scheduler.num_recomputed_tokens == 0
    check_clean(llm)
    check_stream_blocks(recorder, llm)


def test_swap_pool_too_small_falls_back_to_recompute(models, recorder):
    model_arg, ref, vocab = models["tiny"]
    prompts = token_prompts([30, 45, 20, 38, 50, 27], vocab, seed=6)
    expected = ref.greedy_all(prompts, MAX_TOKENS)
    llm = LLM(model_arg, sink=recorder, mode="chunked", device="cpu", dtype="float32", num_blocks=10, preemption="swap",
              swap_space=0.0)
    outs = llm.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == expected
    pre = [p for e in recorder.of_type("step") for p in e.preemptions]
    assert pre and all(p.mode == "recompute" for p in pre)
    assert llm.engine.scheduler.num_recomputed_tokens > 0
    check_clean(llm)


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "priority"])
@pytest.mark.parametrize("mode", ["continuous", "chunked"])
def test_policies_match_transformers(models, recorder, policy, mode):
    model_arg, ref, vocab = models["tiny"]
    lengths = [30, 45, 20, 38, 50, 27, 9, 60]
    prompts = token_prompts(lengths, vocab, seed=8)
    expected = ref.greedy_all(prompts, MAX_TOKENS)
    priority = [0, 0, 1, 0, 2, 0, 2, 1]
    llm = LLM(model_arg, sink=recorder, mode=mode, device="cpu", dtype="float32", num_blocks=12, policy=policy,
              max_num_batched_tokens=48, max_num_seqs=3)
    # arrivals spread over steps so that later, higher-priority requests meet running ones
    engine = llm.engine
    ids = []
    for i, p in enumerate(prompts):
        ids.append(engine.add_request(p, PARAMS, priority=priority[i]))
        engine.step()
    done = {}
    while engine.has_unfinished():
        for r in engine.step():
            done[r.req_id] = r
    for rid, exp in zip(ids, expected):
        assert done[rid].output_token_ids == exp, f"{policy}: request {rid} diverged"
    steps = recorder.of_type("step")
    pre = [p for e in steps for p in e.preemptions]
    by_reason = {p.reason for p in pre}
    if policy == "priority":
        assert "priority" in by_reason, "a high-priority arrival was meant to preempt"
        prio = dict(zip(ids, priority))
        for e in steps:
            for p in e.preemptions:
                if p.reason == "priority":
                    assert any(prio[r] > prio[p.req] for r in e.running + e.waiting), "preempted for no one higher"
            if len(e.waiting) > 1:
                ws = [prio[r] for r in e.waiting]
                assert ws == sorted(ws, reverse=True), "WAITING is not in priority order in the events"
    else:
        assert "priority" not in by_reason
    check_clean(llm)


class LongestFirst(Policy):
    """A user policy for the tests: longest prompt first."""

    def order(self, waiting, step):
        return sorted(waiting, key=lambda r: -r.num_prompt_tokens)


class DuckPolicy:
    """Not a Policy subclass: only order(); the rest falls back to FCFS."""

    def order(self, waiting, step):
        return list(reversed(waiting))


def test_user_policy_from_module_path(models, recorder, monkeypatch):
    model_arg, ref, vocab = models["tiny"]
    mod = types.ModuleType("kvscope_test_user_policies")
    mod.LongestFirst, mod.DuckPolicy = LongestFirst, DuckPolicy
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    prompts = token_prompts([5, 40, 20, 33], vocab, seed=9)
    expected = ref.greedy_all(prompts, MAX_TOKENS)
    for cls in ("LongestFirst", "DuckPolicy"):
        recorder.events.clear()
        llm = LLM(model_arg, sink=recorder, device="cpu", dtype="float32", num_blocks=40, max_num_seqs=1,
                  policy=f"{mod.__name__}:{cls}")
        outs = llm.generate(prompts, PARAMS)
        assert [o.token_ids for o in outs] == expected
        first = [e.waiting for e in recorder.of_type("step") if len(e.waiting) == 3][0]
        if cls == "LongestFirst":
            assert first == [3, 2, 0], "the policy's order of WAITING (longest first) is in the events"
        check_clean(llm)
    bad = types.ModuleType("kvscope_test_bad_policy")
    bad.Lying = type("Lying", (Policy,), {"order": lambda self, w, s: list(w)[:1]})
    monkeypatch.setitem(sys.modules, bad.__name__, bad)
    llm = LLM(model_arg, device="cpu", dtype="float32", num_blocks=40, max_num_seqs=1, policy=f"{bad.__name__}:Lying")
    with pytest.raises(KvscopeError, match="order\\(\\) must return the same requests"):
        llm.generate(prompts, PARAMS)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_dashboard_from_deltas_equals_snapshots(models, recorder, policy):
    """With sharing, caching, copy-on-write and swaps, the TUI's picture rebuilt from step deltas
    equals the one a snapshot gives at every snapshot (so a replay seek shows what live showed)."""
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.tui.model.state import new_state, picture, reduce

    model_arg, _, vocab = models["tiny"]
    prompts = shared_prefix_prompts(vocab, seed=4) + token_prompts([30, 45, 20, 38], vocab, seed=2)
    engine = LLMEngine(EngineConfig(model=model_arg, device="cpu", dtype="float32", num_blocks=14, prefix_caching=True,
                                    preemption="swap", swap_space=0.01, policy=policy,
                                    max_num_batched_tokens=40),
                       sink=recorder, snapshot_every=3, snapshot_interval_s=1e9)
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True), priority=i % 3)
        engine.step()
    while engine.has_unfinished():
        engine.step()
    engine.close()
    state = new_state()
    checked = 0
    for ev in recorder.events:
        if ev.type == "snapshot" and state.last_step is not None:
            a, b = picture(state), picture(reduce(new_state(state.config), ev))
            assert a == b, f"step {ev.step}: " + ", ".join(k for k in a if a[k] != b[k])
            checked += 1
        state = reduce(state, ev)
    steps = recorder.of_type("step")
    assert checked > 10
    assert any(e.swaps for e in steps) and any(e.hits for e in steps)
    assert any(r.refcount > 1 for e in steps for r in e.refs), "no block was shared"
    assert state.swap_out_count > 0 and state.hit_count > 0


def test_cli_feature_flags_reach_the_config_and_bad_ones_fail_in_one_line(capsys):
    from kvscope.cli import build_parser, main
    from kvscope.cli.common import engine_config as _engine_config

    args = build_parser().parse_args(["serve", "--prefix-caching", "--preemption", "swap", "--swap-space", "0.5",
                                      "--policy", "priority"])
    config = _engine_config(args)
    assert (config.prefix_caching, config.preemption, config.swap_space, config.policy) == (True, "swap", 0.5,
                                                                                            "priority")
    assert _engine_config(build_parser().parse_args(["serve", "--no-prefix-caching"])).prefix_caching is False

    assert main(["bench-features", "--experiments", "nope"]) == 2
    assert main(["serve", "--device", "cpu", "--policy", "no_such_mod_q:X", "--num-requests", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "unknown experiment 'nope'" in err[0] and "cannot import 'no_such_mod_q'" in err[1]
