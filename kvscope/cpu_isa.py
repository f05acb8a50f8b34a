"""One switch that makes this CPU behave as a smaller one: oneDNN's ISA cap, honoured by kvscope too.

kvscope runs on three kinds of x86 CPU, and each takes other paths: AMX tiles, AVX-512 BF16, or AVX2 with
float32. To reproduce a smaller CPU on a bigger one, set

    ONEDNN_MAX_CPU_ISA=AVX2          # or AVX512_CORE, AVX512_CORE_BF16, AVX512_CORE_AMX; oneDNN's own names

oneDNN (under torch's GEMMs and packed weights) reads it itself. kvscope reads it too, or its own
``KVSCOPE_MAX_CPU_ISA`` where that is set, which takes precedence and is passed on to oneDNN when
``ONEDNN_MAX_CPU_ISA`` is unset. A cap below AVX-512 also sets ``ATEN_CPU_CAPABILITY=avx2`` (where unset),
so that ATen's own kernels, whose reductions add in vector-width order, give the smaller CPU's bits. Under a cap:

  - the feature flags kvscope reads (``--dtype auto``) lose what the cap excludes;
  - the C++ kernels are compiled without the excluded instruction sets (the cap is part of the build's key);
  - the AMX and AVX-512 BF16 decode loops report why they are off.

This module imports nothing heavy: `kvscope/__init__.py` applies the switch before torch runs any kernel.
"""

from __future__ import annotations

import os
import sys

ENV = "KVSCOPE_MAX_CPU_ISA"
ONEDNN_ENV = "ONEDNN_MAX_CPU_ISA"
ATEN_ENV = "ATEN_CPU_CAPABILITY"
CPUINFO = "/proc/cpuinfo"

# oneDNN's ISA names, smallest first, each with the /proc/cpuinfo flags that it is the first to allow.
# A cap keeps every flag of its own level and below and drops those of the levels above.
LEVELS: tuple[tuple[str, frozenset[str]], ...] = (
    ("SSE41", frozenset()),
    ("AVX", frozenset({"avx"})),
    ("AVX2", frozenset({"avx2", "fma", "f16c"})),
    ("AVX2_VNNI", frozenset({"avx_vnni"})),
    ("AVX2_VNNI_2", frozenset({"avx_ne_convert", "avx_vnni_int8"})),
    ("AVX512_CORE", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"})),
    ("AVX512_CORE_VNNI", frozenset({"avx512_vnni"})),
    ("AVX512_CORE_BF16", frozenset({"avx512_bf16"})),
    ("AVX10_1_512", frozenset()),
    ("AVX512_CORE_FP16", frozenset({"avx512_fp16"})),
    ("AVX10_1_512_AMX", frozenset()),
    ("AVX512_CORE_AMX", frozenset({"amx_tile", "amx_bf16", "amx_int8"})),
    ("AVX10_1_512_AMX_FP16", frozenset({"amx_fp16"})),
    ("AVX512_CORE_AMX_FP16", frozenset()),
)
NAMES = tuple(name for name, _ in LEVELS)
# GCC's switches for what each level adds, for compiling kvscope's kernels under a cap (-mno-avx512f drops every
# AVX-512 subset with it; AMX and AVX-VNNI are separate). AVX2_VNNI_2's (avxneconvert, avxvnniint8) are left out:
# GCC 12 knows neither, and no kvscope kernel uses them.
_GCC_OFF = {
    "AVX": ["-mno-avx"],
    "AVX2": ["-mno-avx2", "-mno-fma", "-mno-f16c"],
    "AVX2_VNNI": ["-mno-avxvnni"],
    "AVX512_CORE": ["-mno-avx512f"],
    "AVX512_CORE_VNNI": ["-mno-avx512vnni"],
    "AVX512_CORE_BF16": ["-mno-avx512bf16"],
    "AVX512_CORE_FP16": ["-mno-avx512fp16"],
    "AVX512_CORE_AMX": ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"],
}


class IsaCapError(ValueError):
    pass


def cap_name(environ: os._Environ | dict | None = None) -> str | None:
    """The cap in force: KVSCOPE_MAX_CPU_ISA, else ONEDNN_MAX_CPU_ISA; None where neither is set (or DEFAULT).
    A name oneDNN does not know raises IsaCapError with the names it does."""
    env = os.environ if environ is None else environ
    for var in (ENV, ONEDNN_ENV):
        raw = env.get(var, "").strip()
        if not raw:
            continue
        name = raw.upper()
        if name == "DEFAULT":
            return None
        if name not in NAMES:
            raise IsaCapError(f"{var}={raw[:40]!r} is not one of oneDNN's ISA names: {', '.join(NAMES)} or DEFAULT")
        return name
    return None


def _cap_or_none() -> str | None:
    try:
        return cap_name()
    except IsaCapError:
        return None  # said where it matters (describe()); never a crash on import


def excluded_flags(cap: str | None) -> frozenset[str]:
    """The /proc/cpuinfo flags above the cap."""
    if cap is None:
        return frozenset()
    above = NAMES.index(cap) + 1
    return frozenset().union(*(flags for _, flags in LEVELS[above:]))


def cap_flags(flags: frozenset[str], cap: str | None = None) -> frozenset[str]:
    """flags as a CPU capped at `cap` (default: the cap in force) would show them."""
    cap = _cap_or_none() if cap is None else cap
    return flags - excluded_flags(cap)


def read_cpu_flags(path: str = CPUINFO) -> frozenset[str] | None:
    """The first processor's feature flags as the hardware has them, or None where the file is missing."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        return None
    return frozenset()


def cpu_flags(path: str = CPUINFO) -> frozenset[str] | None:
    """This CPU's feature flags under the cap in force (None where they cannot be read)."""
    flags = read_cpu_flags(path)
    return None if flags is None else cap_flags(flags)


def gcc_flags(cap: str | None = None) -> list[str]:
    """GCC switches that keep -march=native code within the cap ([] with no cap)."""
    cap = _cap_or_none() if cap is None else cap
    if cap is None:
        return []
    above = NAMES[NAMES.index(cap) + 1:]
    return [flag for name in above for flag in _GCC_OFF.get(name, [])]


def below(level: str, cap: str | None = None) -> bool:
    """Does the cap in force (or `cap`) exclude `level`?"""
    cap = _cap_or_none() if cap is None else cap
    return cap is not None and NAMES.index(cap) < NAMES.index(level)


def describe() -> str:
    """'' with no cap; else a note for start-up lines and skip reasons."""
    try:
        cap = cap_name()
    except IsaCapError as e:
        return f"ignored: {e}"
    if cap is None:
        return ""
    var = ENV if os.environ.get(ENV, "").strip() else ONEDNN_ENV
    return f"{var}={cap}"


def apply(environ: os._Environ | dict | None = None) -> None:
    """Pass the cap on to oneDNN (KVSCOPE_MAX_CPU_ISA) and, below AVX-512, to ATen's kernels, where their own
    variables are unset. Both read them the first time they run a kernel, so this runs on kvscope's import.
    A name oneDNN does not know is said in one line on stderr and caps nothing."""
    env = os.environ if environ is None else environ
    try:
        cap = cap_name(env)
    except IsaCapError as e:
        if environ is None:
            print(f"kvscope: {e}; no cap applied", file=sys.stderr, flush=True)
        return
    if cap is None:
        return
    env.setdefault(ONEDNN_ENV, cap)
    if NAMES.index(cap) < NAMES.index("AVX512_CORE"):
        env.setdefault(ATEN_ENV, "avx2" if NAMES.index(cap) >= NAMES.index("AVX2") else "default")
