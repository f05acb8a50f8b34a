"""Paged attention on the CPU whose decodes read the KV pages in place (csrc/cpu_attention.cpp).

The C++ op is compiled on this machine the first time it is needed (or ahead, by `python -m
kvscope.kernels.cpu.library`, which `make demo`, `make test` and `kvscope fetch` run) into a
cache folder named by a hash of the source, torch's version, the compiler flags and this CPU's
feature flags: under $KVSCOPE_CACHE_DIR/extensions, else ~/.cache/kvscope/extensions (or
$XDG_CACHE_HOME's). A cached build is loaded with torch.ops.load_library alone, without
importing torch.utils.cpp_extension or running ninja. When the build fails (no compiler, no
ninja), one line on stderr says so and load() returns None: the caller uses the torch reference.

Signatures are reference.py's. Decode rows (query_len 1) go to the C++ op; prefill chunks stay
on the reference's SDPA, which is good at many queries against many keys.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass

import torch

from kvscope import cpu_isa
from kvscope.kernels import reference
from kvscope.kernels.metadata import AttentionMetadata

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# one library: the attention op, linear layers over GGUF blocks (cpu_gguf.cpp), bf16 linear layers of few rows on
# AMX tiles (cpu_amx.cpp) or AVX-512 BF16 (cpu_dpbf16.cpp), and the decode step's layers that call them
# (cpu_decoder.cpp)
SOURCES = tuple(os.path.join(_CSRC, name)
                for name in ("cpu_attention.cpp", "cpu_gguf.cpp", "cpu_amx.cpp", "cpu_dpbf16.cpp", "cpu_decoder.cpp"))
HEADERS = (os.path.join(_CSRC, "onednn_packed.h"),)  # included by the sources: part of the build's hash
LIBRARY_NAME = "kvscope_cpu_attention"
CHOICE_ENV = "KVSCOPE_CPU_ATTENTION"  # "reference" forces the torch reference
CACHE_ENV = "KVSCOPE_CACHE_DIR"
# Tried in order: this CPU's vector units at their full width (GCC otherwise keeps AVX-512 code to
# 256 bits); the same where the compiler rejects the width flag (not x86); generic code last.
# Under an ISA cap (kvscope.cpu_isa: ONEDNN_MAX_CPU_ISA or KVSCOPE_MAX_CPU_ISA) the native flag sets leave out
# the instruction sets above it, so the build is a smaller CPU's; the flags are part of the build's key.
BASE_FLAG_SETS = (
    ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"],
    ["-O3", "-march=native", "-fopenmp"],
    ["-O3", "-fopenmp"],
)


def flag_sets() -> tuple[list[str], ...]:
    """The compiler flag sets to try, best first, with the ISA cap in force applied to the native ones."""
    off = cpu_isa.gcc_flags()
    return tuple(flags + off if "-march=native" in flags else flags for flags in BASE_FLAG_SETS)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


_loaded: str | None = None  # the library's path, once loaded in this process
_failed: str | None = None  # why the build failed, once it has (not tried again in this process)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """reference.write_kv's result; bf16 rows into a bf16 cache as one memcpy a row (kvscope::write_kv)."""
    bf16 = torch.bfloat16
    if (key.dtype == bf16 and value.dtype == bf16 and k_cache.dtype == bf16 and v_cache.dtype == bf16
            and key.dim() == 3 and key.stride(2) == 1 and key.stride(1) == key.shape[2]
            and value.stride(2) == 1 and value.stride(1) == value.shape[2]
            and slot_mapping.dtype == torch.long and _loaded is not None):
        torch.ops.kvscope.write_kv(key, value, k_cache, v_cache, slot_mapping.contiguous())
    else:
        reference.write_kv(key, value, k_cache, v_cache, slot_mapping)


def forced_reference() -> bool:
    return os.environ.get(CHOICE_ENV, "").strip().lower() == "reference"


def cache_root() -> str:
    if os.environ.get(CACHE_ENV):
        return os.path.join(os.path.abspath(os.path.expanduser(os.environ[CACHE_ENV])), "extensions")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvscope", "extensions")


