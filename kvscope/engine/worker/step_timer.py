"""A step's time, split at the forward's launch: host time before it, device time, host time after.

Off unless asked for: `ModelRunner.step_timer` is None, and the runner then pays one attribute
test per step. `attach(engine)` (benchmarks/gpu_check.py calls it) sets a StepTimer on the
engine's runner and wraps that engine's `step` (the instance's, not the class's), so the engine
computes exactly as it does without it.

Per step, on the host clock (time.perf_counter):

    t0  the step begins: scheduling, then the forward's inputs are built and copied
    t1  the forward's first launch (a graph replay, or the eager forward); an event is recorded
    t2  the forward's last launch has returned; a second event is recorded
    t3  the step ends: sampling (which waits for the GPU), outputs, the step's event

    host_before_ms = t1 - t0
    launch_ms      = t2 - t1          host time spent launching the forward
    device_ms      = the two events' elapsed time: the forward on the GPU's stream, from its first
                     kernel to its last (gaps while the host is still launching included)
    host_after_ms  = t3 - max(t2, t1 + device_ms): host time once both the launches and the GPU
                     are done (the GPU is taken to start at t1: it is idle then, since the
                     previous step's sampling waited for it)

so a step's wall time is host_before + max(launch, device) + host_after. On a CPU there are
no events: the forward runs as it is called, and device_ms is launch_ms.

Step kinds: "decode" (one-token decodes only: the steps CUDA graphs replay), "mixed" (decodes
and prefill chunks), "prefill" (prefill chunks only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from kvscope.quantiles import percentile

KINDS = ("decode", "mixed", "prefill")
FIELDS = ("host_before_ms", "launch_ms", "device_ms", "host_after_ms", "wall_ms")


@dataclass
class StepTime:
    kind: str
    graph: bool  # replayed from a CUDA graph
    host_before_ms: float
    launch_ms: float
    device_ms: float
    host_after_ms: float
    wall_ms: float
    shape: Any = None  # what shape_of(out) said of the step (gpu_check: its StepShape, priced later)


def step_kind(out) -> str:
    """decode, mixed or prefill, from a SchedulerOutput (its decode batch and its other sequences)."""
    decodes = len(out.decodes)
    others = len(out.other_seqs) + len(out.pad_rows)
    if not others:
        return "decode"
    return "mixed" if decodes else "prefill"


def split_step(t0: float, t1: float, t2: float, t3: float, device_ms: float | None) -> dict[str, float]:
    """The split of one step from its four host times (seconds) and its device time (ms; None on a CPU)."""
    launch_ms = (t2 - t1) * 1e3
    dev = launch_ms if device_ms is None else device_ms
    done = max(t2, t1 + dev / 1e3)
    return {"host_before_ms": (t1 - t0) * 1e3, "launch_ms": launch_ms, "device_ms": dev,
            "host_after_ms": max(0.0, t3 - done) * 1e3, "wall_ms": (t3 - t0) * 1e3}


class StepTimer:
    """Collects StepTime rows; see the module docstring for what each number is.

    make_event: a factory of timing events (torch.cuda.Event(enable_timing=True) on CUDA; None on a
    CPU). shape_of: out -> what to keep of each step's SchedulerOutput (for pricing it later).
    """

    def __init__(self, make_event: Callable[[], Any] | None = None, clock: Callable[[], float] = time.perf_counter,
                 shape_of: Callable[[Any], Any] | None = None) -> None:
        self.make_event = make_event
        self.clock = clock
        self.shape_of = shape_of
        self.steps: list[StepTime] = []
        self._open: dict[str, Any] | None = None

    @classmethod
    def for_device(cls, device, shape_of: Callable[[Any], Any] | None = None) -> "StepTimer":
        make_event = None
        if getattr(device, "type", device) == "cuda":
            import torch

            def make_event():
                return torch.cuda.Event(enable_timing=True)
        return cls(make_event, shape_of=shape_of)

    def step_begins(self) -> None:
        self._open = {"t0": self.clock(), "t1": None, "t2": None, "events": [], "kind": None, "graph": False,
                      "shape": None}

    def forward_begins(self, out, graph: bool) -> None:
        now = self.clock()
        if self._open is None:  # a forward outside a timed step: it begins the step
            self.step_begins()
            self._open["t0"] = now
        step = self._open
        if step["t1"] is None:  # the first of the step's forwards (a failed row is retried alone)
            step["t1"] = now
            step["kind"] = step_kind(out)
            step["graph"] = graph
            if self.shape_of is not None:
                step["shape"] = self.shape_of(out)
        if self.make_event is not None:
            start = self.make_event()
            start.record()
            step["events"].append([start, None])

    def forward_ends(self) -> None:
        step = self._open
        if step is None or step["t1"] is None:
            return
        if self.make_event is not None and step["events"]:
            end = self.make_event()
            end.record()
            step["events"][-1][1] = end
        step["t2"] = self.clock()

    def step_ends(self) -> None:
        step, self._open = self._open, None
        if step is None or step["t1"] is None or step["t2"] is None:
            return  # no forward ran (an empty step)
        t3 = self.clock()
        device_ms = None
        if self.make_event is not None:
            device_ms = 0.0
            for start, end in step["events"]:
                if end is not None:
                    end.synchronize()  # done already: sampling waited for the forward
                    device_ms += start.elapsed_time(end)
        parts = split_step(step["t0"], step["t1"], step["t2"], t3, device_ms)
        self.steps.append(StepTime(step["kind"], step["graph"], **parts, shape=step["shape"]))

    def summary(self, price: Callable[[Any], float] | None = None) -> dict[str, Any]:
        return summarize(self.steps, price)


def _group(steps: list[StepTime], price: Callable[[Any], float] | None) -> dict[str, Any]:
    wall_s = sum(s.wall_ms for s in steps) / 1e3
    g: dict[str, Any] = {"steps": len(steps), "graph_steps": sum(s.graph for s in steps), "wall_s": wall_s}
    for f in FIELDS[:-1]:
        g[f.removesuffix("_ms") + "_s"] = sum(getattr(s, f) for s in steps) / 1e3
    # shares of the wall time: host before + max(launch, device) + host after = wall
    g["device_share"] = g["device_s"] / wall_s if wall_s > 0 else None
    g["host_share"] = (g["host_before_s"] + g["host_after_s"]) / wall_s if wall_s > 0 else None
    for f in FIELDS:
        values = [getattr(s, f) for s in steps]
        g[f] = {"mean": sum(values) / len(values), "p50": percentile(values, 50), "p90": percentile(values, 90)}
    if price is not None and all(s.shape is not None for s in steps):
        g["roofline_s"] = sum(price(s.shape) for s in steps)
        g["roofline_pct"] = 100.0 * g["roofline_s"] / wall_s if wall_s > 0 else None
        g["device_vs_roofline"] = g["device_s"] / g["roofline_s"] if g["roofline_s"] > 0 else None
    return g


def summarize(steps: list[StepTime], price: Callable[[Any], float] | None = None) -> dict[str, Any]:
    """Per step kind, and over all steps: counts, summed seconds and shares, ms per step (mean, p50,
    p90), and with price (a step's shape -> its roofline seconds) the roofline beside the wall and
    device times."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        mine = [s for s in steps if s.kind == kind]
        if mine:
            out[kind] = _group(mine, price)
    if steps:
        out["all"] = _group(steps, price)
    return out


def attach(engine, shape_of: Callable[[Any], Any] | None = None) -> StepTimer:
    """Time every later step of `engine`: a StepTimer on its runner, and its step() wrapped (this instance's)."""
    timer = StepTimer.for_device(engine.runner.device, shape_of=shape_of)
    engine.runner.step_timer = timer
    inner = engine.step

    def step():
        timer.step_begins()
        try:
            return inner()
        finally:
            timer.step_ends()

    engine.step = step
    return timer
