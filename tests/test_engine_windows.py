"""Sliding-window attention: greedy tokens equal transformers' generate for windowed
checkpoints, blocks outside the window are freed when every layer slides, and attention features
kvscope does not implement are refused in one line.

The checkpoints (tests/conftest.py) have windows of 24, 20 (hybrid: layer types full, sliding)
and 13 tokens, none a multiple of the block size. Every prompt set has prompts shorter than,
equal to and longer than the window, and 30 generated tokens carry each one across it.
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import WINDOWED_CONFIGS, HFReference, save_checkpoint, token_prompts
from kvscope.engine import LLM, LLMEngine, SamplingParams
from kvscope.engine.kv.block_manager import blocks_needed
from kvscope.engine.config import EngineConfig
from kvscope.errors import KvscopeError

MAX_TOKENS = 30
WINDOWS = {"mistral-w24": 24, "qwen3-hybrid-w20": 20, "qwen2-w13": 13}

CONDITIONS = {
    # 16-token chunks: with a 24-token window the second chunk straddles the window edge
    "chunks_straddle_window": dict(mode="chunked", num_blocks=40, max_num_batched_tokens=16),
    # 8-token blocks, 20-token chunks: window edges fall mid-block and mid-chunk
    "block_size_8": dict(mode="chunked", num_blocks=48, block_size=8, max_num_batched_tokens=20),
    # whole prompts in one prefill, longer than the window
    "whole_prompts": dict(mode="continuous", num_blocks=40),
    # 6 blocks: requests preempt each other (recompute), chunks under a small budget
    "preemption": dict(mode="chunked", num_blocks=6, max_num_batched_tokens=32),
    # the same pool with swap-to-CPU preemption
    "swap": dict(mode="continuous", num_blocks=6, preemption="swap", swap_space=0.01),
    # prefix caching (two prompts share their first 48 tokens), in the small pool that preempts
    "prefix_caching_preemption": dict(mode="chunked", num_blocks=6, prefix_caching=True,
                                      max_num_batched_tokens=24),
}


def window_prompts(window: int) -> list[list[int]]:
    short, equal, longer, twice, long = token_prompts([5, window, window + 1, 2 * window + 5, 57], 300, seed=window)
    return [short, equal, longer, twice, long, long[:48] + token_prompts([7], 300, seed=1)[0]]


def check_drained(llm: LLM) -> None:
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free == bm.num_blocks and not bm.tables, "blocks leaked after all requests finished"


@pytest.mark.parametrize("condition", list(CONDITIONS))
@pytest.mark.parametrize("name", list(WINDOWED_CONFIGS))
def test_windowed_greedy_matches_transformers(windowed_models, name, condition):
    path, ref = windowed_models[name]
    prompts = window_prompts(WINDOWS[name])
    expected = ref.greedy_all(prompts, MAX_TOKENS)
    llm = LLM(path, device="cpu", dtype="float32", **CONDITIONS[condition])
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.token_ids == exp, f"prompt {i} (len {len(prompts[i])}) diverged from transformers"
    check_drained(llm)
    engine = llm.engine
    all_slide = name != "qwen3-hybrid-w20"
    assert engine.block_manager.sliding_window == (WINDOWS[name] if all_slide else None)
    if "preemption" in condition or condition == "swap":
        assert engine.num_preemptions > 0, "the small pool was meant to force preemption"
    if condition.startswith("prefix_caching"):
        assert engine.block_manager.hit_tokens > 0, "the shared prefix was never hit"


@pytest.mark.parametrize("name", list(WINDOWED_CONFIGS))
def test_window_changes_transformers_output(windowed_models, name):
    """The same weights without the window answer differently: the equality tests can fail."""
    from transformers import AutoModelForCausalLM

    path, ref = windowed_models[name]
    no_window = dict(sliding_window=None) if name.startswith("mistral") else dict(
        use_sliding_window=False, layer_types=["full_attention"] * 2)
    unwindowed = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **no_window).eval()
    prompts = window_prompts(WINDOWS[name])[2:5]  # the ones longer than the window
    full = HFReference(unwindowed).greedy_all(prompts, MAX_TOKENS)
    differing = sum(a != b for a, b in zip(full, ref.greedy_all(prompts, MAX_TOKENS)))
    assert differing == len(prompts), f"only {differing} of {len(prompts)} prompts depend on the window"


class BoundChecker:
    """Checks after every step that each decoding request holds at most window + one block."""

    def __init__(self, engine: LLMEngine, max_blocks: int | None) -> None:
        self.engine, self.max_blocks = engine, max_blocks
        self.freed_while_running = 0
        self.peak = 0

    def check(self, event) -> None:
        if event.type != "step":
            return
        bm, sched = self.engine.block_manager, self.engine.scheduler
        running = {r.req_id for r in sched.running}
        if not event.finished and not event.preemptions:  # only the window can have freed them
            self.freed_while_running += len(event.freed)
        for req in sched.running:
            held = len(bm.tables.get(req.req_id, ()))
            if self.max_blocks is None:  # mask only: every block of the context stays
                assert held == blocks_needed(max(req.num_computed_tokens, 1), bm.block_size) or not req.is_decode
            elif req.is_decode:
                assert held <= self.max_blocks, f"request {req.req_id} holds {held} blocks at step {event.step}"
                self.peak = max(self.peak, held)
        assert event.kv.used == bm.num_used and running == set(event.running)


@pytest.mark.parametrize("name", ["mistral-w24", "qwen3-hybrid-w20"])
def test_long_windowed_generation_holds_window_plus_one_block(windowed_models, name):
    """100 tokens past 16-token blocks with a 24-token window: each sequence holds at most 3 blocks,
    frees show up as ordinary frees, and the block map from deltas equals every snapshot."""
    from test_engine_events import CheckingSink

    path, ref = windowed_models[name]
    window = WINDOWS[name]
    prompts = token_prompts([30, 5, 60], 300, seed=3)
    expected = ref.greedy_all(prompts, 100)
    sink = CheckingSink()
    engine = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", mode="chunked", num_blocks=64,
                                    block_size=16, max_num_batched_tokens=32), snapshot_every=9)
    uniform = engine.loaded.attention.uniform_window
    bound = BoundChecker(engine, blocks_needed(window, 16) + 1 if uniform else None)
    publish = sink.publish

    def publish_and_check(event):
        publish(event)
        bound.check(event)

    sink.publish = publish_and_check
    sink.engine = engine
    engine.attach(sink)
    ids = [engine.add_request(p, SamplingParams(max_tokens=100, ignore_eos=True)) for p in prompts]
    outputs: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for req in engine.step():
            outputs[req.req_id] = list(req.output_token_ids)
    engine.close()
    assert [outputs[i] for i in ids] == expected
    assert sink.checked_steps == engine.scheduler.step_count and sink.checked_snapshots >= 10
    assert sink.owners.owners() == {}
    if uniform:
        assert bound.peak == blocks_needed(window, 16) + 1, "the bound was never reached: nothing was tested"
        # 9 + 7 + 10 blocks of context, at most 3 held each: most were freed while running
        assert bound.freed_while_running >= 12


def test_prefix_cache_keeps_blocks_outside_the_window_cached(windowed_models):
    """Blocks that fall out of the window stay in the prefix cache (refcount 0): a later request with
    the same prefix hits them, takes only the hit blocks inside its own window, and still matches."""
    path, ref = windowed_models["mistral-w24"]
    prompt = token_prompts([64], 300, seed=21)[0]
    engine = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", mode="chunked", num_blocks=40,
                                    block_size=16, prefix_caching=True, max_num_batched_tokens=64))
    bm = engine.block_manager
    first = engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # the whole prompt: positions 0..63 computed, the window now starts at 41
    assert bm.num_cached == 2 and len(bm.tables[first]) == 2, "blocks 0 and 1 should be released and cached"
    table = bm.table(first)
    assert table[:2] == [bm.null_block] * 2, "the logical table keeps its positions, the null block in them"
    assert bm.null_block == bm.num_blocks and bm.null_block not in bm.tables[first], "the null block is no pool block"
    while engine.has_unfinished():
        engine.step()
    follow = prompt + token_prompts([9], 300, seed=22)[0]
    second = engine.add_request(follow, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    assert bm.hit_tokens == 64, "the follow-up should reuse all four prompt blocks"
    assert engine.scheduler.requests[second].num_cached_tokens == 64
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert list(done[-1].output_token_ids) == ref.greedy(follow, 20)
    bm.check_invariants()


def test_prefix_hit_needs_only_the_blocks_inside_the_window(windowed_models):
    """The leading blocks of a prefix leave the window first, so they are evicted first; a later
    request with that prefix still hits, because it needs only the cached blocks in its window."""
    path, ref = windowed_models["mistral-w24"]
    prompt = token_prompts([64], 300, seed=31)[0]
    engine = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", mode="chunked", num_blocks=8,
                                    block_size=16, prefix_caching=True, max_num_batched_tokens=96))
    bm = engine.block_manager
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    first_blocks = bm.match_prefix(prompt)  # blocks 0 and 1 are outside the window of position 63
    assert len(first_blocks) == 4 and first_blocks[:2] == [None, None]
    # an unrelated 95-token prompt (6 blocks) takes the 4 plain free blocks and evicts the two
    # oldest cached ones, blocks 0 and 1; it ends after its prefill, so it takes nothing more
    engine.add_request(token_prompts([95], 300, seed=32)[0], SamplingParams(max_tokens=1, ignore_eos=True))
    engine.step()
    assert bm.evictions == 2 and bm.match_prefix(prompt[:32]) == []
    follow = prompt + token_prompts([5], 300, seed=33)[0]
    hits_before = bm.hit_tokens
    while engine.has_unfinished():
        engine.step()
    engine.add_request(follow, SamplingParams(max_tokens=12, ignore_eos=True))
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert bm.hit_tokens - hits_before == 64, "blocks 2 and 3 alone should serve the 64-token prefix"
    assert list(done[-1].output_token_ids) == ref.greedy(follow, 12)
    bm.check_invariants()


def test_swapped_request_comes_back_with_its_window_only(windowed_models):
    """Swap-out keeps only the blocks in the window; swap-in takes fresh blocks for them alone."""
    path, ref = windowed_models["mistral-w24"]
    prompts = token_prompts([50, 45, 40], 300, seed=8)
    llm = LLM(path, device="cpu", dtype="float32", mode="chunked", num_blocks=7, max_num_batched_tokens=16,
              preemption="swap", swap_space=0.01)
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref.greedy_all(prompts, 40)
    pool = llm.engine.scheduler.swap_pool
    assert pool.blocks_out > 0 and pool.blocks_in == pool.blocks_out
    check_drained(llm)


# ---- refusals ---------------------------------------------------------------------


def _edited(tmp_path, name: str, edit: dict, drop: tuple[str, ...] = ()) -> str:
    config_cls, model_cls, overrides = WINDOWED_CONFIGS[name]
    path = save_checkpoint(tmp_path / name, config_cls, model_cls, **overrides)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    for key in drop:
        config.pop(key, None)
    config.update(edit)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


REFUSALS = {
    "attention soft-capping": ("mistral-w24", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    "final soft-capping": ("qwen3-hybrid-w20", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    "unknown layer type": ("qwen3-hybrid-w20", {"layer_types": ["full_attention", "chunked_attention"]},
                           "layer_types"),
    "sliding layers without a window": ("qwen2-w13", {"use_sliding_window": False}, "sliding_window"),
    "attention sinks": ("mistral-w24", {"use_attention_sinks": True}, "use_attention_sinks"),
    "chunked attention": ("mistral-w24", {"attention_chunk_size": 8}, "attention_chunk_size"),
    "bad window": ("mistral-w24", {"sliding_window": 0}, "sliding_window"),
    "one-token window": ("mistral-w24", {"sliding_window": 1}, "sliding_window"),
    "mistral with mixed layer types": ("mistral-w24", {"layer_types": ["full_attention", "sliding_attention"]},
                                       "layer_types"),
    "dynamic rope": ("mistral-w24", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                                         "rope_theta": 10000.0}}, "rope"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_unimplemented_attention_features_are_refused_in_one_line(tmp_path, case):
    name, edit, field = REFUSALS[case]
    path = _edited(tmp_path, name, edit)
    with pytest.raises(KvscopeError) as err:
        LLM(path, device="cpu", dtype="float32", num_blocks=8)
    message = str(err.value)
    assert field in message and "\n" not in message, message


def test_llama_with_a_window_field_is_refused(tmp_path):
    """transformers' Llama ignores sliding_window; a llama config carrying one is refused, not run unwindowed."""
    path = save_checkpoint(tmp_path / "llama", "LlamaConfig", "LlamaForCausalLM")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["sliding_window"] = 16
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(KvscopeError, match="sliding_window"):
        LLM(path, device="cpu", dtype="float32", num_blocks=8)


