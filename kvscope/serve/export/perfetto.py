"""Chrome trace event JSON (opens in Perfetto and chrome://tracing), written as the trace is read.

Layout (docs/EXPORT.md):
- process 1 "scheduler": track "steps" (one slice per step, named and coloured by
  kind), instant tracks "preemptions", "swaps", "rejects", and the counters;
- process 2 "requests": lanes, each a thread track. A request takes the lowest
  free lane whose previous request ended before it arrived, so lanes are reused
  and no two slices on one track overlap.

Times are integer microseconds on the engine clock, so slices that touch share an
exact boundary and never overlap by rounding.
"""

from __future__ import annotations

import heapq
import json

from kvscope.protocol.events import RejectEvent, StepEvent
from kvscope.serve.export.lifecycle import Life, Slice
from kvscope.serve.metrics import step_kind

PID_SCHED, PID_REQS = 1, 2
TID_STEPS, TID_PREEMPT, TID_SWAPS, TID_REJECTS = 1, 2, 3, 4
# chrome://tracing's reserved colour names (Perfetto colours by name)
STEP_COLOURS = {"prefill": "rail_load", "decode": "good", "mixed": "yellow", "idle": "grey"}
PHASE_COLOURS = {"queued": "grey", "preempted": "bad", "swapped": "terrible", "prefill": "rail_load",
                 "decode": "good", "running": "generic_work"}


def us(t: float) -> int:
    return round(t * 1e6)


class Lanes:
    """Reusable request tracks: (end time, lane) of free lanes in a heap."""

    def __init__(self) -> None:
        self._free: list[tuple[int, int]] = []
        self.count = 0

    def take(self, start: int) -> int:
        if self._free and self._free[0][0] <= start:
            return heapq.heappop(self._free)[1]
        self.count += 1
        return self.count

    def give(self, lane: int, end: int) -> None:
        heapq.heappush(self._free, (end, lane))


class PerfettoWriter:
    def __init__(self, path: str, title: str = "kvscope") -> None:
        self.f = open(path, "w", buffering=1 << 20)
        self.f.write('{"displayTimeUnit":"ms","otherData":{"source":' + json.dumps(title) + '},"traceEvents":[\n')
        self.first = True
        self.lanes = Lanes()
        self._counters: dict[str, tuple] = {}
        self._named: set[int] = set()
        self.slices = 0
        meta = [(PID_SCHED, None, "process_name", "scheduler"), (PID_REQS, None, "process_name", "requests"),
                (PID_SCHED, TID_STEPS, "thread_name", "steps"), (PID_SCHED, TID_PREEMPT, "thread_name", "preemptions"),
                (PID_SCHED, TID_SWAPS, "thread_name", "swaps"), (PID_SCHED, TID_REJECTS, "thread_name", "rejects")]
        for pid, tid, what, name in meta:
            ev = {"ph": "M", "pid": pid, "name": what, "args": {"name": name}}
            if tid is not None:
                ev["tid"] = tid
            self._emit(ev)
        for pid, order in ((PID_SCHED, 0), (PID_REQS, 1)):
            self._emit({"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": order}})

    def _emit(self, ev: dict) -> None:
        self.f.write(("" if self.first else ",\n") + json.dumps(ev, separators=(",", ":")))
        self.first = False

    # ---- the scheduler ------------------------------------------------------------------
    def step(self, ev: StepEvent) -> None:
        start, end = us(ev.t), us(ev.t + ev.dur)
        kind = step_kind(ev)
        prefill = sum(b.tokens for b in ev.batch if b.kind == "prefill")
        decode = sum(b.tokens for b in ev.batch if b.kind == "decode")
        adm = ev.admission
        self._emit({"ph": "X", "pid": PID_SCHED, "tid": TID_STEPS, "name": kind, "cname": STEP_COLOURS[kind],
                    "ts": start, "dur": end - start,
                    "args": {"step": ev.step, "tokens": prefill + decode, "batch_size": len(ev.batch),
                             "prefill_tokens": prefill, "decode_tokens": decode, "budget": ev.budget,
                             "padding": ev.padding, "admission": adm.verdict, "blocked_by": adm.reason}})
        self.slices += 1
        for p in ev.preemptions:
            self._instant(TID_PREEMPT, "preemption", start, {"req": p.req, "reason": p.reason, "mode": p.mode})
        for s in ev.swaps:
            self._instant(TID_SWAPS, f"swap {s.direction}", start, {"req": s.req, "direction": s.direction,
                                                                     "blocks": s.blocks})
        kv = ev.kv
        self._counter("queues", end, running=len(ev.running), waiting=len(ev.waiting),
                      preempted=len(ev.preempted) + len(ev.swapped))
        self._counter("kv blocks", end, used=kv.used, cached=kv.cached)
        self._counter("step", end, tokens=prefill + decode)

    def reject(self, ev: RejectEvent) -> None:
        self._instant(TID_REJECTS, "reject", us(ev.t), {"req": ev.req, "reason": ev.reason})

    def _instant(self, tid: int, name: str, ts: int, args: dict) -> None:
        self._emit({"ph": "i", "s": "t", "pid": PID_SCHED, "tid": tid, "name": name, "ts": ts, "args": args})

    def _counter(self, name: str, ts: int, **values) -> None:
        key = tuple(values.values())
        if self._counters.get(name) == key:
            return  # unchanged: a counter track holds its value until the next sample
        self._counters[name] = key
        self._emit({"ph": "C", "pid": PID_SCHED, "name": name, "ts": ts, "args": values})

    # ---- requests ----------------------------------------------------------------------------
    def request(self, life: Life) -> None:
        """Write a finished request's slices on one lane (called once per request, when it ends)."""
        if not life.slices:  # ended the moment it arrived (e.g. aborted while queued): still one slice
            life.slices.append(Slice("queued", life.arrival, max(life.arrival, life.finish_t or life.arrival)))
        start = us(min(life.arrival, life.slices[0].start))
        lane = self.lanes.take(start)
        if lane not in self._named:
            self._name_lane(lane)
        args = {"req": life.req, "prompt_tokens": life.prompt_len, "cached_tokens": life.cached_tokens,
                "output_tokens": life.output_len, "ttft": life.ttft, "finish_reason": life.finish_reason or None,
                "preemptions": life.preemptions, "source": life.source or "engine"}
        at = start
        for s in life.slices:
            a, b = max(at, us(s.start)), us(s.end)
            b = max(a, b)
            slice_args = {**args, "tokens": s.tokens} if s.phase in ("prefill", "decode") else args
            self._emit({"ph": "X", "pid": PID_REQS, "tid": lane, "name": s.phase, "cname": PHASE_COLOURS[s.phase],
                        "ts": a, "dur": b - a, "args": slice_args})
            self.slices += 1
            at = b
        self.lanes.give(lane, at)

    def _name_lane(self, lane: int) -> None:
        self._named.add(lane)
        self._emit({"ph": "M", "pid": PID_REQS, "tid": lane, "name": "thread_name", "args": {"name": f"lane {lane}"}})
        self._emit({"ph": "M", "pid": PID_REQS, "tid": lane, "name": "thread_sort_index", "args": {"sort_index": lane}})

    def close(self) -> None:
        self.f.write("\n]}\n")
        self.f.close()
