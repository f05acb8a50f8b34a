"""The written-out CPU forward (engine/cpu/decoder.py): every step's logits are the bits transformers' own
forward gives over the same paged cache, for each llama-family layout it accepts, and any other model
keeps transformers' forward with the reason said."""

from __future__ import annotations

import pytest
import torch

from _cpu import PYTHON_LAYERS_UNPACKED, expected_forward, needs_bf16_packing, without_bf16_packing
from conftest import save_checkpoint, token_prompts
from kvscope.engine import LLM, SamplingParams
from kvscope.engine.cpu.decoder import FORCE_ENV, PagedDecoder
from kvscope.engine.cpu.native_layers import CHOICE_ENV as LAYERS_ENV
from kvscope.kernels.cpu import library as cpu_attention

# each layout the decoder accepts: llama (no bias), qwen2 (q/k/v bias), qwen3 (q/k norms, one layer slides),
# mistral (every layer slides); 4 query heads over 2 KV heads
LAYOUTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3-hybrid-w20": ("Qwen3Config", "Qwen3ForCausalLM",
                         dict(use_sliding_window=True, sliding_window=20, max_window_layers=1)),
    "mistral-w24": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=24)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {name: save_checkpoint(tmp_path_factory.mktemp(name), cfg, cls, **extra)
            for name, (cfg, cls, extra) in LAYOUTS.items()}


class _Counted:
    """Counts the steps the C++ layer loop ran (it returns None for a step with a prefill row)."""

    def __init__(self, native) -> None:
        self.native, self.steps = native, 0

    def run(self, *args):
        out = self.native.run(*args)
        self.steps += out is not None
        return out


def _native_available() -> bool:
    return not cpu_attention.forced_reference() and cpu_attention.load() is not None


def _compare_every_step(llm: LLM) -> list[int]:
    """Wrap the runner's forward: run transformers' forward too and demand the same bits. Returns the
    number of rows compared per step."""
    runner = llm.engine.runner
    decoder = runner.decoder
    if decoder.native is not None:
        decoder.native = _Counted(decoder.native)
    original = runner._forward
    rows = []

    def both(out):
        runner.decoder = None
        try:
            want = original(out)
        finally:
            runner.decoder = decoder
        got = original(out)  # rewrites the same K/V slots with the same values
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want), f"step {len(rows)}: logits differ by {(got - want).abs().max().item()}"
        rows.append(got.shape[0])
        return got

    runner._forward = both
    return rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_logits_are_transformers_bits_at_every_step(checkpoints, name, dtype):
    # chunked prefill under a small budget, a prefix shared by two prompts, and 6 blocks that force
    # preemption: decode rows, prefill chunks and mixed steps all go through both forwards
    prompts = token_prompts([5, 23, 41, 57], 300, seed=3)
    prompts.append(prompts[3][:32] + token_prompts([9], 300, seed=4)[0])
    llm = LLM(checkpoints[name], device="cpu", dtype=dtype, mode="chunked", num_blocks=12,
              max_num_batched_tokens=24, prefix_caching=True)
    runner = llm.engine.runner
    assert runner.decoder is not None and runner.forward_name == expected_forward(dtype)
    rows = _compare_every_step(llm)
    llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(rows) > 10 and max(rows) > 1, "several steps, some with several sampled rows"
    if _native_available() and runner.forward_name == "kvscope decoder":  # decode-only steps ran their layers in
        assert runner.decoder.native.steps >= 5  # one C++ call, with the same bits


def test_bf16_layers_over_f_linear_are_transformers_bits_where_onednn_cannot_pack(checkpoints, monkeypatch):
    """The path an AVX2-only CPU takes in bf16, on any CPU: no packed weights, the layers in Python."""
    without_bf16_packing(monkeypatch)
    prompts = token_prompts([5, 23, 41], 300, seed=3)
    llm = LLM(checkpoints["qwen2-bias"], device="cpu", dtype="bfloat16", mode="chunked", num_blocks=12,
              max_num_batched_tokens=24, prefix_caching=True)
    assert llm.engine.runner.forward_name == PYTHON_LAYERS_UNPACKED
    rows = _compare_every_step(llm)
    llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(rows) > 5 and max(rows) > 1


@needs_bf16_packing
def test_decode_steps_run_their_layers_in_one_cpp_call(checkpoints, monkeypatch):
    if not _native_available():
        pytest.skip("the CPU kernels did not build on this machine")
    prompts = token_prompts([7, 30], 300, seed=8)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    llm = LLM(checkpoints["qwen3-hybrid-w20"], device="cpu", dtype="bfloat16", mode="chunked")
    decoder = llm.engine.runner.decoder
    assert decoder.native is not None and llm.engine.runner.forward_name == "kvscope decoder"
    decoder.native = _Counted(decoder.native)
    native = llm.generate(prompts, params)
    assert decoder.native.steps == 15, "every step after the prompts' prefill step is decode-only"
    monkeypatch.setenv(LAYERS_ENV, "python")
    llm = LLM(checkpoints["qwen3-hybrid-w20"], device="cpu", dtype="bfloat16", mode="chunked")
    assert llm.engine.runner.decoder.native is None
    assert llm.engine.runner.forward_name == f"kvscope decoder, layers in Python ({LAYERS_ENV}=python)"
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in native]


