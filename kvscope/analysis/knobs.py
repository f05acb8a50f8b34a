"""Which CLI flags to turn for a verdict, in order, plus the lesson's refusals and what to watch next.

Pure rules over the trace's config and signals: no engine. The what-if (whatif.py)
fills each knob's ``baseline`` and ``predicted`` afterwards.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from kvscope.analysis import verdicts as V
from kvscope.analysis.figures import RunFigures
from kvscope.analysis.signals import Signals

GMU_FLOOR = 0.7  # the lesson refuses to advise below this GPU memory utilization
GMU_TARGET = 0.9
GMU_HIGH = 0.95
MAX_KNOBS = 4
WIDE_KV_DTYPES = ("bf16", "fp16", "fp32", "bfloat16", "float16", "float32")

MEASURE_NEXT = {
    V.KV_CAPACITY: "preemptions and the share of steps blocked on kv_blocks (want both near 0), then TTFT p99",
    V.MAX_NUM_SEQS: "batch size against the new max_num_seqs and KV use (a bigger batch can start preempting), "
                    "then ITL p99",
    V.TOKEN_BUDGET: "TTFT p50/p99 and queue time; ITL p99, since bigger steps lengthen every decode",
    V.PREFILL_INTERFERENCE: "ITL p99 against p50 (want under 3x), and TTFT p99 of long prompts",
    V.BATCHING_MODE: "output tok/s and TTFT p99 against this run",
    V.POLICY_STARVATION: "queue time p99 of the requests that were passed over, and mean TTFT",
    V.COMPUTE_BOUND: "step time per token against the roofline (tok/s per GPU); only hardware or a cheaper "
                     "model moves it now",
    V.UNDERLOADED: "arrival rate against capacity: raise the load (kvscope bench) to find where queues start",
}


class Flag(NamedTuple):
    """One setting a knob turns, as each engine spells it (None: that engine has no such flag)."""

    kvscope: str | None
    vllm: str | None


# The settings the rules turn: kvscope's flag and the same setting in `vllm serve`'s engine arguments.
# kvscope's rules (candidates) name the first column, vLLM's (analysis.vllm_knobs) the second.
FLAGS = {
    "gpu_memory_utilization": Flag("--gpu-memory-utilization", "--gpu-memory-utilization"),
    "kv_cache_dtype": Flag("--kv-cache-dtype", "--kv-cache-dtype"),
    "num_blocks": Flag("--num-blocks", None),
    "max_num_seqs": Flag("--max-num-seqs", "--max-num-seqs"),
    "max_num_batched_tokens": Flag("--max-num-batched-tokens", "--max-num-batched-tokens"),
    "long_prefill_token_threshold": Flag("--long-prefill-token-threshold", "--long-prefill-token-threshold"),
    "chunked_prefill": Flag("--mode", "--enable-chunked-prefill"),
    "prefix_caching": Flag("--prefix-caching", "--enable-prefix-caching"),
    "preemption": Flag("--preemption", None),
    "policy": Flag("--policy", "--scheduling-policy"),
    "tp": Flag("--tp", "--tensor-parallel-size"),
}
KVSCOPE = {setting: f.kvscope for setting, f in FLAGS.items() if f.kvscope}
VLLM = {setting: f.vllm for setting, f in FLAGS.items() if f.vllm}


class Knob(msgspec.Struct, kw_only=True):
    flag: str
    from_: Any = msgspec.field(name="from")
    to: Any
    why: str
    baseline: RunFigures | None = None
    predicted: RunFigures | None = None


def is_gpu(config: dict) -> bool:
    return config.get("backend") == "sim" or str(config.get("device", "")).startswith("cuda")


def knob(flag: str, frm, to, why: str) -> Knob:
    """One knob: turn ``flag`` from ``frm`` to ``to``, and why (kvscope's rules and vLLM's build them alike)."""
    return Knob(flag=flag, from_=frm, to=to, why=why)


def _kv_knobs(cfg: dict, s: Signals) -> list[Knob]:
    out = []
    sim = cfg.get("backend") == "sim"
    gmu = cfg.get("gpu_memory_utilization")
    if is_gpu(cfg) and isinstance(gmu, (int, float)) and gmu < GMU_HIGH:
        out.append(knob(KVSCOPE["gpu_memory_utilization"], gmu, GMU_HIGH, "more of the GPU's memory for KV blocks"))
    kv_dtype = str(cfg.get("kv_cache_dtype") or "")
    if sim and kv_dtype in WIDE_KV_DTYPES:
        out.append(knob(KVSCOPE["kv_cache_dtype"], kv_dtype, "fp8", "an FP8 KV cache holds twice the tokens per GiB"))
    blocks = cfg.get("num_blocks")
    if not is_gpu(cfg) and isinstance(blocks, int):
        out.insert(0, knob(KVSCOPE["num_blocks"], blocks, 2 * blocks, "twice the KV blocks: fewer preemptions and "
                            "fewer admissions blocked on kv_blocks"))
    seqs = cfg.get("max_num_seqs")
    if isinstance(seqs, int) and s.running_max > 2:
        out.append(knob(KVSCOPE["max_num_seqs"], seqs, max(1, s.running_max // 2),
                         "fewer concurrent sequences fit the pool without preempting each other"))
    if cfg.get("preemption", cfg.get("preemption_mode")) == "recompute" and s.preemptions_kv:
        out.append(knob(KVSCOPE["preemption"], "recompute", "swap", "swap preempted KV to CPU instead of recomputing it"))
    return out


def budget_to(b: int) -> int:
    """A bigger step budget: four times a small one, twice a large one."""
    return 4 * b if b < 512 else 2 * b


def candidates(verdict: str, cfg: dict, s: Signals) -> list[Knob]:
    """The verdict's own knobs, first the one that addresses it most directly."""
    seqs, budget = cfg.get("max_num_seqs"), cfg.get("max_num_batched_tokens")
    mode, policy = cfg.get("mode"), cfg.get("policy")
    if verdict == V.KV_CAPACITY:
        return _kv_knobs(cfg, s)
    if verdict == V.MAX_NUM_SEQS and isinstance(seqs, int):
        return [knob(KVSCOPE["max_num_seqs"], seqs, 2 * seqs, "the batch is capped by max_num_seqs while KV blocks "
                      "and the token budget are free")]
    if verdict == V.TOKEN_BUDGET and isinstance(budget, int):
        return [knob(KVSCOPE["max_num_batched_tokens"], budget, budget_to(budget),
                      "a bigger per-step budget prefills waiting prompts sooner")]
    if verdict == V.PREFILL_INTERFERENCE:
        if mode == "continuous":
            return [knob(KVSCOPE["chunked_prefill"], mode, "chunked", "chunked prefill interleaves prompt chunks with decodes, "
                          "so a long prompt no longer stalls every decode")]
        if isinstance(budget, int) and budget > 64:
            return [knob(KVSCOPE["max_num_batched_tokens"], budget, max(64, budget // 4 if budget > 1024 else budget // 2),
                          "smaller prefill chunks per step keep each decode step short")]
    if verdict == V.BATCHING_MODE:
        return [knob(KVSCOPE["chunked_prefill"], mode, "chunked", "iteration-level batching admits and releases every step, "
                      "with chunked prefill")]
    if verdict == V.POLICY_STARVATION and policy not in (None, "fcfs"):
        return [knob(KVSCOPE["policy"], policy, "fcfs", "first come, first served passes nobody over")]
    if verdict == V.COMPUTE_BOUND and cfg.get("backend") == "sim":
        tp = cfg.get("tp") or 1
        return [knob(KVSCOPE["tp"], tp, 2 * tp, "the scheduler knobs are exhausted: steps are full and at the "
                      "roofline, so only more GPUs per replica shorten them")]
    return []


def with_runners_up(candidates, verdict: str, secondary, cfg: dict, s) -> list[Knob]:
    """The verdict's knobs, then the first knob of each strong runner-up, one per flag, none that changes
    nothing. ``candidates(verdict, cfg, s)`` names the knobs (kvscope's flags, or vLLM's)."""
    knobs = candidates(verdict, cfg, s)
    # underloaded: nothing to tune; compute_bound: the scheduler knobs are exhausted (the runners-up show it)
    for r in secondary if verdict not in (V.UNDERLOADED, V.COMPUTE_BOUND) else ():
        if r.score >= 0.5:
            knobs += candidates(r.bottleneck, cfg, s)[:1]
    seen: set[str] = set()
    unique = []
    for k in knobs:
        if k.flag not in seen and k.from_ != k.to:
            seen.add(k.flag)
            unique.append(k)
    return unique


def choose(verdict: str, secondary: list[V.Ruling], cfg: dict, s: Signals) -> tuple[list[Knob], list[str]]:
    """Ordered knobs (at most MAX_KNOBS, one per flag) and the refusals that shaped them."""
    refusals: list[str] = []
    gmu = cfg.get("gpu_memory_utilization")
    if is_gpu(cfg) and isinstance(gmu, (int, float)) and gmu < GMU_FLOOR:
        refusals.append(f"GPU memory utilization {gmu:g} is below {GMU_FLOOR:g}: raise it first; "
                        "no other knob is advised until it is")
        return [knob(KVSCOPE["gpu_memory_utilization"], gmu, GMU_TARGET, "below 0.7 most of the GPU's memory is "
                      "unused, so every other figure is measured on a starved KV pool")], refusals
    unique = with_runners_up(candidates, verdict, secondary, cfg, s)
    if verdict not in (V.COMPUTE_BOUND, V.UNDERLOADED) and is_gpu(cfg):
        refusals.append("no more GPUs (--tp) while scheduler knobs remain: try the knobs above first")
    if verdict == V.COMPUTE_BOUND and cfg.get("backend") != "sim":
        refusals.append("the scheduler knobs are exhausted; only faster hardware or more GPUs would help, "
                        "which a model-backend trace cannot try (diagnose a sim trace for --tp)")
    return unique[:MAX_KNOBS], refusals