def test_attention_sink_weights_are_refused(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    path = save_checkpoint(tmp_path / "sinks", "MistralConfig", "MistralForCausalLM", sliding_window=24)
    weights_file = os.path.join(path, "model.safetensors")
    weights = load_file(weights_file)
    weights["model.layers.0.self_attn.sinks"] = torch.zeros(4)
    save_file(weights, weights_file, metadata={"format": "pt"})
    with pytest.raises(KvscopeError, match="sink"):
        LLM(path, device="cpu", dtype="float32", num_blocks=8)


def test_window_wider_than_every_context_equals_full_attention(tmp_path):
    """A Mistral whose window is never reached runs unchanged (and frees nothing)."""
    path = save_checkpoint(tmp_path / "wide", "MistralConfig", "MistralForCausalLM", sliding_window=4096)
    prompts = token_prompts([10, 40], 300, seed=2)
    llm = LLM(path, device="cpu", dtype="float32", mode="chunked", num_blocks=16, max_num_batched_tokens=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    from transformers import AutoModelForCausalLM

    ref = HFReference(AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval())
    assert [o.token_ids for o in outs] == ref.greedy_all(prompts, 12)
    assert llm.engine.block_manager.sliding_window == 4096


def test_mistral_listing_layer_types_that_agree_runs(tmp_path):
    """layer_types all sliding on a mistral checkpoint: Mistral's and Ministral's readings agree, so it runs."""
    from transformers import AutoModelForCausalLM

    path = _edited(tmp_path, "mistral-w24", {"layer_types": ["sliding_attention"] * 2})
    prompts = token_prompts([40], 300, seed=6)
    llm = LLM(path, device="cpu", dtype="float32", mode="chunked", num_blocks=16, max_num_batched_tokens=16)
    assert llm.engine.loaded.attention.layer_windows == (24, 24)
    ref = HFReference(AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval())
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref.greedy_all(prompts, 10)
