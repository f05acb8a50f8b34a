"""Greedy outputs of every mode equal transformers' own `generate`, token for token.

Two models with different attention shapes (the built-in tiny Qwen3, and a
GQA Llama loaded from a checkpoint directory) run under several conditions that
each stress a different part of the engine: block boundaries, preemption with
recompute, chunked prefill under a small token budget, a larger block size,
and stopping at EOS.
"""

from __future__ import annotations

import pytest

from conftest import LLAMA_EOS_PROBE_TOKENS, eos_probe_prompts, token_prompts
from kvscope.engine import LLM, SamplingParams

MODES = ("naive", "static", "continuous", "chunked")
MAX_TOKENS = 20

# name -> (engine settings, prompt lengths)
CONDITIONS = {
    # the engine's own defaults (KV cache sized from memory, budget 512, block 16)
    "default": ({}, [6, 23, 41, 12]),
    # prompt ends on each side of a 16-token block boundary; decode then crosses more
    # (and one long enough that its context spans 10+ blocks)
    "block_boundaries": (dict(block_size=16, num_blocks=48), [1, 15, 16, 17, 31, 33, 70, 150]),
    # 10 blocks of 16 hold one or two of these at full length, not all: recompute preemption
    "preemption": (dict(block_size=16, num_blocks=10), [30, 45, 20, 38, 50, 27]),
    # a 24-token budget is smaller than most prompts: chunked prefill must split them
    "small_budget": (dict(num_blocks=48, max_num_batched_tokens=24), [40, 70, 33, 8, 55]),
    # both at once: chunks and preemption interleave
    "preemption_small_budget": (dict(num_blocks=10, max_num_batched_tokens=32), [30, 45, 20, 38, 50, 27]),
    # 32-token blocks, boundaries at 32 and 64
    "block_size_32": (dict(block_size=32, num_blocks=24), [1, 31, 32, 33, 63, 64, 65]),
}


def run(model_arg, mode, settings, prompts, params, recorder):
    llm = LLM(model_arg, sink=recorder, mode=mode, device="cpu", dtype="float32", **settings)
    outs = llm.generate(prompts, params)
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free == bm.num_blocks and not bm.tables, "blocks leaked after all requests finished"
    return llm, outs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("condition", list(CONDITIONS))
@pytest.mark.parametrize("model_name", ["tiny", "llama"])
def test_greedy_matches_transformers(models, recorder, model_name, condition, mode):
    model_arg, ref, vocab = models[model_name]
    settings, lengths = CONDITIONS[condition]
    prompts = token_prompts(lengths, vocab, seed=len(lengths))
    expected = ref.greedy_all(prompts, MAX_TOKENS)

    llm, outs = run(model_arg, mode, settings, prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                    recorder)

    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.error is None
        assert out.prompt_token_ids == prompts[i]
        assert out.token_ids == exp, f"prompt {i} (len {len(prompts[i])}) diverged from transformers"
        assert out.finish_reason == "length"

    steps = recorder.of_type("step")
    budget = llm.engine.config.max_num_batched_tokens
    preemptions = sum(len(e.preemptions) for e in steps)
    assert preemptions == llm.engine.num_preemptions == sum(o.metrics.num_preemptions for o in outs)
    if condition.startswith("preemption"):
        if mode in ("continuous", "chunked"):
            assert llm.engine.num_preemptions > 0, "the tight KV cache was meant to force preemption"
        else:
            # naive runs one request that always fits; static reserves prompt + max_tokens up front
            assert llm.engine.num_preemptions == 0
    if mode == "chunked":
        for e in steps:
            assert sum(b.tokens for b in e.batch) <= budget
    if condition in ("small_budget", "preemption_small_budget") and mode == "chunked":
        chunks = recorder.prefill_chunks()
        long_reqs = [o.req_id for o, p in zip(outs, prompts) if len(p) > budget]
        assert long_reqs and all(chunks[r] > 1 for r in long_reqs), "prompts over the budget were not split"
    if mode == "naive":
        assert all(len(e.running) <= 1 for e in steps)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("settings", [{}, dict(num_blocks=8)], ids=["roomy_kv", "tight_kv"])
