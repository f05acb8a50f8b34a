"""Parallel sampling (SamplingParams.n): n sequences fork from one prompt and share its blocks.

The first sequence computes the prompt; the other n-1 then share its blocks by refcount and
compute only the last prompt token, into a copy of the block that holds it (copy-on-write),
so each samples its own first token. At temperature 0 every sequence equals transformers'
greedy output; seeded, sequence i is reproducible and equals n=1 with seed + i. The prompt is
computed once however the first sequence ends, in every mode, with prefix caching or not, and a
sequence preempted by recompute shares the prompt again instead of computing it.
"""

from __future__ import annotations

import pytest
from conftest import token_prompts
from kvscope.engine import LLM, SamplingParams
from kvscope.engine.config import EngineConfig
from kvscope.engine.errors import RequestRejected
from kvscope.engine.kv.events import BlockCopied
from kvscope.engine.llm_engine import LLMEngine


def test_n_greedy_sequences_equal_the_single_greedy_one(models):
    model_arg, ref, vocab = models["tiny"]
    prompts = token_prompts([21, 40], vocab, seed=5)  # (21 - 1) % 16 and (40 - 1) % 16 are not 0: copies
    llm = LLM(model_arg, device="cpu", dtype="float32", mode="chunked", num_blocks=48, block_size=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True, n=4))
    single = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    for out, one, prompt in zip(outs, single, prompts):
        assert [c.index for c in out.outputs] == [0, 1, 2, 3] and len({c.req_id for c in out.outputs}) == 4
        assert [c.token_ids for c in out.outputs] == [ref.greedy(prompt, 10)] * 4
        assert out.token_ids == one.token_ids == one.outputs[0].token_ids
        assert [c.text for c in out.outputs] == [one.text] * 4 and one.text, "each sequence has its own text"
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free == bm.num_blocks and bm.cow_copies == 2 * 3


def test_the_prompt_blocks_are_shared_n_ways_while_they_run(models):
    model_arg, ref, vocab = models["tiny"]
    prompt = token_prompts([37], vocab, seed=6)[0]  # 3 blocks; the last prompt token is in the third
    engine = LLMEngine(EngineConfig(model=model_arg, device="cpu", num_blocks=32, block_size=16))
    seen: list = []
    engine.kv_event_consumers.append(seen.extend)
    first = engine.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True, n=4))
    bm, sched = engine.block_manager, engine.scheduler
    ids = sched.requests[first].seq_ids
    assert len(ids) == 4 and ids[0] == first
    shared_seen = 0
    done = {}
    while engine.has_unfinished():
        for req in engine.step():
            done[req.req_id] = req.output_token_ids
        running = [r for r in sched.running if r.req_id in ids]
        if len(running) == 4:
            table = sched.requests[first].block_table
            assert [bm.ref_counts[b] for b in table[:2]] == [4, 4], "the full prompt blocks are shared 4 ways"
            assert all(r.block_table[:2] == table[:2] for r in running)
            assert len({r.block_table[2] for r in running}) == 4, "each writes its own copy of the third block"
            shared_seen += 1
        bm.check_invariants()
    assert shared_seen > 0
    copies = [e for e in seen if type(e) is BlockCopied]
    assert len(copies) == 3 and {c.req for c in copies} == set(ids[1:]), "the copies are in the event queue"
    assert all(c.src == copies[0].src for c in copies)
    assert [done[i] for i in ids] == [ref.greedy(prompt, 6)] * 4


def test_seeded_samples_are_reproducible_per_sequence(models):
    model_arg, _, vocab = models["tiny"]
    prompt = token_prompts([18], vocab, seed=7)[0]
    llm = LLM(model_arg, device="cpu", num_blocks=48)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True, n=3)
    a = [c.token_ids for c in llm.generate([prompt], params)[0].outputs]
    b = [c.token_ids for c in llm.generate([prompt], params)[0].outputs]
    assert a == b
    alone = [llm.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=11 + i,
                                                   ignore_eos=True))[0].token_ids for i in range(3)]
    assert a == alone, "sequence i samples as a single request seeded seed + i"
    assert len({tuple(t) for t in a}) > 1, "three seeds gave the same 12 tokens: the samples are not independent"


