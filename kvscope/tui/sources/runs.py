"""The runs a compare screen shows: each trace opened, summarised and labelled.

A run that cannot be read keeps its column, with the error in it, and the others
play. ``differing_knobs`` names the configuration keys whose values differ between
the runs, so each column can highlight what makes it different.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import bisect
from array import array

from kvscope.goodput import resolve_slo
from kvscope.protocol.events import RequestEvent, StepEvent
from kvscope.traces.figures import RowTally
from kvscope.traces.reader import engine_trace

MAX_RUNS = 4

# Keys of hello.config worth naming when they differ (in this order); the rest are
# identities (wall time, device) or derived numbers.
KNOBS = ("mode", "policy", "preemption", "prefix_caching", "max_num_seqs", "max_num_batched_tokens",
         "num_blocks", "block_size", "chunk_size", "swap_space", "max_model_len", "model", "backend", "gpu",
         "sim_model", "tp", "kv_cache_dtype", "dtype", "seed")
SHORT = {"max_num_seqs": "seqs", "max_num_batched_tokens": "budget", "num_blocks": "blocks",
         "block_size": "bs", "prefix_caching": "prefix", "preemption": "preempt", "kv_cache_dtype": "kv",
         "max_model_len": "max_len", "chunk_size": "chunk", "swap_space": "swap"}


@dataclass
class Run:
    path: str
    label: str  # A, B, C, D
    config: dict[str, Any] = field(default_factory=dict)
    controller: Any = None  # ReplayController, or None when the trace could not be read
    figures: dict[str, Any] = field(default_factory=dict)  # the bench row over the whole trace
    first_arrival: float | None = None
    workload: tuple = ()  # (requests, prompt tokens, max_tokens) of the whole run
    error: str | None = None
    warnings: list[str] = field(default_factory=list)
    finish_t: array = field(default_factory=lambda: array("d"))  # finish times, sorted
    finish_tokens: array = field(default_factory=lambda: array("q"))  # output tokens finished by then

    def finished_by(self, t: float) -> tuple[int, int]:
        """(requests finished, their output tokens) by engine time ``t``: exact, whatever the seeks."""
        i = bisect.bisect_right(self.finish_t, t + 1e-12)
        return i, (self.finish_tokens[i - 1] if i else 0)

    @property
    def name(self) -> str:
        if self.error:
            return os.path.basename(self.path)
        mode = self.config.get("mode", "?")
        policy = self.config.get("policy", "?")
        return f"{mode} · {policy}"

    @property
    def ok(self) -> bool:
        return self.controller is not None


def knob_text(key: str, value: Any) -> str:
    short = SHORT.get(key, key)
    if isinstance(value, bool):
        return f"{short} {'on' if value else 'off'}"
    return f"{short} {value}"


def differing_knobs(runs: list[Run]) -> list[str]:
    """Config keys (from KNOBS) whose value is not the same in every readable run."""
    good = [r for r in runs if r.ok]
    if len(good) < 2:
        return []
    out = []
    for key in KNOBS:
        values = {repr(r.config.get(key)) for r in good}
        if len(values) > 1:
            out.append(key)
    return out


def load_run(path: str, label: str, *, clock: Callable[[], float], slo=None,
             cost_per_hour: float | None = None) -> Run:
    """Open a trace; one pass for its figures and arrivals, then a paused controller."""
    from kvscope.protocol.codec import ProtocolError
    from kvscope.tui.sources.replay import ReplayController

    run = Run(path=path, label=label)
    try:
        trace = engine_trace(path, "compare")
        run.config = trace.hello.config.as_dict()
        acc = RowTally(_int(run.config.get("block_size"), 16), resolve_slo(slo, trace.hello.config), cost_per_hour)
        prompt_tokens = max_tokens = 0
        first = None
        seen: set[int] = set()
        finishes: list[tuple[float, int]] = []
        for ev in trace:
            acc.add(ev)
            if type(ev) is StepEvent and ev.finished:
                end = ev.t + ev.dur
                finishes.extend((end, f.output_len) for f in ev.finished)
            if type(ev) is RequestEvent and ev.req not in seen:
                seen.add(ev.req)
                prompt_tokens += ev.prompt_len
                max_tokens += ev.max_tokens
                if first is None or ev.arrival < first:
                    first = float(ev.arrival)
        finishes.sort()
        total = 0
        for t, n in finishes:
            total += n
            run.finish_t.append(t)
            run.finish_tokens.append(total)
        run.figures = acc.row(label)
        run.first_arrival = first
        run.workload = (len(seen), prompt_tokens, max_tokens)
        run.warnings = list(getattr(trace, "warnings", []) or [])
        run.controller = ReplayController(trace, playing=False, clock=clock, slo=slo)
        # Forward moves always apply every event, as live did, so the figures "so far" hold;
        # only a move back starts again from a snapshot.
        run.controller.FORWARD_LIMIT = 1 << 62
    except (OSError, ProtocolError, ValueError) as e:
        run.error = _one_line(e)
    return run


def setup_line(runs: list[Run]) -> str | None:
    """What every run ran on, when they share it: the simulated GPU and model (a race's sim runs), or the
    model and device, with the KV pool. None when the runs differ there (their columns then say)."""
    good = [r for r in runs if r.ok]
    if not good:
        return None
    keys = ("backend", "model", "device", "gpu", "tp", "kv_cache_dtype", "num_blocks", "block_size")
    first = {k: good[0].config.get(k) for k in keys}
    if any({k: r.config.get(k) for k in keys} != first for r in good[1:]):
        return None
    pool = (f"KV pool {first['num_blocks']:,} blocks of {first['block_size']} tokens"
            if isinstance(first["num_blocks"], int) else "")
    if first["backend"] == "sim":
        kv = f", KV {first['kv_cache_dtype']}" if first["kv_cache_dtype"] else ""
        return (f"simulated: {first['model']} on {first['gpu'] or first['device']} "
                f"(tp {first['tp'] or 1}{kv}), {pool}").rstrip(", ")
    return f"{first['model']} on {first['device']}, {pool}".rstrip(", ")


def workload_notice(runs: list[Run]) -> str | None:
    """A visible note when the runs did not serve the same requests."""
    shapes = {r.workload for r in runs if r.ok}
    if len(shapes) <= 1:
        return None
    parts = [f"{r.label}: {r.workload[0]} req / {r.workload[1]} prompt tok" for r in runs if r.ok]
    return "different workloads: " + ", ".join(parts) + " (figures are not like for like)"


def _int(v: Any, default: int) -> int:
    try:
        n = int(v)
    except (TypeError, ValueError):
        return default
    return n if n > 0 else default


def _one_line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text[:200]
