"""Decode-sized bf16 linear layers on AMX tiles, over the weight oneDNN packed (kernels/cpu/csrc/cpu_amx.cpp,
engine/cpu_linear.use_amx). The kernel's tests run only on a CPU with AMX; the rest check that elsewhere
nothing changes."""

from __future__ import annotations

import pytest
import torch

from kvscope.engine import LLM, SamplingParams
from kvscope.engine.cpu import linear as cpu_linear
from kvscope.engine.cpu.linear import AMX_MAX_ROWS, PackedLinear, use_amx
from kvscope.engine.loader.models import build_builtin
from kvscope.kernels.cpu import library as cpu_attention

pytestmark = pytest.mark.skipif(cpu_linear.packing_unavailable(torch.bfloat16) is not None,
                                reason="this torch has no oneDNN packed linear")


def _amx_here() -> bool:
    return cpu_attention.load() is not None and cpu_linear.amx_unavailable() is None


needs_amx = pytest.mark.skipif(not _amx_here(), reason="no AMX tiles on this CPU (or its kernels did not build)")


def _packed(out_features: int, in_features: int, bias: bool, seed: int) -> PackedLinear:
    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(in_features, out_features, bias=bias, dtype=torch.bfloat16).requires_grad_(False)
    lin.weight.copy_(torch.randn(out_features, in_features, generator=gen))
    if bias:
        lin.bias.copy_(torch.randn(out_features, generator=gen))
    return PackedLinear(lin)


def _onednn(p: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, p.packed, p.bias, "none", [], "")


@needs_amx
@pytest.mark.parametrize("shape", [(96, 64), (1024, 1024), (256, 3072)])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_products_are_onednns_bits_up_to_32_rows(shape, bias):
    p = _packed(*shape, bias=bias, seed=shape[0] + shape[1])
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 2, 15, 16, 17, 24, 31, AMX_MAX_ROWS):
        x = torch.randn(rows, shape[1], generator=gen).to(torch.bfloat16)
        got = torch.ops.kvscope.amx_linear(x, p.packed, p.bias)
        assert got.shape == (rows, shape[0]) and got.dtype == torch.bfloat16
        assert torch.equal(got, _onednn(p, x)), f"{rows} rows: the tiles sum in oneDNN's order, so the same bits"
    x3 = torch.randn(1, 5, shape[1], generator=gen).to(torch.bfloat16)  # [1, T, K], as transformers calls it
    assert torch.equal(torch.ops.kvscope.amx_linear(x3, p.packed, p.bias), _onednn(p, x3))
    strided = torch.randn(shape[1], 9, generator=gen).to(torch.bfloat16).T  # rows not contiguous
    assert torch.equal(torch.ops.kvscope.amx_linear(strided, p.packed, p.bias), _onednn(p, strided.contiguous()))


@needs_amx
def test_longer_inputs_are_correct_and_stay_on_onednn_in_the_module():
    p = _packed(256, 1024, bias=False, seed=2)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(70, 1024, generator=gen).to(torch.bfloat16)
    exact = x.double() @ p.packed.to_dense().double().T
    got = torch.ops.kvscope.amx_linear(x, p.packed, None)  # chunks of 32, 32 and 6 rows: the tiles re-configured for the last
    assert (got.double() - exact).abs().max() <= exact.abs().max() * 2**-7, "within a bf16 rounding"
    p.amx = True
    assert torch.equal(p(x), _onednn(p, x)), "above AMX_MAX_ROWS the module calls oneDNN"
    small = x[:3]
    assert torch.equal(p(small), torch.ops.kvscope.amx_linear(small, p.packed, None))


@needs_amx
def test_a_layout_is_used_only_where_its_bytes_are_the_dense_weight():
    p = _packed(64, 96, bias=False, seed=3)
    dense = p.packed.to_dense()
    assert torch.ops.kvscope.amx_blocks_match(p.packed, dense)
    wrong = dense.clone()
    wrong[37, 90] += 1
    assert not torch.ops.kvscope.amx_blocks_match(p.packed, wrong)
    assert not torch.ops.kvscope.amx_blocks_match(p.packed, dense.t().contiguous().view(64, 96))


@needs_amx
def test_use_amx_marks_the_layers_it_can_run_and_is_idempotent():
    model = build_builtin("tiny", dtype=torch.bfloat16)
    cpu_linear.pack_linears(model)
    note = use_amx(model)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    on = [m for m in packed if m.amx]
    assert on and note == f"{len(on)} run decode steps (up to {AMX_MAX_ROWS} rows) on AMX tiles"
    assert all(m.out_features % 32 == 0 and m.in_features % 32 == 0 for m in on)
    assert all(m.amx == (m.out_features % 32 == 0) for m in packed), "tiny's lm_head (vocab 259-ish) stays on oneDNN"
    assert use_amx(model) == note


def test_with_amx_off_nothing_is_marked(monkeypatch):
    monkeypatch.setenv(cpu_linear.AMX_ENV, "0")
    model = build_builtin("tiny", dtype=torch.bfloat16)
    cpu_linear.pack_linears(model)
    assert use_amx(model) == "" and cpu_linear.amx_unavailable() == "KVSCOPE_AMX=0"
    assert not any(getattr(m, "amx", False) for m in model.modules())


@needs_amx
def test_the_engines_greedy_tokens_are_the_same_with_and_without_amx(monkeypatch):
    prompts = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate((5, 19, 40, 3, 64))]
    params = SamplingParams(max_tokens=20, ignore_eos=True)

    def run() -> tuple[list[list[int]], str]:
        llm = LLM("tiny", device="cpu", dtype="bfloat16", num_blocks=64, max_num_batched_tokens=32)
        return [o.token_ids for o in llm.generate(prompts, params)], llm.engine.describe_model()

    with_amx, described = run()
    assert "on AMX tiles" in described
    monkeypatch.setenv(cpu_linear.AMX_ENV, "0")
    without, described_off = run()
    assert "on AMX tiles" not in described_off
    assert with_amx == without