def test_a_bad_n_is_refused_in_one_line():
    llm = LLM("tiny", device="cpu", num_blocks=16)
    for n in (0, 65, 2.5, True):
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, n=n))[0]
        assert out.finish_reason == "rejected" and "n must be" in out.error
    try:
        llm.engine.add_request([5, 6], SamplingParams(n=-1))
    except RequestRejected as e:
        assert "\n" not in str(e)
    else:
        raise AssertionError("n=-1 was accepted")


# ---- the prompt is computed once, however the first sample ends --------------------------------------
# Counted from the step events: every token a step computes is a batch entry (request, start, tokens).
# n=1 computes each prompt position once. n samples compute each position but the last once, and the
# last position n times: each of the other n-1 computes that one token itself (its own logits, so its own
# first sample) into its copy of the block holding it. So n=64 computes the n=1 count plus 63 tokens.
N = 64
PROMPT = [(i * 7 + 10) % 250 for i in range(300)]  # 300 tokens: 18 full blocks of 16, the last one partly full;
# its greedy first token is "5", which a stop string can match alone


class _Steps:
    def __init__(self):
        self.steps = []

    def publish(self, ev):
        if ev.type == "step":
            self.steps.append(ev)

    def close(self):
        pass


def _engine(mode: str, prefix_caching: bool, **settings) -> tuple[LLM, _Steps]:
    config = dict(device="cpu", dtype="float32", mode=mode, prefix_caching=prefix_caching, num_blocks=160,
                  max_num_seqs=64, max_num_batched_tokens=512, max_model_len=512)
    llm = LLM("tiny", **{**config, **settings})
    steps = _Steps()
    llm.engine.attach(steps)
    return llm, steps


def _prompt_positions_computed(steps: _Steps, ids, prompt_len: int) -> list[int]:
    """How many times each prompt position was computed, over the requests `ids`."""
    counts = [0] * prompt_len
    for ev in steps.steps:
        for b in ev.batch:
            if b.req in ids:
                for pos in range(b.start, min(b.start + b.tokens, prompt_len)):
                    counts[pos] += 1
    return counts


def _drained(llm: LLM) -> None:
    sched = llm.engine.scheduler
    assert not sched._lingering and not sched._unforked and not sched._forks and not sched._families
    sched.bm.check_invariants()
    assert sched.bm.num_used == 0


def _run(llm: LLM, params: SamplingParams, abort_parent_after: int | None = None):
    """Serve one prompt; abort_parent_after=k aborts its first sample after k steps (0: before any)."""
    engine = llm.engine
    rid = engine.add_request(PROMPT, params)
    ids = set(engine.scheduler.requests[rid].seq_ids or [rid])
    done = {}
    steps = 0
    while engine.has_unfinished():
        if steps == abort_parent_after:
            assert rid in engine.scheduler.requests, "the first sample ended before the abort"
            engine.abort_request(rid)
        for req in engine.step():
            done[req.req_id] = req
        steps += 1
    assert set(done) == ids
    return rid, ids, done


def test_n1_computes_each_prompt_position_once():
    for mode in ("naive", "static", "continuous", "chunked"):
        llm, steps = _engine(mode, False)
        rid, ids, _ = _run(llm, SamplingParams(max_tokens=1))
        assert _prompt_positions_computed(steps, ids, len(PROMPT)) == [1] * len(PROMPT)


