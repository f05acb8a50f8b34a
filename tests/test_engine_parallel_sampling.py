"""Parallel sampling (SamplingParams.n): n sequences fork from one prompt and share its blocks.

The first sequence computes the prompt; the other n-1 then share its blocks by refcount and
compute only the last prompt token, into a copy of the block that holds it (copy-on-write),
so each samples its own first token. At temperature 0 every sequence equals transformers'
greedy output; seeded, sequence i is reproducible and equals n=1 with seed + i.
"""

from __future__ import annotations

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
