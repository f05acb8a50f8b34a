"""Decode-sized bf16 linear layers with AVX-512 BF16, over the weight oneDNN packed (kernels/cpu/csrc/cpu_dpbf16.cpp,
engine/cpu_linear.use_dpbf16). The kernel's tests run only where it is built and oneDNN packs its layout (a CPU
with avx512_bf16 and no AMX); the rest check that elsewhere nothing changes."""

from __future__ import annotations

import pytest
import torch

from kvscope.engine import LLM, SamplingParams
from kvscope.engine.cpu import linear as cpu_linear
from kvscope.engine.cpu.linear import DPBF16_MAX_ROWS, PackedLinear, use_dpbf16
from kvscope.engine.loader.models import build_builtin
from kvscope.kernels.cpu import library as cpu_attention

pytestmark = pytest.mark.skipif(cpu_linear.packing_unavailable(torch.bfloat16) is not None,
                                reason="this torch has no oneDNN packed linear")


def _packed(out_features: int, in_features: int, bias: bool, seed: int) -> PackedLinear:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(torch.bfloat16)
    b = torch.randn(out_features, generator=gen).to(torch.bfloat16) if bias else None
    return PackedLinear.of_weight(w, b)


def _dpbf16_here() -> bool:
    if cpu_attention.load() is None or cpu_linear.dpbf16_unavailable() is not None:
        return False
    if cpu_linear.amx_unavailable() is None:
        return False  # with AMX oneDNN packs another layout (cpu_amx.cpp's)
    return cpu_linear._onednn_blocks(_packed(128, 256, bias=False, seed=0)) is not None


needs_dpbf16 = pytest.mark.skipif(not _dpbf16_here(),
                                  reason="no AVX-512 BF16 loop here (no avx512_bf16, AMX instead, or no kernels)")


def _onednn(p: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, p.packed, p.bias, "none", [], "")