ENDS = {  # every sample ends at its first token
    "max_tokens=1": dict(max_tokens=1, ignore_eos=True, temperature=1.0, seed=3),
    "stop_token_ids": dict(max_tokens=16, ignore_eos=True, stop_token_ids=list(range(260)), temperature=1.0,
                           seed=3),
    "eos": dict(max_tokens=16, temperature=1.0, seed=3),  # with every token an EOS (below)
    "stop string": dict(max_tokens=16, ignore_eos=True, temperature=0.0),  # the greedy first token's text
}


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("mode", ["naive", "static", "continuous", "chunked"])
@pytest.mark.parametrize("end", list(ENDS))
def test_n_samples_that_stop_at_their_first_token_compute_the_prompt_once(mode, prefix_caching, end):
    llm, steps = _engine(mode, prefix_caching)
    params = SamplingParams(n=N, **ENDS[end])
    if end == "eos":
        llm.engine.loaded.eos_token_ids = frozenset(range(llm.engine.loaded.vocab_size))
    if end == "stop string":
        params.stop = ["5"]
    rid, ids, done = _run(llm, params)
    if end == "stop string":
        assert {tuple(r.output_token_ids) for r in done.values()} == {(ord("5"),)}
    assert {r.finish_reason for r in done.values()} == {"length" if end == "max_tokens=1" else "stop"}
    assert all(r.num_output_tokens == 1 for r in done.values())
    counts = _prompt_positions_computed(steps, ids, len(PROMPT))
    assert counts[:-1] == [1] * (len(PROMPT) - 1), "a prompt position was computed again"
    assert counts[-1] == N, "each sample computes the last prompt token once, for its own first sample"
    assert sum(counts) == len(PROMPT) + N - 1  # the n=1 count plus n-1
    _drained(llm)


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("mode,when", [
    ("chunked", 0), ("chunked", 1), ("chunked", 3),  # before any step; mid-prefill; after the first token
    ("continuous", 0), ("continuous", 1), ("naive", 0), ("naive", 1), ("static", 0), ("static", 1)])
def test_aborting_the_first_sample_does_not_make_the_others_compute_the_prompt(mode, when, prefix_caching):
    """Aborted before its prompt is computed, the first sample's place and computed KV go to the next
    sample, which computes the rest of the prompt for the others; aborted after, its blocks stay held
    until every sample has taken them."""
    llm, steps = _engine(mode, prefix_caching, max_num_batched_tokens=128)  # chunked: the prompt in 3 steps
    after_first_token = when == (3 if mode == "chunked" else 1)
    greedy = SamplingParams(max_tokens=2 if after_first_token else 1, ignore_eos=True, temperature=0.0, n=N)
    rid, ids, done = _run(llm, greedy, abort_parent_after=when)
    assert done[rid].finish_reason == "abort"
    counts = _prompt_positions_computed(steps, ids, len(PROMPT))
    assert counts[:-1] == [1] * (len(PROMPT) - 1), "a prompt position was computed again"
    assert counts[-1] == (N if after_first_token else N - 1)
    single = llm.generate([PROMPT], SamplingParams(max_tokens=greedy.max_tokens, ignore_eos=True, temperature=0.0))
    assert [done[i].output_token_ids for i in sorted(ids - {rid})] == [single[0].token_ids] * (N - 1)
    _drained(llm)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preempted_samples_take_the_prompt_blocks_again_instead_of_computing_them(preemption):
    """Too few blocks for every sample to decode: the newest running ones are preempted. A sample preempted by
    recompute shares the prompt again from a sample holding it (one that ends first holds it for them);
    a swapped one brings its own copy back. Either way each prompt position but the last is computed once."""
    llm, steps = _engine("chunked", False, num_blocks=40, preemption=preemption, swap_space=0.01)
    n, prompt = 8, PROMPT[:100]  # 6 full prompt blocks shared; each sample needs 4 more for 64 tokens
    params = SamplingParams(n=n, max_tokens=64, ignore_eos=True, temperature=1.0, seed=5)
    out = llm.generate([prompt], params)[0]
    preempted = [p for ev in steps.steps for p in ev.preemptions]
    assert preempted and {p.mode for p in preempted} == {preemption}
    rid = out.req_id
    ids = set(range(rid, rid + n))
    counts = _prompt_positions_computed(steps, ids, len(prompt))
    assert counts[:-1] == [1] * (len(prompt) - 1), "a prompt position was computed again"
    alone = [llm.generate([prompt], SamplingParams(max_tokens=64, ignore_eos=True, temperature=1.0,
                                                   seed=5 + i))[0].token_ids for i in range(n)]
    assert [c.token_ids for c in out.outputs] == alone, "sample i still samples as seed + i alone"
    _drained(llm)
