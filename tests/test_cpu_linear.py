"""The CPU engine's linear layers, packed once for oneDNN, and its kept memory (engine/cpu/linear.py,
engine/cpu/malloc.py)."""

from __future__ import annotations

import copy
import platform
import sys

import pytest
import torch
import torch.nn.functional as F

from _cpu import needs_bf16_packing, without_bf16_packing
from kvscope.engine.cpu import linear as cpu_linear
from kvscope.engine.cpu import malloc as cpu_malloc
from kvscope.engine.cpu.linear import PackedLinear, pack_linears
from kvscope.engine.loader.models import build_builtin

pytestmark = pytest.mark.skipif(cpu_linear.packing_unavailable(torch.float32) is not None,
                                reason="this torch has no oneDNN packed linear")


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16_packing)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_layer_computes_what_f_linear_computes(dtype, bias):
    gen = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(160, 96, bias=bias, dtype=dtype).requires_grad_(False)
    packed = PackedLinear(lin)
    for rows in (1, 7, 300):
        x = torch.randn(1, rows, 160, generator=gen).to(dtype)
        want = F.linear(x, lin.weight, lin.bias)
        got = packed(x)
        assert got.shape == want.shape and got.dtype == dtype
        if dtype == torch.bfloat16:
            assert torch.equal(got, want), "oneDNN runs bf16 F.linear itself: the same bits"
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(packed.weight, lin.weight), "the weight reads back unpacked"


@needs_bf16_packing
def test_the_engine_packs_every_linear_layer_and_a_copy_is_plain_transformers():
    model = build_builtin("tiny", dtype=torch.bfloat16)
    ids = torch.tensor([[5, 17, 99, 3, 42]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    embed_bytes = model.get_input_embeddings().weight.numel() * 2
    done = pack_linears(model)
    assert done.layers == linears and not any(type(m) is torch.nn.Linear for m in model.modules())
    assert done.extra_bytes == embed_bytes, "tiny ties its lm_head to the embedding, which keeps its own copy"
    assert "packed for oneDNN" in done.note and "tied lm_head" in done.note
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, before)
    again = pack_linears(model)
    assert again.layers == linears and again.extra_bytes == 0, "a shared model is packed once"

    plain = copy.deepcopy(model)
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())
    assert sum(type(m) is torch.nn.Linear for m in plain.modules()) == linears
    with torch.inference_mode():
        assert torch.equal(plain(input_ids=ids).logits, before)


def test_where_onednn_cannot_pack_bf16_the_layers_stay_f_linear_and_say_why(monkeypatch):
    """An AVX2-only CPU: oneDNN refuses bf16 weights, so a bf16 model keeps transformers' own layers, with the same
    logits, and float32 is still packed."""
    why = without_bf16_packing(monkeypatch)
    model = build_builtin("tiny", dtype=torch.bfloat16)
    ids = torch.tensor([[5, 17, 99, 3, 42]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    done = pack_linears(model)
    assert done.layers == 0 and done.extra_bytes == 0
    assert done.note == f"linear layers: torch's F.linear (oneDNN's packed linear failed here ({why}))"
    assert not any(isinstance(m, (PackedLinear, cpu_linear.PackedSlice)) for m in model.modules())
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, before)
    assert pack_linears(build_builtin("tiny", dtype=torch.float32)).layers > 0


def test_a_probe_that_disagrees_leaves_f_linear_in_place(monkeypatch):
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: F.linear(x, self.weight) + 1)
    model = build_builtin("tiny")
    done = pack_linears(model)
    assert done.layers == 0 and "disagreed with F.linear" in done.note
    assert any(type(m) is torch.nn.Linear for m in model.modules())


def test_kept_memory_is_set_once_and_leaves_a_users_own_tunables_alone(monkeypatch):
    monkeypatch.setattr(cpu_malloc, "_done", None)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert cpu_malloc.keep_freed_memory() == "malloc: left to your MALLOC_TRIM_THRESHOLD_"
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert cpu_malloc.keep_freed_memory() == "malloc: left to your MALLOC_TRIM_THRESHOLD_", "decided once"
    monkeypatch.setattr(cpu_malloc, "_done", None)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    for var in cpu_malloc.USER_TUNABLES:
        monkeypatch.delenv(var, raising=False)
    note = cpu_malloc.keep_freed_memory()
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        assert note == "malloc: freed memory kept for reuse (mmap and trim thresholds 1 GiB)"
    else:
        assert note.startswith("malloc: left as it is")


@needs_bf16_packing
def test_a_packed_model_still_counts_its_weights():
    """A second engine on a cached, already packed model reports the same weight memory as the first."""
    from kvscope.engine.loader.gguf import weight_bytes

    model = build_builtin("tiny", dtype=torch.bfloat16)
    before = weight_bytes(model)
    done = pack_linears(model)
    assert weight_bytes(model) == before + done.extra_bytes
