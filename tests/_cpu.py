"""What this CPU runs, for the tests of CPU-specific paths: each marker names the feature it needs and skips
with the reason where it is missing (or capped away: ONEDNN_MAX_CPU_ISA / KVSCOPE_MAX_CPU_ISA, docs/CPU.md).

The fallback each CPU takes instead is tested too, on every CPU: `without_bf16_packing` makes oneDNN's bf16
packing unavailable, as it is on an AVX2-only CPU, so the F.linear path runs here as it runs there."""

from __future__ import annotations

import pytest
import torch

from kvscope import cpu_isa
from kvscope.engine.cpu import linear as cpu_linear
from kvscope.kernels.cpu import library as cpu_attention


def _capped(reason: str) -> str:
    cap = cpu_isa.describe()
    return f"{reason} (under {cap})" if cap else reason


BF16_PACKING_WHY_NOT = cpu_linear.packing_unavailable(torch.bfloat16)
needs_bf16_packing = pytest.mark.skipif(
    BF16_PACKING_WHY_NOT is not None,
    reason=_capped(f"needs oneDNN's bf16 packed linear: {BF16_PACKING_WHY_NOT}"))


def cpu_kernels_loaded() -> bool:
    return not cpu_attention.forced_reference() and cpu_attention.load() is not None


needs_cpu_kernels = pytest.mark.skipif(not cpu_kernels_loaded(), reason="the CPU kernels did not build here")


def without_bf16_packing(monkeypatch) -> str:
    """Make oneDNN's bf16 packing unavailable in this test, as on an AVX2-only CPU; returns the reason given."""
    why = "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"
    real = cpu_linear.packing_unavailable
    monkeypatch.setattr(cpu_linear, "packing_unavailable",
                        lambda dtype: f"oneDNN's packed linear failed here ({why})" if dtype == torch.bfloat16
                        else real(dtype))
    return why


# Where oneDNN cannot pack a dtype's weights (bf16 on an AVX2-only CPU), the C++ layer loop, which reads packed
# weights, stands aside and the layers run in Python over F.linear: still transformers' bits.
PYTHON_LAYERS_UNPACKED = "kvscope decoder, layers in Python (layer 0: linear layers not packed into oneDNN's layout)"


def expected_forward(dtype: str | torch.dtype) -> str:
    """The runner's forward_name for a llama-family model in `dtype` on this CPU (C++ kernels loaded)."""
    bf16 = dtype in ("bfloat16", torch.bfloat16)
    return PYTHON_LAYERS_UNPACKED if bf16 and BF16_PACKING_WHY_NOT else "kvscope decoder"
