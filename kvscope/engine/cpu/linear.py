"""Linear layers on a CPU with their weights packed once, in oneDNN's blocked layout.

`F.linear` on a CPU reorders (bf16, through oneDNN) or re-blocks (float32, through MKL's sgemm)
the weight inside every call. At a decode step's few rows that reorder is a large share of the
GEMM, and MKL's float32 path is slow on AMD CPUs. Packing each weight once at start-up, as vLLM's
CPU backend and torch's own inductor freezing do, and calling oneDNN on the packed weight, measured
on a 2-core AMD EPYC (AVX-512 BF16) at Qwen3-0.6B's linear shapes, 2 threads:

  - bf16: 1.3-1.6x at 1-64 rows (all 28 layers, weights read from memory), equal at 512;
    the results are bit-identical to F.linear's;
  - float32: 2-3.6x at 1-512 rows (MKL's float32 path there reaches about 190 GFLOP/s, oneDNN
    about 390), with results equal to F.linear's within rounding (another summation order).

The packed weight replaces the module's own, so it costs no memory, except a tied lm_head,
whose embedding keeps the unpacked copy. A packed layer deep-copies as a plain nn.Linear,
so a copy of the model (the bench's transformers peers, a test's reference) runs transformers
unchanged. Where this torch has no oneDNN, or a probe's result disagrees with F.linear, nothing
is packed and start-up says why.

Linear layers that read the same input are packed as one weight (q/k/v of an attention, gate/up of
an MLP): a decode step then makes 4 GEMM calls per layer instead of 7, and each is wider. At
SmolLM2's shapes (width 576, 30 layers) oneDNN's call overhead and its per-call parallel split are
most of a one-row GEMM: fusing them took the weights' pass from 14.6 to 12.8 ms on 2 threads (Xeon,
AVX-512 bf16). Each fused output column is the same dot product as before; oneDNN may pick another
kernel for the wider shape, so results may differ in the last bit (seen at 300 rows in bf16 only).
The original modules become views (PackedSlice) of the fused weight, so transformers' own forward
still runs on the model.

On a CPU with AMX, once the CPU kernels are loaded (use_amx), inputs of up to AMX_MAX_ROWS rows (a decode
step's) run kvscope::amx_linear (kernels/cpu/csrc/cpu_amx.cpp) on the very bytes oneDNN packed: its products
are oneDNN's bit for bit at those rows, and on a 2-core Xeon it read Qwen3-0.6B's 28 layers of weights
1.2-1.7x faster than oneDNN's own call (benchmarks/amx_linear.py). Larger inputs stay on oneDNN.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvscope import cpu_isa

NOTE_ATTR = "kvscope_pack_note"  # on a packed model: what packing it did, for the start-up line
PACK_ROWS_HINT = 64  # the batch size oneDNN is told to expect: measured indifferent between 1 and 512
# Up to this many rows the AMX loop runs (and its products equal oneDNN's bit for bit); above, oneDNN's
# kernels win or tie, and their products differ from the AMX loop's in a few last bits. cpu_decoder.cpp's
# kAmxMaxRows is the same.
AMX_MAX_ROWS = 32
AMX_ENV = "KVSCOPE_AMX"  # "0": every packed linear on oneDNN's call (for comparing)
# Where there is no AMX but AVX-512 BF16, up to this many rows run kvscope::dpbf16_linear (cpu_dpbf16.cpp):
# on a 2-core Zen 5 it streamed Qwen3-0.6B's layers 1.3-1.4x as fast as oneDNN at 1 row, 1.15x at 8 and 1.03x at
# 12; from 16 rows both are bound by vdpbf16ps itself and oneDNN is a little ahead (benchmarks/amx_linear.py --kernel
# dpbf16). cpu_decoder.cpp's kDpbf16MaxRows is the same.
DPBF16_MAX_ROWS = 12
DPBF16_ENV = "KVSCOPE_DPBF16"  # "0": no AVX-512 BF16 loop, oneDNN's call instead (for comparing)
# oneDNN adds K in blocks, each summed from zero and then added to the output; the loop must use the same
# blocks to give its bits. oneDNN's block depends on the shape and on whether x is one row or more (on a Zen 5:
# 512 for one row; 512 for more where K <= 1024, else 1024), so use_dpbf16 finds both per weight shape by
# trying these on probes.
DPBF16_BLOCK_CANDIDATES = (512, 1024, 256, 2048, 4096)


def _ops():
    return torch.ops.mkldnn


class PackedLinear(torch.nn.Module):
    """y = x W^T + b with W held in oneDNN's layout for this CPU."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        self._pack(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())

    @classmethod
    def of_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> "PackedLinear":
        """Packed straight from a weight [out, in] (and bias), with no Linear (and its random init) in between."""
        self = cls.__new__(cls)
        self._pack(weight, bias)
        return self

    def _pack(self, w: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.dtype = w.dtype
        self.packed = _ops()._reorder_linear_weight(w, PACK_ROWS_HINT)  # plain attribute: not in state_dict
        self.bias = bias
        self.amx = False  # use_amx: inputs of up to AMX_MAX_ROWS rows run kvscope::amx_linear on self.packed
        # use_dpbf16: if set, inputs of up to DPBF16_MAX_ROWS rows run kvscope::dpbf16_linear, with K added in
        # blocks of dpbf16_block[0] for one row and of dpbf16_block[1] for more (oneDNN's own)
        self.dpbf16_block: tuple[int, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.amx and x.numel() <= AMX_MAX_ROWS * self.in_features:
            return torch.ops.kvscope.amx_linear(x, self.packed, self.bias)
        if self.dpbf16_block and x.numel() <= DPBF16_MAX_ROWS * self.in_features:
            block = self.dpbf16_block[0 if x.numel() == self.in_features else 1]
            return torch.ops.kvscope.dpbf16_linear(x, self.packed, self.bias, block)
        return _ops()._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @property
    def weight(self) -> torch.Tensor:
        """The unpacked weight, for code that reads it (rare; it is rebuilt on every access)."""
        return self.packed.to_dense()

    def unpacked(self) -> torch.nn.Linear:
        lin = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, dtype=self.dtype)
        with torch.no_grad():
            lin.weight.copy_(self.packed.to_dense())
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin.requires_grad_(False)

    def __deepcopy__(self, memo) -> torch.nn.Linear:
        return self.unpacked()  # oneDNN's opaque tensors cannot be copied; a copy is plain transformers

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN packed"


class PackedSlice(torch.nn.Module):
    """One of several linear layers packed together (FusedLinear): its rows of the fused output."""

    def __init__(self, fused: "PackedLinear", start: int, end: int) -> None:
        super().__init__()
        self.fused = fused
        self.start, self.end = start, end
        self.in_features, self.out_features = fused.in_features, end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # transformers' own forward: correct, not fast
        return self.fused(x)[..., self.start : self.end]

    @property
    def weight(self) -> torch.Tensor:
        return self.fused.packed.to_dense()[self.start : self.end]

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.fused.bias is None else self.fused.bias[self.start : self.end]

    def __deepcopy__(self, memo) -> torch.nn.Linear:
        lin = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                              dtype=self.fused.dtype)
        with torch.no_grad():
            lin.weight.copy_(self.weight)
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin.requires_grad_(False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows {self.start}:{self.end} " \
               "of a fused oneDNN-packed weight"


# Linear layers packed as one, by the names transformers' llama-family modules give them.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _fuse(parent: torch.nn.Module, names: tuple[str, ...]) -> bool:
    """Pack parent's linear layers `names` as one weight; each becomes a PackedSlice of it."""
    layers = [getattr(parent, n, None) for n in names]
    if not all(type(m) is torch.nn.Linear for m in layers):
        return False
    first = layers[0]
    if any(m.in_features != first.in_features or (m.bias is None) != (first.bias is None)
           or m.weight.dtype != first.weight.dtype for m in layers):
        return False
    with torch.no_grad():
        weight = torch.cat([m.weight for m in layers])
        bias = None if first.bias is None else torch.cat([m.bias for m in layers])
    packed = PackedLinear.of_weight(weight, bias)
    start = 0
    for name, m in zip(names, layers):
        setattr(parent, name, PackedSlice(packed, start, start + m.out_features))
        start += m.out_features
    return True


def fused_of(*slices: torch.nn.Module) -> PackedLinear | None:
    """The fused weight these modules are consecutive slices of, in order; None if they are not."""
    if not all(isinstance(s, PackedSlice) for s in slices):
        return None
    fused = slices[0].fused
    start = 0
    for s in slices:
        if s.fused is not fused or s.start != start:
            return None
        start = s.end
    return fused if start == fused.out_features else None


@dataclass(frozen=True)
class PackResult:
    layers: int  # linear layers now packed (0: none)
    extra_bytes: int  # memory added (a tied lm_head's own packed copy)
    note: str  # one line for start-up


def packing_unavailable(dtype: torch.dtype) -> str | None:
    """None if oneDNN's packed linear runs here and agrees with F.linear; else why not."""
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    try:
        gen = torch.Generator().manual_seed(0)
        lin = torch.nn.Linear(96, 80, dtype=dtype).requires_grad_(False)
        x = torch.randn(3, 5, 96, generator=gen).to(dtype)
        got, want = PackedLinear(lin)(x).float(), F.linear(x, lin.weight, lin.bias).float()
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        return f"oneDNN's packed linear failed here ({str(e).splitlines()[0][:160]})"
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    if not torch.allclose(got, want, rtol=tol, atol=tol):
        return "oneDNN's packed linear disagreed with F.linear here"
    return None


def pack_linears(model: torch.nn.Module) -> PackResult:
    """Replace every nn.Linear of a CPU model by a PackedLinear, in place. Idempotent: a model shared by
    several engines (the GGUF loader's cache) is packed once."""
    params = list(model.parameters())
    if not params or params[0].device.type != "cpu":
        return PackResult(0, 0, "")
    dtype = params[0].dtype
    slices = [m for m in model.modules() if isinstance(m, PackedSlice)]
    fused_ids = {id(s.fused) for s in slices}
    already = len(slices) + sum(isinstance(m, PackedLinear) and id(m) not in fused_ids for m in model.modules())
    if already:  # the memory was counted where it was packed; the note is that packing's
        return PackResult(already, 0, getattr(model, NOTE_ATTR, f"linear layers: {already} packed for oneDNN"))
    why_not = packing_unavailable(dtype)
    if why_not is not None:
        return PackResult(0, 0, f"linear layers: torch's F.linear ({why_not})")
    others = {p.data_ptr() for m in model.modules() if not isinstance(m, torch.nn.Linear)
              for p in m.parameters(recurse=False)}  # the embedding's, which a tied lm_head shares
    count = extra = fused = 0
    groups = () if os.environ.get("KVSCOPE_FORWARD") == "transformers" else FUSED_GROUPS  # (decoder.py)
    for parent in list(model.modules()):
        for group in groups:
            if _fuse(parent, group):
                count += len(group)
                fused += 1
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                if child.weight.data_ptr() in others:  # tied: the embedding keeps its unpacked copy
                    extra += child.weight.numel() * child.weight.element_size()
                setattr(parent, name, PackedLinear(child))
                count += 1
    note = f"linear layers: {count} packed for oneDNN"
    if fused:
        note += f" ({fused} fused groups: q/k/v, gate/up)"
    if extra:
        note += f" (+{extra / 2**20:,.1f} MiB: the tied lm_head's own packed copy)"
    setattr(model, NOTE_ATTR, note)
    return PackResult(count, extra, note)


def amx_unavailable() -> str | None:
    """None if kvscope::amx_linear can run here (the CPU kernels loaded, AMX tiles granted); else why not."""
    if os.environ.get(AMX_ENV, "").strip() == "0":
        return f"{AMX_ENV}=0"
    if cpu_isa.below("AVX512_CORE_AMX"):
        return f"capped by {cpu_isa.describe()}"
    if not hasattr(torch.ops.kvscope, "amx_bf16"):
        return "the CPU kernels are not loaded"
    if not torch.ops.kvscope.amx_bf16():
        return "no AMX tiles here"
    return None


def use_amx(model: torch.nn.Module) -> str:
    """Let the model's bf16 packed linear layers run inputs of up to AMX_MAX_ROWS rows on AMX tiles, in place;
    returns a note for start-up ("" where nothing changed). Where the CPU kernels are loaded: call it after
    cpu_attention.load(). Idempotent.

    The kernel reads oneDNN's packed bytes as AB16b32a2b blocks. oneDNN picks a weight's layout from its
    shape, dtype and this CPU, so each distinct shape's first weight is compared, byte for byte, with that
    layout of its dense values (kvscope::amx_blocks_match); a shape whose layout is another stays on oneDNN."""
    available = amx_unavailable() is None
    layout_ok: dict[tuple[int, int], bool] = {}
    count = 0
    for m in model.modules():
        if not isinstance(m, PackedLinear):
            continue
        if not available or m.dtype != torch.bfloat16:  # (a model shared by engines: each sets it again)
            m.amx = False
            continue
        shape = (m.out_features, m.in_features)
        if shape not in layout_ok:
            layout_ok[shape] = (m.out_features % 32 == 0 and m.in_features % 32 == 0
                                and torch.ops.mkldnn._nbytes(m.packed) == 2 * m.out_features * m.in_features
                                and torch.ops.kvscope.amx_blocks_match(m.packed, m.packed.to_dense()))
        m.amx = layout_ok[shape]
        count += m.amx
    return f"{count} run decode steps (up to {AMX_MAX_ROWS} rows) on AMX tiles" if count else ""


def dpbf16_unavailable() -> str | None:
    """None if kvscope::dpbf16_linear can run here (the CPU kernels loaded, built with AVX-512 BF16); else why not."""
    if os.environ.get(DPBF16_ENV, "").strip() == "0":
        return f"{DPBF16_ENV}=0"
    if cpu_isa.below("AVX512_CORE_BF16"):
        return f"capped by {cpu_isa.describe()}"
    if not hasattr(torch.ops.kvscope, "dpbf16_built"):
        return "the CPU kernels are not loaded"
    if not torch.ops.kvscope.dpbf16_built():
        return "no AVX-512 BF16 here"
    return None


def _onednn_blocks(m: PackedLinear) -> tuple[int, int] | None:
    """The K blocks (one row, more rows) with which kvscope::dpbf16_linear gives oneDNN's bits for m's shape, or
    None: its packed bytes must be dpbf16_linear's layout of the dense weight, and the products of probes of random
    values (1 row; 2, 7 and DPBF16_MAX_ROWS rows) equal oneDNN's, bit for bit."""
    n, k = m.out_features, m.in_features
    if n % 64 or k % 2 or torch.ops.mkldnn._nbytes(m.packed) != 2 * n * k:
        return None
    if not torch.ops.kvscope.dpbf16_blocks_match(m.packed, m.packed.to_dense()):
        return None
    gen = torch.Generator().manual_seed(k * 7919 + n)
    # blocks of K or more are all one block: try one of them
    candidates = [b for b in DPBF16_BLOCK_CANDIDATES if b < k] + [min(b for b in DPBF16_BLOCK_CANDIDATES if b >= k)
                                                                  if k <= max(DPBF16_BLOCK_CANDIDATES) else k]
    found = []
    for rows in ((1,), (2, 7, DPBF16_MAX_ROWS)):
        probes = [torch.randn(r, k, generator=gen).to(torch.bfloat16) for r in rows]
        expected = [_ops()._linear_pointwise(x, m.packed, m.bias, "none", [], "") for x in probes]
        block = next((b for b in candidates
                      if all(torch.equal(torch.ops.kvscope.dpbf16_linear(x, m.packed, m.bias, b), want)
                             for x, want in zip(probes, expected))), 0)
        if not block:
            return None
        found.append(block)
    return found[0], found[1]


def use_dpbf16(model: torch.nn.Module) -> str:
    """Let the model's bf16 packed linear layers that are not on AMX run inputs of up to DPBF16_MAX_ROWS rows on
    kvscope::dpbf16_linear, in place; returns a note for start-up ("" where nothing changed). Call it after
    cpu_attention.load() and use_amx. Idempotent.

    The loop reads oneDNN's packed bytes as [N/64][K/2][64][2] and adds K in oneDNN's blocks: both depend on the
    shape, dtype and CPU, so each distinct shape's first weight is checked (_onednn_blocks); a shape that fails
    stays on oneDNN."""
    available = dpbf16_unavailable() is None
    blocks: dict[tuple[int, int, bool], tuple[int, int] | None] = {}
    count = 0
    with torch.inference_mode():
        for m in model.modules():
            if not isinstance(m, PackedLinear):
                continue
            if not available or m.amx or m.dtype != torch.bfloat16:  # (a model shared by engines: each sets it again)
                m.dpbf16_block = None
                continue
            shape = (m.out_features, m.in_features, m.bias is not None)
            if shape not in blocks:
                blocks[shape] = _onednn_blocks(m)
            m.dpbf16_block = blocks[shape]
            count += m.dpbf16_block is not None
    return f"{count} run decode steps (up to {DPBF16_MAX_ROWS} rows) on AVX-512 BF16" if count else ""
