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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PACK_ROWS_HINT = 64  # the batch size oneDNN is told to expect: measured indifferent between 1 and 512


def _ops():
    return torch.ops.mkldnn


class PackedLinear(torch.nn.Module):
    """y = x W^T + b with W held in oneDNN's layout for this CPU."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.dtype = w.dtype
        self.packed = _ops()._reorder_linear_weight(w, PACK_ROWS_HINT)  # plain attribute: not in state_dict
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
        return f"oneDNN's packed linear failed here ({str(e).splitlines()[0][:80]})"
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
    already = sum(isinstance(m, PackedLinear) for m in model.modules())
    if already:
        return PackResult(already, 0, f"linear layers: {already} packed for oneDNN")
    why_not = packing_unavailable(dtype)
    if why_not is not None:
        return PackResult(0, 0, f"linear layers: torch's F.linear ({why_not})")
    others = {p.data_ptr() for m in model.modules() if not isinstance(m, torch.nn.Linear)
              for p in m.parameters(recurse=False)}  # the embedding's, which a tied lm_head shares
    count = extra = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                if child.weight.data_ptr() in others:  # tied: the embedding keeps its unpacked copy
                    extra += child.weight.numel() * child.weight.element_size()
                setattr(parent, name, PackedLinear(child))
                count += 1
    note = f"linear layers: {count} packed for oneDNN"
    if extra:
        note += f" (+{extra / 2**20:,.1f} MiB: the tied lm_head's own packed copy)"
    return PackResult(count, extra, note)
