"""A real trained model end to end: SmolLM2-135M-Instruct from its GGUF file.

Greedy tokens equal transformers' on the same GGUF in every mode, under preemption, with
prefix caching and swap, and on the Triton kernels through the interpreter; the
end-of-turn token ends a reply with finish reason `stop`; the official openai client
chats with `kvscope serve --http` over it.

The model is fetched once into the cache (`kvscope fetch smollm2-135m`, which `make test`
runs first). transformers parses a GGUF slowly, so it is loaded once per session
(kvscope.engine.loader.gguf keeps the last file loaded): the reference is a copy of that
transformers model taken before any engine switched its attention, and it runs
transformers' own attention and `generate`. All runs are float32.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/test_kernels_engine.py

import copy  # noqa: E402

import pytest  # noqa: E402

from conftest import HFReference  # noqa: E402
from kvscope.engine import LLM, SamplingParams  # noqa: E402
from kvscope.kernels.cpu import gguf_linear  # noqa: E402

MODEL = "smollm2-135m"
MODES = ("naive", "static", "continuous", "chunked")
QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "Write a haiku about the sea.", "How many legs does a spider have?"]
MAX_TOKENS = 8


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(the engine's cached load, an independent transformers reference on a copy of its weights)."""
    from kvscope.engine.loader.gguf import load_gguf

    model, tokenizer, _ = load_gguf(smollm2_path, torch.float32, "cpu")
    assert model.config._attn_implementation != "kvscope_paged", "copy the reference before any engine runs"
    ref = copy.deepcopy(model).eval()
    return tokenizer, HFReference(ref)


@pytest.fixture(scope="session")
def chat_prompts(smollm2) -> list[list[int]]:
    """Real chat prompts through the GGUF's own template: they share its system-prompt prefix."""
    tokenizer, _ = smollm2
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in QUESTIONS]


def real_llm(path, **settings) -> LLM:
    """The dense float32 model unless told otherwise (--quantization auto would take the blocks on some CPUs)."""
    return LLM(path, device="cpu", dtype="float32", **{"quantization": "none", **settings})


def check_equal(outs, expected, prompts) -> None:
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.error is None and out.prompt_token_ids == prompts[i]
        assert out.token_ids == exp, f"prompt {i} diverged from transformers"


