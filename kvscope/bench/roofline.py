"""`kvscope bench --roofline`: how close each row came to what this machine could do for its work.

Once per run it measures the machine: GEMM FLOP/s at the model's own linear shapes (QKV, O,
gate/up, down, at the step's token budget), in the engine's dtype and torch thread count, the
faster of torch's F.linear and the engine's oneDNN-packed linear (engine/cpu/linear.py) on a CPU,
and memory bandwidth (a large copy, read + write counted). Each row's steps are then priced at
those peaks, the ideal an engine could reach doing the same steps:

    roofline_s = sum over steps of max(FLOPs / peak, bytes / bandwidth)

with FLOPs the linear layers' (2 per weight per token, the lm_head on sampled rows only) plus
attention's (4 x heads x head_dim per query-key pair per layer), and bytes every weight read
once per step plus the K/V of every scheduled sequence's context. roofline % = roofline_s over
the row's duration. The per-step FLOPs and bytes are the sim cost model's (engine/sim/cost.py:
`CostModel.terms` at 100% efficiency), so a sim run (`--backend sim --roofline`) gives the same
figure from its virtual step times, and the two compare.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvscope.engine.sim.catalog import CATALOG_DTYPES, GPU, ModelShape
from kvscope.engine.sim.cost import CostModel, Efficiency, StepShape, StepTerms
from kvscope.engine.sim.runner import SimRunner

COPY_BYTES = 256 << 20  # far past any last-level cache
GEMM_REPEATS = 3


@dataclass
class MachinePeaks:
    flops_per_s: float  # GEMM rate over the model's linear shapes (FLOP-weighted)
    bytes_per_s: float  # copy bandwidth, read + write counted
    dtype: str  # catalog name: fp32, bf16, fp16
    threads: int
    tokens: int  # the GEMMs' M: the step's token budget
    gemms: list[dict[str, Any]] = field(default_factory=list)  # per shape: m, k, n, flop_per_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def as_gpu(self) -> GPU:
        """The machine as the cost model's device: its measured rates, not a datasheet's."""
        return GPU("measured", 0, self.bytes_per_s, {self.dtype: self.flops_per_s, "fp32": self.flops_per_s}, 0.0,
                   source=f"measured by kvscope bench --roofline ({self.threads} threads)")

    def line(self) -> str:
        return (f"roofline peaks: GEMM {self.flops_per_s / 1e9:,.0f} GFLOP/s ({self.dtype}, {self.threads} threads, "
                f"M={self.tokens}), copy {self.bytes_per_s / 1e9:.1f} GB/s")


def linear_shapes(shape: ModelShape) -> list[tuple[int, int]]:
    """(in, out) of each linear layer of one decoder layer, as transformers runs them."""
    h, q, kv, inter = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, \
        shape.intermediate_size
    return [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]


def _best_seconds(fn, repeats: int, sync=lambda: None) -> float:
    fn()  # warm-up: first-touch pages, oneDNN's (or cuBLAS's) kernel choice
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _packed_linear_runner(torch_dtype):
    """w, x -> a call of the engine's oneDNN-packed linear (engine/cpu/linear.py), or None where it does not run."""
    import torch

    from kvscope.engine.cpu.linear import PackedLinear, packing_unavailable

    if packing_unavailable(torch_dtype) is not None:
        return None

    def runner(w, x):
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch_dtype).requires_grad_(False)
        lin.weight.copy_(w)
        packed = PackedLinear(lin)
        return lambda: packed(x)

    return runner