def test_reference_attention_keeps_the_python_layers(checkpoints, monkeypatch):
    monkeypatch.setenv(cpu_attention.CHOICE_ENV, "reference")
    llm = LLM(checkpoints["llama"], device="cpu", dtype="float32")
    assert llm.engine.runner.decoder.native is None
    assert llm.engine.runner.forward_name == "kvscope decoder, layers in Python (the CPU kernels are not loaded)"


@needs_bf16_packing
def test_the_fused_projections_are_used(checkpoints):
    llm = LLM(checkpoints["qwen2-bias"], device="cpu", dtype="bfloat16")
    decoder = llm.engine.runner.decoder
    assert all(not isinstance(layer.qkv, tuple) and not isinstance(layer.gate_up, tuple)
               for layer in decoder.layers), "q/k/v and gate/up run as one packed GEMM each"


def test_forcing_transformers_forward(checkpoints, monkeypatch):
    monkeypatch.setenv(FORCE_ENV, "transformers")
    llm = LLM(checkpoints["llama"], device="cpu", dtype="float32")
    runner = llm.engine.runner
    assert runner.decoder is None and runner.forward_name == f"transformers ({FORCE_ENV}=transformers)"
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_another_activation_keeps_transformers_forward(tmp_path):
    path = save_checkpoint(tmp_path, "LlamaConfig", "LlamaForCausalLM", hidden_act="gelu")
    llm = LLM(path, device="cpu", dtype="float32")
    assert llm.engine.runner.decoder is None
    assert llm.engine.runner.forward_name == "transformers (activation 'gelu')"


def test_a_model_without_llama_layers_is_refused_by_build():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    decoder, why = PagedDecoder.build(model)
    assert decoder is None and why == "GPT2LMHeadModel is not a llama-family model"


@pytest.mark.skipif(not _native_available(), reason="the CPU kernels did not build here")
@pytest.mark.parametrize("shape", [(1, 576), (24, 1024), (300, 1024), (5, 3, 128), (2, 3000)])
def test_the_native_bf16_norm_is_the_python_norms_bits(shape):
    from kvscope.engine.cpu.decoder import Norm

    gen = torch.Generator().manual_seed(sum(shape))
    for scale in (1e-3, 1.0, 40.0):
        x = (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)
        norm = Norm(torch.randn(shape[-1], generator=gen).to(torch.bfloat16), 1e-6)
        assert torch.equal(norm(x, native=True), norm(x)), f"{shape} x {scale}"
    qkv = torch.randn(7, 3 * 128 + 2 * 64, generator=gen).to(torch.bfloat16)
    q = qkv[:, : 3 * 128].view(7, 3, 128)  # a view into the fused projection, as Qwen3's q norm gets it
    norm = Norm(torch.randn(128, generator=gen).to(torch.bfloat16), 1e-6)
    assert torch.equal(norm(q, native=True), norm(q))
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    x[1, 3], x[2, 5] = float("nan"), float("inf")
    norm = Norm(torch.randn(64, generator=gen).to(torch.bfloat16), 1e-5)
    got, want = norm(x, native=True), norm(x)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


@pytest.mark.skipif(not _native_available(), reason="the CPU kernels did not build here")
def test_the_in_place_rotary_and_cache_writes_are_the_reference_bits():
    from kvscope.engine.cpu.decoder import _rope, _rope_in_place
    from kvscope.kernels import reference

    gen = torch.Generator().manual_seed(5)
    t, heads, kv_heads, d = 37, 4, 2, 64
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen) * 8).to(torch.bfloat16)
    cos = torch.randn(t, 1, d, generator=gen).to(torch.bfloat16)
    sin = torch.randn(t, 1, d, generator=gen).to(torch.bfloat16)
    signed_sin = torch.cat((-sin[..., : d // 2], sin[..., d // 2:]), dim=-1)
    qk = qkv[:, : (heads + kv_heads) * d].view(t, -1, d)
    want = _rope(qk, cos, signed_sin)
    got = _rope_in_place(qk, cos, signed_sin)
    assert got.data_ptr() == qk.data_ptr() and torch.equal(got, want)

    k, v = qk[:, heads:], qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d)
    slots = torch.randperm(16 * 8, generator=gen)[:t]
    caches = [torch.zeros(8, 16, kv_heads, d, dtype=torch.bfloat16) for _ in range(4)]
    reference.write_kv(k, v, caches[0], caches[1], slots)
    cpu_attention.write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="slot 128 is not in the cache"):
        torch.ops.kvscope.write_kv(k[:1], v[:1], caches[2], caches[3], torch.tensor([128]))
    with pytest.raises(RuntimeError, match="slot -1 is not in the cache"):
        torch.ops.kvscope.write_kv(k[:1], v[:1], caches[2], caches[3], torch.tensor([-1]))
