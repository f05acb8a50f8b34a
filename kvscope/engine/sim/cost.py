"""The time of one iteration, from the shape of the batch it runs.

A step runs two kinds of kernels, and each kind is bounded by its own roofline:

- the linear layers (QKV/O projections, MLP, lm_head): they stream every weight once
  per step, and do 2 FLOPs per weight per token;
- attention: it streams the KV of every scheduled sequence's context, and does
  4 x heads x head_dim FLOPs per (query token, context token) pair in each layer
  (QK^T and PV); a prefill chunk of n tokens after s cached ones has n*s + n(n+1)/2 pairs.

    t = max(W / BW', F_lin / R_lin') + max(KV / BW', F_attn / R_attn') + overhead + t_tp

BW' = bandwidth x eff_bw and R' = matrix rate x eff_flops. Why a sum of two maxima:
within one kernel class the bytes and the FLOPs overlap (the GEMM streams weights while
the tensor cores work), so that class costs the larger of the two; but the classes run
one after another, and in a mixed batch they sit on different sides of the ridge point
(decode attention is memory-bound while a big prefill's GEMMs are compute-bound), so a
single max over the whole step would hide one of them. A plain sum of all four terms
would bill a decode step's GEMM FLOPs on top of its weight reads, which real kernels
overlap.

With tensor parallelism of degree tp, weights, KV and FLOPs split tp ways and each step
adds two all-reduces per layer of the step's activations (ring: 2(tp-1)/tp of the bytes).
The overhead is the host's per-iteration cost (scheduling, launches, sampling).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvscope.engine.sim.catalog import DTYPE_BYTES, GPU, ModelShape


@dataclass
class Efficiency:
    """Fractions of the datasheet peaks a real engine reaches, and its fixed cost per step.

    The defaults are fitted to published runs of real engines (kvscope/bench/anchors.json, the
    "fit" split; docs/SIM.md has the table and the validation split): eff_bw 0.832 of
    the HBM/GDDR bandwidth for weight and KV streaming, 3.2 ms of host and launch cost
    per step for kvscope's own kind of engine (a nano-vllm-style Python engine; its
    Triton fork's runs are the fit's), eff_flops kept at its prior 0.6 (a typical
    large-GEMM share of dense peak), which those throughput runs do not constrain.
    Other engines' profiles are in ENGINE_PROFILES. `kvscope calibrate` fits all four
    to one's own trace instead.
    """

    eff_bw: float = 0.832
    eff_flops: float = 0.6
    overhead_s: float = 0.0032
    per_seq_s: float = 0.0  # host cost per scheduled sequence (metadata, sampling); fitted on CPU traces

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Efficiency":
        return cls(**{k: float(d[k]) for k in ("eff_bw", "eff_flops", "overhead_s", "per_seq_s") if k in d})


@dataclass(slots=True)
class StepShape:
    """What the cost model needs to know about one step's batch."""

    tokens: int = 0  # query tokens computed (incl. padding rows)
    sampled: int = 0  # rows whose logits are computed (the lm_head runs on these only)
    kv_tokens: int = 0  # context tokens whose K and V are read (incl. the new ones)
    pairs: int = 0  # (query, key) pairs of causal attention
    seqs: int = 0

    def add(self, n: int, start: int, sample: bool) -> None:
        self.tokens += n
        self.sampled += 1 if sample else 0
        self.kv_tokens += start + n
        self.pairs += n * start + n * (n + 1) // 2
        self.seqs += 1


@dataclass(slots=True)
class StepTerms:
    """The four roofline terms of a step at 100% efficiency, in seconds, plus counts."""

    weight_mem: float
    linear_comp: float
    kv_mem: float
    attn_comp: float
    comm: float
    seqs: int

    def time(self, eff: Efficiency) -> float:
        return (max(self.weight_mem / eff.eff_bw, self.linear_comp / eff.eff_flops)
                + max(self.kv_mem / eff.eff_bw, self.attn_comp / eff.eff_flops)
                + self.comm + eff.overhead_s + eff.per_seq_s * self.seqs)


