"""Benchmarks of the scheduling features: prefix caching, priority, swap vs recompute.

``kvscope bench-features`` runs three paired comparisons on the same generated
traffic (same seed, same arrival times), each pair differing in one setting:

- ``shared-prefix``: prefix caching off vs on, on the shared-prefix workload
  (80% of requests start with the same 256-token system prompt): TTFT p50/p99,
  output throughput, hit rate.
- ``priority``: fcfs vs priority on bursts where a quarter of the requests are
  high priority: TTFT p50/p99 of each class.
- ``swap``: preemption by recompute vs by swap under KV pressure (a small KV
  cache): throughput, preemptions, tokens recomputed, blocks swapped.

Arrivals follow wall-clock time as in ``kvscope serve``; sizes default to what the
tiny model handles on a laptop CPU in about a minute per experiment. Percentiles are
nearest-rank, as in every bench table.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

from kvscope import workload as wl
from kvscope.bench import FEATURE_EXPERIMENTS
from kvscope.bench.report import markdown_table
from kvscope.engine.config import PREEMPT_RECOMPUTE, PREEMPT_SWAP, EngineConfig, Mode
from kvscope.errors import KvscopeError
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.sampling_params import SamplingParams
from kvscope.quantiles import percentile
from kvscope.serve.driver import reserved_top_ids

EXPERIMENTS = FEATURE_EXPERIMENTS


@dataclass
class RunResult:
    label: str
    settings: dict[str, Any]
    requests: int
    output_tokens: int
    duration_s: float
    output_tok_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    preemptions: int
    steps: int
    hit_rate: float = 0.0
    recomputed_tokens: int = 0
    swapped_out_blocks: int = 0
    cow_copies: int = 0
    by_priority: dict[str, dict[str, float | int | None]] = field(default_factory=dict)


def _ms(values: list[float], q: float) -> float | None:
    """The q-th nearest-rank percentile in ms (the one definition, docs/QUANTILES.md)."""
    p = percentile(values, q)
    return None if p is None else p * 1000


def _drive(engine, items) -> tuple[list, float]:
    """Submit items at their arrival offsets (wall clock) and step until all finish."""
    items = sorted(items, key=lambda it: it.arrival)
    done = []
    i = 0
    start = engine.now()
    while i < len(items) or engine.has_unfinished():
        now = engine.now()
        while i < len(items) and start + items[i].arrival <= now:
            it = items[i]
            engine.add_request(it.prompt, SamplingParams(max_tokens=it.max_tokens, ignore_eos=True), it.priority,
                               arrival=start + it.arrival)
            i += 1
        if engine.has_unfinished():
            done += engine.step()
        elif i < len(items):
            time.sleep(max(0.0, min(0.01, start + items[i].arrival - engine.now())))
    return done, engine.now() - start


def run_one(label: str, make_items, base: dict[str, Any], settings: dict[str, Any]) -> RunResult:
    engine = LLMEngine(EngineConfig(**{**base, **settings}))
    # the same traffic for every run: generated from the seed for this model's vocabulary
    done, duration = _drive(engine, make_items(engine.loaded))
    sched, bm = engine.scheduler, engine.block_manager
    ttft = [r.ttft for r in done if r.ttft is not None]
    out_tokens = sum(r.num_output_tokens for r in done)
    by_prio: dict[str, dict[str, float | int | None]] = {}
    for p in sorted({r.priority for r in done}):
        t = [r.ttft for r in done if r.priority == p and r.ttft is not None]
        by_prio[str(p)] = {"requests": len(t), "ttft_p50_ms": _ms(t, 50), "ttft_p99_ms": _ms(t, 99)}
    return RunResult(
        label=label,
        settings=settings,
        requests=len(done),
        output_tokens=out_tokens,
        duration_s=duration,
        output_tok_per_s=out_tokens / duration if duration > 0 else 0.0,
        ttft_p50_ms=_ms(ttft, 50),
        ttft_p99_ms=_ms(ttft, 99),
        preemptions=engine.num_preemptions,
        steps=sched.step_count,
        hit_rate=bm.hit_rate,
        recomputed_tokens=sched.num_recomputed_tokens,
        swapped_out_blocks=sched.swap_pool.blocks_out if sched.swap_pool is not None else 0,
        cow_copies=bm.cow_copies,
        by_priority=by_prio,
    )


def _items(spec, num_requests: int, seed: int, max_prompt_len: int):
    def make(loaded) -> list[wl.WorkloadRequest]:
        return wl.generate(spec, vocab_size=loaded.vocab_size, num_requests=num_requests, seed=seed,
                           max_prompt_len=max_prompt_len,
                           reserved_ids=reserved_top_ids(loaded.vocab_size, loaded.eos_token_ids))

    return make


def check_experiments(names: list[str]) -> None:
    bad = [n for n in names if n not in EXPERIMENTS]
    if bad:
        raise KvscopeError(f"unknown experiment {bad[0]!r} (choose from {', '.join(EXPERIMENTS)})")


def experiment(name: str, *, model: str = "tiny", device: str = "cpu", scale: float = 1.0,
               seed: int = 0) -> dict[str, Any]:
    base: dict[str, Any] = dict(model=model, device=device, mode=Mode.CHUNKED, seed=seed)
    n = lambda k: max(4, int(k * scale))  # noqa: E731
    if name == "shared-prefix":
        spec = copy.deepcopy(wl.PRESETS["shared-prefix"])
        spec.arrival = wl.ArrivalSpec.poisson(40.0)  # more than the tiny model on a CPU keeps up with
        spec.num_requests = n(64)
        items = _items(spec, spec.num_requests, seed, 2000)
        runs = [run_one("prefix caching off", items, base, dict(prefix_caching=False)),
                run_one("prefix caching on", items, base, dict(prefix_caching=True))]
        what = spec.describe()
    elif name == "priority":
        spec = wl.WorkloadSpec(name="priority-overload", num_requests=n(64),
                               arrival=wl.ArrivalSpec.poisson(24.0),
                               prompt_len=wl.LengthDist.uniform(32, 256), output_len=wl.LengthDist.uniform(32, 128),
                               priority_levels=[0, 0, 0, 1])
        items = _items(spec, n(64), seed, 2000)
        base.update(max_num_seqs=8)
        runs = [run_one("fcfs", items, base, dict(policy="fcfs")),
                run_one("priority", items, base, dict(policy="priority"))]
        what = spec.describe() + "; max_num_seqs 8"
    elif name == "swap":
        spec = wl.WorkloadSpec(name="kv-pressure", num_requests=n(40), arrival=wl.ArrivalSpec.poisson(20.0),
                               prompt_len=wl.LengthDist.uniform(96, 256),
                               output_len=wl.LengthDist.uniform(96, 192))
        items = _items(spec, n(40), seed, 400)
        base.update(num_blocks=64, max_num_seqs=16)
        runs = [run_one(PREEMPT_RECOMPUTE, items, base, dict(preemption=PREEMPT_RECOMPUTE)),
                run_one(PREEMPT_SWAP, items, base, dict(preemption=PREEMPT_SWAP, swap_space=1.0))]
        what = spec.describe() + "; 64 KV blocks of 16 tokens, max_num_seqs 16"
    else:
        check_experiments([name])
    return {"experiment": name, "workload": what, "engine": base, "runs": [r.__dict__ for r in runs]}


def _cell(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def table(result: dict[str, Any]) -> str:
    name, runs = result["experiment"], result["runs"]
    if name == "shared-prefix":
        header = ("setting", "TTFT p50 ms", "TTFT p99 ms", "output tok/s", "hit rate", "CoW copies")
        rows = [(r["label"], _cell(r["ttft_p50_ms"]), _cell(r["ttft_p99_ms"]), f"{r['output_tok_per_s']:.0f}",
                 f"{r['hit_rate']:.0%}", str(r["cow_copies"])) for r in runs]
    elif name == "priority":
        header = ("policy", "high prio TTFT p50 / p99 ms", "low prio TTFT p50 / p99 ms", "output tok/s",
                  "preemptions")
        rows = []
        for r in runs:
            hi, lo = r["by_priority"].get("1", {}), r["by_priority"].get("0", {})
            rows.append((r["label"], f"{_cell(hi.get('ttft_p50_ms'))} / {_cell(hi.get('ttft_p99_ms'))}",
                         f"{_cell(lo.get('ttft_p50_ms'))} / {_cell(lo.get('ttft_p99_ms'))}",
                         f"{r['output_tok_per_s']:.0f}", str(r["preemptions"])))
    else:
        header = ("preemption", "output tok/s", "duration s", "preemptions", "tokens recomputed",
                  "blocks swapped out", "TTFT p99 ms")
        rows = [(r["label"], f"{r['output_tok_per_s']:.0f}", f"{r['duration_s']:.1f}", str(r["preemptions"]),
                 str(r["recomputed_tokens"]), str(r["swapped_out_blocks"]), _cell(r["ttft_p99_ms"])) for r in runs]
    return f"## {name}: {result['workload']}\n\n" + markdown_table(header, rows)