@pytest.mark.parametrize("mode", MODES)
def test_greedy_matches_transformers_in_every_mode(smollm2, smollm2_path, chat_prompts, mode):
    _, ref = smollm2
    llm = real_llm(smollm2_path, mode=mode, num_blocks=64, max_num_batched_tokens=48)
    outs = llm.generate(chat_prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    check_equal(outs, ref.greedy_all(chat_prompts, MAX_TOKENS), chat_prompts)
    assert all(o.finish_reason == "length" for o in outs)
    assert llm.engine.loaded.num_layers == 30 and llm.engine.loaded.num_kv_heads == 3  # the real shape


def test_greedy_under_preemption(smollm2, smollm2_path, chat_prompts):
    _, ref = smollm2
    # 9 blocks of 8 tokens hold one or two of these ~45-token requests, not four: recompute preemption
    llm = real_llm(smollm2_path, mode="chunked", block_size=8, num_blocks=9, max_num_batched_tokens=32)
    outs = llm.generate(chat_prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    check_equal(outs, ref.greedy_all(chat_prompts, MAX_TOKENS), chat_prompts)
    assert llm.engine.num_preemptions > 0, "the tight cache was meant to force preemption"


def test_greedy_with_prefix_caching_and_swap(smollm2, smollm2_path, chat_prompts):
    _, ref = smollm2
    llm = real_llm(smollm2_path, mode="chunked", block_size=8, num_blocks=9, max_num_batched_tokens=32,
                   prefix_caching=True, preemption="swap", swap_space=0.05)
    outs = llm.generate(chat_prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    check_equal(outs, ref.greedy_all(chat_prompts, MAX_TOKENS), chat_prompts)
    assert llm.engine.block_manager.hit_tokens > 0, "the template's shared system prompt was meant to hit"
    assert llm.engine.num_preemptions > 0 and llm.engine.scheduler.swap_pool.num_used == 0


def test_end_of_turn_stops_the_reply(smollm2, smollm2_path, chat_prompts):
    tokenizer, ref = smollm2
    llm = real_llm(smollm2_path, num_blocks=64)
    assert llm.engine.loaded.eos_token_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    (out,) = llm.generate([chat_prompts[0]], SamplingParams(max_tokens=24))
    assert out.token_ids == ref.greedy(chat_prompts[0], 24, stop_at_eos=True)
    assert out.finish_reason == "stop" and "Paris" in out.text and "<|im_end|>" not in out.text


def test_greedy_on_triton_kernels_under_the_interpreter(smollm2, smollm2_path):
    from test_kernels_engine import TRITON_OPS

    _, ref = smollm2
    prompts = [[1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47]]  # few tokens: the interpreter is slow
    llm = real_llm(smollm2_path, mode="chunked", num_blocks=4, max_num_batched_tokens=6)
    llm.engine.runner.ops = TRITON_OPS
    outs = llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref.greedy_all(prompts, 2)


def test_chat_over_http_with_the_openai_client(smollm2, smollm2_path):
    import openai
    from _serve import serving
    from kvscope.engine.config import EngineConfig

    config = EngineConfig(model=smollm2_path, device="cpu", dtype="float32", num_blocks=64)
    with serving(config, served_model_name=MODEL) as live, openai.OpenAI(
            base_url=live.base_url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        plain = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=32)
        choice = plain.choices[0]
        assert "Paris" in choice.message.content and choice.finish_reason == "stop"
        stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=32,
                                                stream=True)
        parts, reasons = [], []
        for chunk in stream:
            for c in chunk.choices:
                parts.append(c.delta.content or "")
                reasons.append(c.finish_reason)
        assert "".join(parts) == choice.message.content
        assert [r for r in reasons if r] == ["stop"]


def test_a_bench_serves_its_own_token_ids_to_their_lengths_on_a_text_model(smollm2, smollm2_path):
    """Every bench row serves the same work: on a model with a chat template the workload's own requests
    become real instructions (serve, demo), but a bench's fixed items keep their token ids and run to
    their max_tokens, as the peers' rows do (once, kvscope's rows served other prompts and stopped at EOS)."""
    from kvscope.bench.harness import run_config
    from kvscope.engine.config import EngineConfig
    from kvscope.workload.generate import WorkloadRequest

    items = [WorkloadRequest(arrival=0.0, prompt=[200 + i] * (10 + i), max_tokens=5 + i) for i in range(3)]
    seen: list[list[int]] = []

    def record_prompts(engine):
        add = engine.add_request
        engine.add_request = lambda prompt, *a, **kw: (seen.append(list(prompt)), add(prompt, *a, **kw))[1]

    config = EngineConfig(model=smollm2_path, device="cpu", dtype="float32", num_blocks=64)
    _, server = run_config(config, items, before_run=record_prompts)
    assert seen == [it.prompt for it in items]
    assert server.metrics.output_tokens == sum(it.max_tokens for it in items)


def test_fused_bf16_layer_rounds_where_the_aten_ops_round(smollm2_path, chat_prompts):
    """One layer of a real decode step on the blocks, fused (cpu_decoder.cpp's one-pass loops) against the ATen
    ops it replaces, on the same inputs: the same rounding points, so nearly every bf16 value is the same bits
    and the rest are a unit or two in the last place (a norm's sum in another order). A wrong rotary, slot
    or activation differs everywhere."""
    import dataclasses

    from kvscope.kernels.cpu import library as cpu_attention

    llm = LLM(smollm2_path, device="cpu", dtype="bfloat16", num_blocks=64, quantization="gguf")
    native = llm.engine.runner.decoder.native
    if native is None:
        pytest.skip(f"the C++ layers are not loaded: {llm.engine.runner.decoder.native_why}")
    captured = []
    run = native.run

    class Capture:
        def __getattr__(self, name):
            return getattr(native, name)

        def run(self, hidden, cos, signed_sin, kv_cache, meta):
            # the first decode-only step (a step with a prefill row comes here too where no dense loop takes it:
            # bf16 on a CPU where oneDNN packs no bf16 weights), before it writes the cache
            if not captured and not cpu_attention.decode_plan(meta).has_prefills:
                captured.append((hidden.clone(), cos, signed_sin, kv_cache.clone(), meta))
            return run(hidden, cos, signed_sin, kv_cache, meta)

    llm.engine.runner.decoder.native = Capture()
    llm.generate(chat_prompts[:2], SamplingParams(max_tokens=3, ignore_eos=True))
    assert captured, "no decode-only step ran the C++ layers"
    hidden, cos, signed_sin, kv_cache, meta = captured[0]
    one = dataclasses.replace(native, weights=native.weights[:6], linear_types=native.linear_types[:4],
                              optional=native.optional[:6], eps=native.eps[:4], scaling=native.scaling[:1],
                              windows=native.windows[:1])
    caches = {fused: kv_cache.clone() for fused in (False, True)}
    out = {fused: dataclasses.replace(one, fused=fused).run(hidden, cos, signed_sin, caches[fused], meta)
           for fused in (False, True)}
    want, got = out[False].float(), out[True].float()
    assert got.shape == want.shape and not torch.equal(hidden, out[True])
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(2.0 ** -100))) - 7)
    assert ((want - got).abs() <= 2 * ulp).all(), f"max diff {(want - got).abs().max().item()}"
    assert (want == got).float().mean().item() >= 0.95
    written = caches[False][0] != kv_cache[0]
    assert written.any(), "the step wrote its k and v"
    assert (caches[True][0] == caches[False][0]).float().mean().item() >= 0.999