def test_eos_stops_like_transformers(models, recorder, mode, settings):
    """ignore_eos=False: the Llama checkpoint's eos id is one the model really emits mid-generation."""
    model_arg, ref, _ = models["llama"]
    eos = ref.eos_token_id
    prompts = eos_probe_prompts()
    n = LLAMA_EOS_PROBE_TOKENS
    expected = ref.greedy_all(prompts, n, stop_at_eos=True)
    unbounded = ref.greedy_all(prompts, n, stop_at_eos=False)
    assert any(len(e) < len(u) for e, u in zip(expected, unbounded)), "eos id never stops transformers"

    llm, outs = run(model_arg, mode, settings, prompts, SamplingParams(max_tokens=n), recorder)

    assert llm.engine.loaded.eos_token_ids == frozenset({eos})
    stopped = 0
    for out, exp in zip(outs, expected):
        assert out.token_ids == exp
        if out.finish_reason == "stop":
            stopped += 1
            assert out.token_ids[-1] == eos and len(out.token_ids) < n
            assert eos not in out.token_ids[:-1]
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == n and eos not in out.token_ids
    assert stopped >= 1
    if settings and mode in ("continuous", "chunked"):
        assert llm.engine.num_preemptions > 0


@pytest.mark.parametrize("mode", MODES)
def test_tiny_with_eos_enabled_and_text_prompts(tiny_ref, mode):
    """Text prompts through the byte tokenizer, eos honoured, same answers as transformers."""
    llm = LLM("tiny", mode=mode, device="cpu", dtype="float32", num_blocks=32)
    texts = ["hello", "the quick brown fox", "kv cache blocks of sixteen tokens each, paged"]
    outs = llm.generate(texts, SamplingParams(max_tokens=MAX_TOKENS))
    for text, out in zip(texts, outs):
        ids = llm.tokenizer.encode(text)
        assert out.prompt_token_ids == ids
        assert out.token_ids == tiny_ref.greedy(ids, MAX_TOKENS, stop_at_eos=True)
        full = llm.tokenizer.decode(out.token_ids)
        # the same text, except that a character cut off by max_tokens is left out, never shown as U+FFFD
        assert out.text == full or (full == out.text + "\ufffd" and len(out.token_ids) == MAX_TOKENS)


def test_prompt_one_short_of_max_model_len_gets_one_token(tiny_ref):
    llm = LLM("tiny", mode="chunked", device="cpu", dtype="float32", num_blocks=8, max_model_len=40)
    prompt = token_prompts([39], 256, seed=5)[0]
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))
    assert out.finish_reason == "max_model_len"
    assert out.token_ids == tiny_ref.greedy(prompt, 1)


def test_max_model_len_is_capped_by_kv_capacity():
    llm = LLM("tiny", mode="continuous", device="cpu", dtype="float32", num_blocks=3, block_size=16)
    assert llm.engine.max_model_len == 48
    (out,) = llm.generate([list(range(40))], SamplingParams(max_tokens=30, ignore_eos=True))
    assert out.finish_reason == "max_model_len" and len(out.token_ids) == 8


@pytest.mark.parametrize("model_name", ["tiny", "llama"])
def test_reference_models_are_sensitive(models, model_name):
    """A model that repeats one token, or ignores its context, would make the equality tests vacuous."""
    _, ref, vocab = models[model_name]
    lengths = CONDITIONS["block_boundaries"][1]
    prompts = token_prompts(lengths, vocab, seed=len(lengths))
    outs = ref.greedy_all(prompts, MAX_TOKENS)
    for out in outs:
        assert len(set(out)) >= 6, f"output too repetitive: {out}"
    assert len({tuple(o) for o in outs}) == len(outs), "different prompts gave the same output"
    # Changing only the first token of a 150-token prompt (which sits in the first KV block)
    # changes what comes out: attention over early blocks matters.
    long = prompts[-1]
    changed = [(long[0] + 1) % vocab] + long[1:]
    assert ref.greedy(changed, MAX_TOKENS) != ref.greedy(long, MAX_TOKENS)