class CostModel:
    def __init__(self, gpu: GPU, model: ModelShape, *, tp: int = 1, kv_dtype: str | None = None,
                 efficiency: Efficiency | None = None) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        self.gpu = gpu
        self.model = model
        self.tp = tp
        self.kv_dtype = kv_dtype or _default_kv_dtype(model)
        if self.kv_dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown KV dtype {self.kv_dtype!r} (choose from {', '.join(DTYPE_BYTES)})")
        self.eff = efficiency or Efficiency()
        m = model
        self.weight_bytes_read = m.weight_bytes_read_per_step / tp
        self.kv_bytes_per_token = m.kv_bytes_per_token(self.kv_dtype) / tp
        self.linear_rate = gpu.rate(m.weight_dtype)
        # Attention math runs in the activation dtype (bf16 on GPUs, fp32 on the CPU host).
        self.attn_rate = gpu.rate("bf16" if "bf16" in gpu.matrix_rate and gpu.name != "cpu" else "fp32")
        self.attn_flops_per_pair = 4 * m.num_heads * m.head_dim * m.num_layers / tp
        self.lin_flops_per_token = 2 * m.linear_params / tp
        self.lm_head_flops_per_row = 2 * m.lm_head_params / tp
        act_bytes = m.hidden_size * 2  # bf16 activations
        self.comm_bytes_per_token = (0.0 if tp == 1 else
                                     2 * m.num_layers * act_bytes * 2 * (tp - 1) / tp)

    # ---- per step ------------------------------------------------------------
    def terms(self, s: StepShape) -> StepTerms:
        bw = self.gpu.memory_bw
        comm = self.comm_bytes_per_token * s.tokens / self.gpu.interconnect_bw if self.tp > 1 else 0.0
        return StepTerms(
            weight_mem=self.weight_bytes_read / bw,
            linear_comp=(self.lin_flops_per_token * s.tokens + self.lm_head_flops_per_row * s.sampled)
            / self.linear_rate,
            kv_mem=self.kv_bytes_per_token * s.kv_tokens / bw,
            attn_comp=self.attn_flops_per_pair * s.pairs / self.attn_rate,
            comm=comm,
            seqs=s.seqs,
        )

    def step_time(self, s: StepShape) -> float:
        if s.tokens == 0:
            return self.eff.overhead_s
        return self.terms(s).time(self.eff)

    # ---- memory ----------------------------------------------------------------
    def kv_capacity_bytes(self, gpu_memory_utilization: float) -> int:
        """Per GPU: the share of memory the engine may use, less this GPU's slice of the weights."""
        budget = self.gpu.memory_bytes * gpu_memory_utilization - self.model.weight_bytes / self.tp
        return int(max(0.0, budget))

    def num_blocks(self, block_size: int, gpu_memory_utilization: float) -> int:
        return int(self.kv_capacity_bytes(gpu_memory_utilization) // (self.kv_bytes_per_token * block_size))


def _default_kv_dtype(model: ModelShape) -> str:
    """The activation dtype: an FP8-weight checkpoint still keeps a bf16 KV cache unless asked (vLLM's 'auto')."""
    if model.weight_dtype == "fp32":
        return "fp32"
    return model.embed_dtype or ("bf16" if model.weight_dtype == "fp8" else model.weight_dtype)


# Efficiency fields that differ from the defaults, per engine the anchors name (kvscope/bench/anchors.json):
# fitted with the defaults (kvscope/bench/anchor_fit.py). vLLM pays more per step (its V1 engine core's
# scheduling, detokenizing and IPC): 4.77 ms against 3.2 ms, from its A800 / RTX 4070 Laptop runs.
ENGINE_PROFILES: dict[str, dict[str, float]] = {
    "vllm": {"overhead_s": 0.00477},
}


def engine_efficiency(engine: str | None = None) -> Efficiency:
    """The defaults (kvscope's own engine, nano-vllm and its forks), with a named engine's profile on top."""
    base = Efficiency().to_dict()
    base.update(ENGINE_PROFILES.get(engine or "", {}))
    return Efficiency(**base)