def test_bf16_greedy_matches_transformers_up_to_near_ties_on_the_real_model(smollm2, smollm2_path, chat_prompts):
    """The trained model in bf16 (what --dtype auto runs on a CPU with AVX-512 BF16 or AMX), in every mode,
    against transformers in bf16 on the same weights.

    The reference is the float32 reference's copy cast to bf16: the same bits as transformers' own bf16 load of
    the GGUF (its dequantized float32 values, rounded), without a second parse. Not the loader's bf16 model: the
    first engine to load it shares it, and switches its attention to kvscope's (on a fresh model cache the
    converting engine runs on that very object)."""
    from _bf16 import check_within_near_ties
    from kvscope.engine.cpu.dtype import auto_cpu_dtype

    _, reference = smollm2
    ref = copy.deepcopy(reference.model).to(torch.bfloat16).eval()
    assert ref.config._attn_implementation != "kvscope_paged"
    max_tokens = 16
    # Every mode where bf16 is what --dtype auto runs; elsewhere (no bf16 in hardware: emulated, and several times
    # slower) the chunked mode alone, whose steps mix prefill chunks and decodes: the modes differ only in what the
    # scheduler packs, which the float32 tests above check token for token on every CPU
    modes = MODES if auto_cpu_dtype().name == "bfloat16" else ("chunked",)
    for mode in modes:
        llm = LLM(smollm2_path, device="cpu", dtype="bfloat16", mode=mode, num_blocks=64, max_num_batched_tokens=48)
        assert llm.engine.dtype == "bfloat16"
        outs = llm.generate(chat_prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        at_top = check_within_near_ties(ref, chat_prompts, outs, max_tokens)
        assert at_top >= 0.9 * max_tokens * len(chat_prompts), f"{mode}: only {at_top} tokens at transformers' top"
    # on the GGUF's blocks, with the work around the GEMMs in cpu_decoder.cpp's one-pass bf16 loops
    llm = LLM(smollm2_path, device="cpu", dtype="bfloat16", num_blocks=64, max_num_batched_tokens=48,
              quantization="gguf")
    decoder = llm.engine.runner.decoder
    if decoder.native is not None:
        from test_decoder import _Counted

        assert decoder.native.fused, "every linear is on blocks: the bf16 steps fuse the work around them"
        if torch.ops.kvscope.gguf_x16():  # the Q4_1 layers repacked for the x16 kernel; the Q8_0 lm_head as it is
            assert set(decoder.native.linear_types) == {gguf_linear.X16 + 3}
        decoder.native = _Counted(decoder.native)
    outs = llm.generate(chat_prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    at_top = check_within_near_ties(ref, chat_prompts, outs, max_tokens)
    assert at_top >= 0.9 * max_tokens * len(chat_prompts), f"gguf blocks: only {at_top} tokens at transformers' top"
    if decoder.native is not None:
        assert decoder.native.steps > 0, "decode-only steps ran the fused C++ layers"


def test_greedy_under_vllm_scheduler_with_preemption_and_prefix_caching(smollm2, smollm2_path, chat_prompts):
    """vLLM's own scheduler decides (docs/VLLM_SCHEDULER.md): same tokens as transformers."""
    pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is installed by `make vllm`")
    _, ref = smollm2
    # 10 blocks of 8 (one is vLLM's null block) hold one or two of these requests: vLLM preempts
    llm = real_llm(smollm2_path, scheduler="vllm", block_size=8, num_blocks=10, max_num_batched_tokens=32,
                   max_num_seqs=8, prefix_caching=True)
    outs = llm.generate(chat_prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    check_equal(outs, ref.greedy_all(chat_prompts, MAX_TOKENS), chat_prompts)
    assert llm.engine.num_preemptions > 0, "the tight cache was meant to force preemption"
    assert llm.engine.scheduler.events.hit_tokens > 0, "the template's shared system prompt was meant to hit"


@pytest.mark.parametrize("settings", [dict(mode="chunked", num_blocks=64, max_num_batched_tokens=48),
                                      dict(mode="chunked", block_size=8, num_blocks=9, max_num_batched_tokens=32),
                                      dict(mode="naive", num_blocks=64, quantization="auto")],
                         ids=["chunked", "preempted", "auto"])
def test_greedy_on_the_gguf_blocks_matches_transformers(smollm2, smollm2_path, chat_prompts, settings):
    """--quantization gguf: the linear layers multiply the file's Q4_1 blocks (and its Q8_0 lm_head) in place; the
    weights are transformers' dequantized ones, so in float32 only the summation order differs. auto (the default)
    takes the blocks in float32 where the CPU has their AVX2 or AVX-512 loops: the same tokens."""
    _, ref = smollm2
    llm = real_llm(smollm2_path, **{"quantization": "gguf", **settings})
    if settings.get("quantization") == "auto":
        if gguf_linear.paths(torch.float32)[:1] in ([], ["generic"]):
            pytest.skip("auto dequantizes on this CPU (generic loops)")
        assert llm.engine.backend.quantization == "gguf"
        assert "; auto: float32 on this CPU's" in llm.engine.loaded.linear_note
    runner = llm.engine.runner
    assert runner.forward_name.startswith("kvscope decoder, linear layers on GGUF blocks")
    assert "Q4_1 blocks, lm_head on its Q8_0" in llm.engine.loaded.linear_note
    if runner.decoder.native is not None:
        from test_decoder import _Counted

        runner.decoder.native = _Counted(runner.decoder.native)
    outs = llm.generate(chat_prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    check_equal(outs, ref.greedy_all(chat_prompts, MAX_TOKENS), chat_prompts)
    if settings["num_blocks"] == 9:
        assert llm.engine.num_preemptions > 0, "the tight cache was meant to force preemption"
    if runner.decoder.native is not None:
        assert runner.decoder.native.steps > 0, "decode-only steps run the C++ layers on the blocks"


def test_gguf_blocks_in_bf16_stay_beside_the_dequantized_model(smollm2_path, chat_prompts):
    """In bf16 the blocks widen to the bf16 weights the dequantized model holds (or, repacked as x16 lines, multiply
    the unrounded ones), so the blocks' logits are as near the float32 model's as the dense bf16 model's are: both
    differ from it by bf16 rounding in another order. The bound is the dense model's own distance on this CPU
    (oneDNN's order differs between CPUs), not a constant."""
    prompt = chat_prompts[0]
    logits, tokens = {}, {}
    for dtype, quantization in (("float32", None), ("bfloat16", None), ("bfloat16", "gguf")):
        llm = LLM(smollm2_path, device="cpu", dtype=dtype, num_blocks=64, quantization=quantization)
        runner = llm.engine.runner
        seen = []
        original = runner._forward

        def keep(out, original=original, seen=seen):
            got = original(out)
            seen.append(got.float())
            return got

        runner._forward = keep
        out = llm.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))
        logits[quantization or dtype], tokens[quantization or dtype] = seen, out[0].token_ids
    exact = logits["float32"]
    assert len(exact) == len(logits["bfloat16"]) == len(logits["gguf"]) >= 2

    def same_context(name):  # step i's logits see the same tokens as float32's while the tokens before agree
        n = next((i for i, (a, b) in enumerate(zip(tokens["float32"], tokens[name])) if a != b), len(exact) - 1)
        return range(n + 1)

    dense_err = max((exact[i] - logits["bfloat16"][i]).abs().max().item() for i in same_context("bfloat16"))
    assert dense_err > 0, "bf16 and float32 gave the same logits: the dtype did not reach the model"
    for i in same_context("gguf"):
        err = (exact[i] - logits["gguf"][i]).abs().max().item()
        assert err <= 2 * dense_err, f"step {i}: the blocks are {err:.3f} from float32, the dense bf16 {dense_err:.3f}"
        for row, (want, got) in enumerate(zip(exact[i].argmax(-1).tolist(), logits["gguf"][i].argmax(-1).tolist())):
            # the same token, or a near-tie: float32's margin no wider than the logits' difference
            assert want == got or exact[i][row, want] - exact[i][row, got] <= 2 * err
