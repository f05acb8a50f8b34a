"""`kvscope race`: the same requests through several configurations, each recorded to a trace.

The requests are exactly the ones `kvscope bench` uses for that configuration (all
arriving at t=0; on the sim backend the preset's or workload's own), and each run's
row is built by the same function as bench's row, so `race --no-tui --json` gives
bench's rows. The runs take turns on this machine, one after another: running them at
once on shared cores would make the comparison unfair. The traces then play back in
sync through `kvscope compare`.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import dataclass, replace

from kvscope.engine.config import EngineConfig
from kvscope.errors import KvscopeError

LABELS = "ABCD"
MAX_RUNS = len(LABELS)


class RaceError(KvscopeError):
    """A race that cannot be run as asked (one line)."""


@dataclass(frozen=True)
class RacePlan:
    label: str
    name: str
    config: EngineConfig


def plan(config: EngineConfig, modes: list[str], policies: list[str],
         schedulers: list[str] | None = None) -> list[RacePlan]:
    """One run per (scheduler, mode, policy); names carry the scheduler or the policy only when several
    are raced (``--schedulers kvscope,vllm``: kvscope's scheduler against vLLM's own, same requests)."""
    from kvscope.engine.config import MODES, SCHEDULERS

    for mode in modes:
        if mode not in MODES:
            raise RaceError(f"unknown mode {mode!r} (choose from {', '.join(MODES)})")
    for sched in schedulers or ():
        if sched not in SCHEDULERS:
            raise RaceError(f"unknown scheduler {sched!r} (choose from {', '.join(SCHEDULERS)})")
    policies = policies or [config.policy]
    schedulers = schedulers or [config.scheduler]
    combos = [(s, m, p) for s in schedulers for m in modes for p in policies]
    if not combos:
        raise RaceError("nothing to race: give at least one mode")
    if len(combos) > MAX_RUNS:
        raise RaceError(f"a race shows at most {MAX_RUNS} runs; {len(schedulers)} schedulers x {len(modes)} modes x "
                        f"{len(policies)} policies is {len(combos)}")

    def name(s: str, m: str, p: str) -> str:
        parts = [s] if len(schedulers) > 1 else []
        if len(modes) > 1 or not parts:
            parts.append(m)
        if len(policies) > 1:
            parts.append(p)
        return "-".join(parts)

    return [RacePlan(LABELS[i], name(s, m, p), replace(config, scheduler=s, mode=m, policy=p))
            for i, (s, m, p) in enumerate(combos)]


def trace_path(run: RacePlan, out_dir: str) -> str:
    return os.path.join(out_dir, f"{run.label}-{run.name}.kvtrace")


def run_race(runs: list[RacePlan], items, out_dir: str, *, sim: bool, progress: bool = True,
             log=print, slo=None) -> list[dict]:
    """Run each plan over ``items``, recording ``out_dir/<label>-<name>.kvtrace``; returns bench rows."""
    from kvscope.goodput import NO_SLO
    from kvscope.bench.harness import mode_row, run_config
    from kvscope.bench.sim import sim_row
    from kvscope.traces.writer import TraceWriter

    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for k, run in enumerate(runs):
        path = trace_path(run, out_dir)
        writers: list = []

        def record(engine, path=path):
            writers.append(TraceWriter(path, engine.hello(), snapshot_provider=engine.snapshot))
            return writers[-1]

        bar = _bar(len(items), f"[race {k + 1}/{len(runs)}] {run.name}", progress)
        wall = time.perf_counter()
        try:
            engine, server = run_config(run.config, items, make_sink=record, on_progress=bar.update,
                                        slo=slo or NO_SLO)
        finally:
            bar.close()
            for w in writers:
                w.close()
        wall = time.perf_counter() - wall
        row = (sim_row(run.name, engine, server, wall) if sim else mode_row(run.name, engine, server)).to_dict()
        row["trace"] = path
        rows.append(row)
        log(f"[race] {run.label} {run.name}: {row['output_tok_per_s']:.1f} tok/s -> {path}", file=sys.stderr)
    return rows


def _bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=not enabled, leave=False)


def race_result(runs: list[RacePlan], rows: list[dict], items, device: str, *, sim: bool, workload: str) -> dict:
    """The JSON `race --no-tui` writes: bench's top-level shape, its rows, and where the traces are."""
    base = runs[0].config
    return {
        "workload": workload,
        "model": base.model,
        "device": device,
        "backend": "sim" if sim else "model",
        "num_requests": len(items),
        "max_num_seqs": base.max_num_seqs,
        "max_num_batched_tokens": base.max_num_batched_tokens,
        "host": {"python": platform.python_version()},
        "runs": [{"label": r.label, "name": r.name, "mode": r.config.mode, "policy": r.config.policy}
                 for r in runs],
        "rows": rows,
        "traces": [row["trace"] for row in rows],
    }
