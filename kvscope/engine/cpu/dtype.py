"""What `--dtype auto` means on a CPU: bfloat16 where the CPU multiplies bf16 in hardware, float32 elsewhere.

AMX (amx_bf16) and AVX-512 BF16 (avx512_bf16) run bf16 matmuls natively; oneDNN, under torch's CPU
GEMMs, then gives several times float32's FLOP/s (2.7 TFLOP/s against 0.38,
measured on a 2-core Sapphire Rapids). Without them bf16 is converted to float32 around every GEMM and is slower
than float32 itself, so auto keeps float32 there. vLLM's CPU backend makes the same choice.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvscope import cpu_isa

BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flag names, best first
CPUINFO = "/proc/cpuinfo"


@dataclass(frozen=True)
class DtypeChoice:
    name: str  # "bfloat16" or "float32"
    reason: str  # one line for start-up


def cpu_flags(path: str = CPUINFO) -> frozenset[str] | None:
    """The first processor's feature flags under the ISA cap in force (kvscope.cpu_isa), or None where the file
    is missing (not Linux x86)."""
    return cpu_isa.cpu_flags(path)


def _torch_bf16_flags() -> list[str]:
    """torch's own probe (cpuinfo library), where /proc/cpuinfo is not there to read."""
    import torch

    found = []
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        found.append("amx_bf16")
    if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        found.append("avx512_bf16")
    return sorted(cpu_isa.cap_flags(frozenset(found)))


def auto_cpu_dtype(flags: frozenset[str] | None = None) -> DtypeChoice:
    """bfloat16 with AMX or avx512_bf16, else float32; flags default to this machine's."""
    if flags is None:
        flags = cpu_flags()
    have = [f for f in BF16_FLAGS if f in flags] if flags is not None else _torch_bf16_flags()
    capped = f" under {cpu_isa.describe()}" if cpu_isa.describe() else ""
    if have:
        return DtypeChoice("bfloat16", f"auto: this CPU has {' and '.join(have)}{capped}, bf16 matmuls in hardware")
    return DtypeChoice("float32", f"auto: this CPU has neither amx_bf16 nor avx512_bf16{capped}, so bf16 matmuls "
                                  "would be emulated and slower than float32")