def measure_peaks(shape: ModelShape, torch_dtype, tokens: int, device: str = "cpu") -> MachinePeaks:
    """GEMM FLOP/s at the model's linear shapes with M=tokens, and copy bandwidth, on device (CPU: with
    torch's current thread count)."""
    import torch
    import torch.nn.functional as F

    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    repeats = GEMM_REPEATS if dev.type == "cpu" else 20  # a GPU GEMM is microseconds: more samples

    dtype = CATALOG_DTYPES[str(torch_dtype).removeprefix("torch.")]
    packed_linear = _packed_linear_runner(torch_dtype) if dev.type == "cpu" else None
    gemms = []
    total_flops = total_s = 0.0
    with torch.inference_mode():
        gen = torch.Generator().manual_seed(0)
        for k, n in dict.fromkeys(linear_shapes(shape)):  # each distinct shape once
            x = torch.randn(tokens, k, generator=gen).to(device=dev, dtype=torch_dtype)
            w = torch.randn(n, k, generator=gen).to(device=dev, dtype=torch_dtype)
            s = _best_seconds(lambda: F.linear(x, w), repeats, sync)
            if packed_linear is not None:  # the engine's own CPU path; the machine's best of the two is its peak
                s = min(s, _best_seconds(packed_linear(w, x), repeats, sync))
            flops = 2.0 * tokens * k * n
            count = linear_shapes(shape).count((k, n))
            total_flops += flops * count
            total_s += s * count
            gemms.append({"m": tokens, "k": k, "n": n, "flop_per_s": flops / s})
        src = torch.ones(COPY_BYTES // 4, dtype=torch.float32, device=dev)
        dst = torch.empty_like(src)
        copy_s = _best_seconds(lambda: dst.copy_(src), 5, sync)
    threads = torch.get_num_threads() if dev.type == "cpu" else 0
    return MachinePeaks(total_flops / total_s, 2 * COPY_BYTES / copy_s, dtype, threads, tokens, gemms)


def step_roofline_s(t: StepTerms) -> float:
    """One step at the peaks: the larger of its FLOPs' time and its bytes' time (weights once, plus KV)."""
    return max(t.linear_comp + t.attn_comp, t.weight_mem + t.kv_mem)


def roofline_seconds(cost: CostModel, shapes: list[StepShape]) -> float:
    return sum(step_roofline_s(cost.terms(s)) for s in shapes if s.tokens)


IDEAL = Efficiency(eff_bw=1.0, eff_flops=1.0, overhead_s=0.0)
FORMULA = "roofline = sum over steps of max(FLOPs / GEMM peak, (weights + KV read) / copy bandwidth)"


@dataclass
class Roofline:
    """The peaks and the cost model (at 100% efficiency, no overhead) that prices steps at them."""

    peaks: MachinePeaks | None  # None: a sim run's catalog GPU
    cost: CostModel

    @classmethod
    def of(cls, peaks: MachinePeaks, shape: ModelShape) -> "Roofline":
        """A real run's: the measured peaks."""
        return cls(peaks, CostModel(peaks.as_gpu(), shape, efficiency=IDEAL))

    @classmethod
    def of_sim(cls, cost: CostModel) -> "Roofline":
        """A sim run's: its own GPU, model, tp and KV dtype, at the datasheet peaks."""
        return cls(None, CostModel(cost.gpu, cost.model, tp=cost.tp, kv_dtype=cost.kv_dtype, efficiency=IDEAL))

    def extra(self, shapes: list[StepShape] | None, duration_s: float) -> dict[str, Any]:
        """A row's columns: the ideal time of its steps, and achieved/roofline (None where steps are unknown)."""
        if shapes is None:
            return {"roofline_s": None, "roofline_pct": None}
        return roofline_extra(self.cost, shapes, duration_s)

    def to_dict(self) -> dict[str, Any]:
        return {"peaks": self.peaks.to_dict() if self.peaks else None, "formula": FORMULA}


class StepShapes:
    """Records the StepShape of every step a runner computes (wraps runner.run; the runner is unchanged)."""

    def __init__(self, runner) -> None:
        self.shapes: list[StepShape] = []
        inner = runner.run

        def run(out, params):
            if not out.is_empty:
                self.shapes.append(SimRunner.shape(out))
            return inner(out, params)

        runner.run = run


def roofline_extra(cost: CostModel, shapes: list[StepShape], duration_s: float) -> dict[str, Any]:
    """A row's roofline columns: the ideal time of its steps and achieved/roofline."""
    ideal = roofline_seconds(cost, shapes)
    return {"roofline_s": ideal, "roofline_pct": 100.0 * ideal / duration_s if duration_s > 0 else None}


def hf_static_shapes(items, max_num_seqs: int) -> list[StepShape]:
    """hf-static's steps: each padded batch's prefill, then one decode step per token up to its longest."""
    shapes = []
    for i in range(0, len(items), max_num_seqs):
        batch = items[i : i + max_num_seqs]
        width = max(len(it.prompt) for it in batch)
        longest = max(it.max_tokens for it in batch)
        pre = StepShape()
        for _ in batch:
            pre.add(width, 0, True)
        shapes.append(pre)
        for j in range(1, longest):
            dec = StepShape()
            for _ in batch:
                dec.add(1, width + j - 1, True)
            shapes.append(dec)
    return shapes