@needs_dpbf16
@pytest.mark.parametrize("shape", [(4096, 1024), (1024, 2048), (1024, 3072), (1536, 576), (64, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_products_are_onednns_bits_up_to_the_row_limit(shape, bias):
    p = _packed(*shape, bias=bias, seed=shape[0] + shape[1])
    blocks = cpu_linear._onednn_blocks(p)
    assert blocks is not None, f"{shape}: no K blocks give oneDNN's bits"
    p.dpbf16_block = blocks
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 2, 5, 6, 7, 11, DPBF16_MAX_ROWS):
        for _ in range(2):
            x = torch.randn(rows, shape[1], generator=gen).to(torch.bfloat16)
            got = p(x)
            assert got.shape == (rows, shape[0]) and got.dtype == torch.bfloat16
            assert torch.equal(got, _onednn(p, x)), f"{rows} rows: K summed in oneDNN's blocks, so the same bits"
    x3 = torch.randn(1, 5, shape[1], generator=gen).to(torch.bfloat16)  # [1, T, K], as transformers calls it
    assert torch.equal(torch.ops.kvscope.dpbf16_linear(x3, p.packed, p.bias, blocks[1]), _onednn(p, x3))
    strided = torch.randn(shape[1], 9, generator=gen).to(torch.bfloat16).T  # rows not contiguous
    assert torch.equal(torch.ops.kvscope.dpbf16_linear(strided, p.packed, p.bias, blocks[1]),
                       _onednn(p, strided.contiguous()))


@needs_dpbf16
def test_the_k_block_decides_the_bits_and_the_probe_finds_onednns():
    p = _packed(4096, 3072, bias=False, seed=5)
    block = cpu_linear._onednn_blocks(p)[1]
    x = torch.randn(8, 3072, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    exact = x.double() @ p.packed.to_dense().double().T
    others = [b for b in cpu_linear.DPBF16_BLOCK_CANDIDATES if b != block and b <= 3072]
    for other in others:
        got = torch.ops.kvscope.dpbf16_linear(x, p.packed, None, other)
        assert (got.double() - exact).abs().max() <= exact.abs().max() * 2**-7, "any block is within a bf16 rounding"
    assert any(not torch.equal(torch.ops.kvscope.dpbf16_linear(x, p.packed, None, other), _onednn(p, x))
               for other in others), "another block sums in another order: some last bits differ"


@needs_dpbf16
def test_longer_inputs_stay_on_onednn_in_the_module():
    p = _packed(256, 1024, bias=False, seed=2)
    p.dpbf16_block = cpu_linear._onednn_blocks(p)
    x = torch.randn(40, 1024, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    assert torch.equal(p(x), _onednn(p, x))
    small = x[:3]
    assert torch.equal(p(small), torch.ops.kvscope.dpbf16_linear(small, p.packed, None, p.dpbf16_block[1]))


@needs_dpbf16
def test_a_layout_is_used_only_where_its_bytes_are_the_dense_weight():
    p = _packed(64, 96, bias=False, seed=3)
    dense = p.packed.to_dense()
    assert torch.ops.kvscope.dpbf16_blocks_match(p.packed, dense)
    wrong = dense.clone()
    wrong[37, 90] += 1
    assert not torch.ops.kvscope.dpbf16_blocks_match(p.packed, wrong)
    assert not torch.ops.kvscope.dpbf16_blocks_match(p.packed, dense.t().contiguous().view(64, 96))


@needs_dpbf16
def test_bad_arguments_are_refused_with_a_message():
    p = _packed(64, 96, bias=False, seed=4)
    with pytest.raises(RuntimeError, match="x must be bf16"):
        torch.ops.kvscope.dpbf16_linear(torch.randn(2, 96), p.packed, None, 512)
    with pytest.raises(RuntimeError, match="block_k must be a positive even number"):
        torch.ops.kvscope.dpbf16_linear(torch.randn(2, 96).to(torch.bfloat16), p.packed, None, 0)
    with pytest.raises(RuntimeError, match="bias must have 64 values"):
        torch.ops.kvscope.dpbf16_linear(torch.randn(2, 96).to(torch.bfloat16), p.packed, torch.zeros(3), 512)


@needs_dpbf16
def test_use_dpbf16_marks_the_layers_it_can_run_and_is_idempotent():
    model = build_builtin("tiny", dtype=torch.bfloat16)
    cpu_linear.pack_linears(model)
    note = use_dpbf16(model)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    on = [m for m in packed if m.dpbf16_block]
    assert on and note == f"{len(on)} run decode steps (up to {DPBF16_MAX_ROWS} rows) on AVX-512 BF16"
    assert all(m.out_features % 64 == 0 for m in on)
    assert use_dpbf16(model) == note


def test_with_dpbf16_off_nothing_is_marked(monkeypatch):
    monkeypatch.setenv(cpu_linear.DPBF16_ENV, "0")
    model = build_builtin("tiny", dtype=torch.bfloat16)
    cpu_linear.pack_linears(model)
    assert use_dpbf16(model) == "" and cpu_linear.dpbf16_unavailable() == "KVSCOPE_DPBF16=0"
    assert not any(getattr(m, "dpbf16_block", None) for m in model.modules())


@needs_dpbf16
def test_the_engines_greedy_tokens_are_the_same_with_and_without_dpbf16(monkeypatch):
    prompts = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate((5, 19, 40, 3, 64))]
    params = SamplingParams(max_tokens=20, ignore_eos=True)

    def run() -> tuple[list[list[int]], str]:
        llm = LLM("tiny", device="cpu", dtype="bfloat16", num_blocks=64, max_num_batched_tokens=32)
        return [o.token_ids for o in llm.generate(prompts, params)], llm.engine.describe_model()

    with_dpbf16, described = run()
    assert "on AVX-512 BF16" in described
    monkeypatch.setenv(cpu_linear.DPBF16_ENV, "0")
    without, described_off = run()
    assert "on AVX-512 BF16" not in described_off
    assert with_dpbf16 == without