def _cpu_flags() -> str:
    """This CPU's feature flags: -march=native builds for them, so another CPU needs another build."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    import platform

    return platform.machine() + " " + platform.processor()


def build_dir(flags: list[str]) -> str:
    h = hashlib.sha256()
    for source in SOURCES + HEADERS:
        with open(source, "rb") as f:
            h.update(f.read())
    for part in (torch.__version__, " ".join(flags), _cpu_flags(), sys.platform):
        h.update(b"\0" + part.encode())
    return os.path.join(cache_root(), f"cpu_attention-{h.hexdigest()[:16]}")


def _library_path(folder: str) -> str:
    return os.path.join(folder, LIBRARY_NAME + ".so")


def _done_marker(folder: str) -> str:
    return os.path.join(folder, "built-ok")  # written after a build loaded: a half-written .so is never used


def _note(message: str) -> None:
    print(f"kvscope: {message}", file=sys.stderr, flush=True)


def _compile(folder: str, flags: list[str]) -> str:
    from torch.utils import cpp_extension  # slow to import: only when compiling

    os.makedirs(folder, exist_ok=True)
    cpp_extension.load(name=LIBRARY_NAME, sources=list(SOURCES), extra_cflags=flags, extra_ldflags=["-fopenmp"],
                       build_directory=folder, is_python_module=False, verbose=False)
    return _library_path(folder)


def load(build: bool = True) -> str | None:
    """The op's library, loaded into this process: from the cache, else compiled now (when `build`).
    None where it cannot be had; a failed build is noted once on stderr and not retried."""
    global _loaded, _failed
    if _loaded is not None:
        return _loaded
    if _failed is not None:
        return None
    for flags in flag_sets():  # a cached build of either flag set
        folder = build_dir(flags)
        if os.path.exists(_done_marker(folder)) and os.path.exists(_library_path(folder)):
            torch.ops.load_library(_library_path(folder))
            _loaded = _library_path(folder)
            return _loaded
    if not build:
        return None
    capped = f", capped by {cpu_isa.describe()}" if cpu_isa.describe() else ""
    _note(f"compiling the CPU kernels once for this machine{capped} (about a minute; cached afterwards)")
    errors = []
    t0 = time.perf_counter()
    for flags in flag_sets():
        folder = build_dir(flags)
        try:
            path = _compile(folder, flags)
        except Exception as e:  # noqa: BLE001 - any build failure means: use the reference
            errors.append(_first_line(e))
            continue
        with open(_done_marker(folder), "w") as f:
            f.write(" ".join(flags) + "\n")
        _loaded = path
        _note(f"CPU kernels built in {time.perf_counter() - t0:.0f} s ({folder})")
        return _loaded
    _failed = errors[-1] if errors else "unknown error"
    _note(f"the CPU attention kernel did not build ({_failed}); using the torch reference attention")
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if "error" in ln.lower()] or text.splitlines() or [type(e).__name__]
    return lines[0][:200]


@dataclass
class DecodePlan:
    seq_ids: torch.Tensor  # [n] int64: the sequences with one query this step
    rows: torch.Tensor  # [n] int64: their query rows
    has_prefills: bool
    block_tables: torch.Tensor  # int32, contiguous
    seq_lens: torch.Tensor  # int32, contiguous


def decode_plan(meta: AttentionMetadata) -> DecodePlan:
    """Worked out once per step (cached on the metadata) and shared by every layer."""
    plan = meta.__dict__.get("_cpu_decode_plan")
    if plan is None:
        decodes = [s for s in range(meta.num_seqs) if meta.query_lens_host[s] == 1]
        qsl = meta.query_start_loc.tolist()
        plan = DecodePlan(torch.tensor(decodes, dtype=torch.long), torch.tensor([qsl[s] for s in decodes],
                                                                                 dtype=torch.long),
                           len(decodes) < meta.num_seqs, meta.block_tables.to(torch.int32).contiguous(),
                           meta.seq_lens.to(torch.int32).contiguous())
        meta.__dict__["_cpu_decode_plan"] = plan
    return plan


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """reference.paged_attention's semantics; decode rows computed by the C++ op over the pages in place."""
    if (query.dtype not in SUPPORTED_DTYPES or k_cache.dtype not in SUPPORTED_DTYPES or query.device.type != "cpu"
            or not k_cache.is_contiguous() or not v_cache.is_contiguous()):
        return reference.paged_attention(query, k_cache, v_cache, meta, scale, window)
    plan = decode_plan(meta)
    out = torch.empty(query.shape, dtype=query.dtype)  # contiguous: the caller's reshape is then a view
    if plan.seq_ids.numel():
        torch.ops.kvscope.paged_decode_attention(query, out, k_cache, v_cache, plan.block_tables, plan.seq_lens,
                                                 plan.seq_ids, plan.rows, scale, window or 0)
    if plan.has_prefills:
        reference.attend_prefills(query, k_cache, v_cache, meta, scale, window, out)
    return out


def main() -> int:
    """Build (or find) the kernel ahead of the first start; exit 0 either way (the engine falls back)."""
    if forced_reference():
        print(f"{CHOICE_ENV}=reference: nothing to build")
        return 0
    path = load()
    print(path if path else "the torch reference attention will be used")
    return 0


if __name__ == "__main__":
    sys.exit(main())
