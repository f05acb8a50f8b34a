"""Reads an event stream once and keeps, per step and per request, the few numbers a diagnosis needs.

``StepLog`` is streaming: ``add(event)`` costs a handful of appends per step, and
with ``window=N`` it keeps only the last N steps (the live panel's sliding window).
``measure()`` turns what it holds into ``Signals`` with vectorized numpy, so a
160k-step trace is a few array passes. It reads protocol events only: no engine.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import msgspec

from kvscope.analysis.figures import percentile

if TYPE_CHECKING:  # numpy is imported where it is used: a dashboard's StepLog starts without it
    import numpy as np

from kvscope.protocol.events import (
    BLOCKED_BUDGET,
    BLOCKED_KV,
    BLOCKED_SEQS,
    BLOCKED_STATIC,
    PREFILL,
    VERDICT_ADMITTED,
    VERDICT_BLOCKED,
    HelloEvent,
    RequestEvent,
    SnapshotEvent,
    StepEvent,
)

# admission codes stored per step
ADM_IDLE, ADM_ADMITTED, ADM_KV, ADM_BUDGET, ADM_SEQS, ADM_STATIC = range(6)
_BLOCK_CODE = {BLOCKED_KV: ADM_KV, BLOCKED_BUDGET: ADM_BUDGET, BLOCKED_SEQS: ADM_SEQS, BLOCKED_STATIC: ADM_STATIC}
# per-step columns, in this order
COLUMNS = ("step", "t", "dur", "prefill", "decode", "budget", "padding", "running", "queued", "admission",
           "preempt_kv", "preempt_prio", "kv_used", "kv_total", "recomputed", "entries")


class _Req:
    __slots__ = ("arrival", "priority", "prompt_len", "first_sched", "ttft", "done")

    def __init__(self, arrival: float, priority: int, prompt_len: int) -> None:
        self.arrival, self.priority, self.prompt_len = arrival, priority, prompt_len
        self.first_sched: float | None = None
        self.ttft: float | None = None
        self.done = False


class StepLog:
    """Per-step rows and per-request times from an event stream (optionally the last ``window`` steps)."""

    def __init__(self, window: int | None = None) -> None:
        self.window = window
        self.config: dict = {}
        self.rows: deque[tuple] = deque(maxlen=window)
        self.itl: deque[tuple[int, float]] = deque()  # (step, gap)
        self.reqs: dict[int, _Req] = {}
        self.recomputing: set[int] = set()
        self.last_step: int | None = None
        self.saw_bye = False
        self.snapshots = 0

    def add(self, ev: Any) -> None:
        kind = type(ev)
        if kind is StepEvent:
            self._step(ev)
        elif kind is RequestEvent:
            self.reqs[ev.req] = _Req(ev.arrival, ev.priority, ev.prompt_len)
        elif kind is HelloEvent:
            config = ev.config.as_dict()
            if self.config and config != self.config and self.config.get("_wall") != ev.wall_start:
                self.reset()
            self.config = config
            self.config["_wall"] = ev.wall_start
        elif kind is SnapshotEvent:
            self.snapshots += 1
            for r in ev.requests:  # a late joiner learns the live requests from the snapshot
                if r.req not in self.reqs:
                    q = self.reqs[r.req] = _Req(r.arrival, r.priority, r.prompt_len)
                    q.ttft = r.ttft
                    if r.computed or r.ttft is not None:
                        q.first_sched = ev.t  # already scheduled before we saw it
        elif getattr(ev, "type", None) == "bye":
            self.saw_bye = True

    def reset(self) -> None:
        self.rows.clear()
        self.itl.clear()
        self.reqs.clear()
        self.recomputing.clear()
        self.last_step = None

    def _step(self, ev: StepEvent) -> None:
        if self.last_step is not None and ev.step <= self.last_step:
            self.reset()  # a seek backwards or an engine restart: start the window afresh
        self.last_step = ev.step
        t = ev.t
        prefill = decode = 0
        recomputed = 0
        reqs = self.reqs
        recomputing = self.recomputing
        for b in ev.batch:
            if b.kind == PREFILL:
                prefill += b.tokens
                r = reqs.get(b.req)
                if r is not None and r.first_sched is None:
                    r.first_sched = t
                if recomputing and b.req in recomputing:
                    recomputed += b.tokens
            else:
                decode += b.tokens
        if recomputing:
            recomputing.difference_update(ev.sampled)
        pk = pp = 0
        for p in ev.preemptions:
            if p.reason == BLOCKED_KV:
                pk += 1
            else:
                pp += 1
            if p.mode == "recompute":
                recomputing.add(p.req)
        for f in ev.first_tokens:
            r = reqs.get(f.req)
            if r is not None and r.ttft is None:
                r.ttft = f.ttft
        for f in ev.finished:
            r = reqs.get(f.req)
            if r is not None:
                r.done = True
                if r.ttft is None:
                    r.ttft = f.ttft
        a = ev.admission
        if a.verdict == VERDICT_BLOCKED:
            adm = _BLOCK_CODE.get(a.reason, ADM_KV)
        else:
            adm = ADM_ADMITTED if a.verdict == VERDICT_ADMITTED else ADM_IDLE
        kv = ev.kv
        self.rows.append((ev.step, t, ev.dur, prefill, decode, ev.budget, ev.padding, len(ev.running),
                          len(ev.waiting) + len(ev.preempted) + len(ev.swapped), adm, pk, pp, kv.used, kv.total,
                          recomputed, len(ev.batch)))
        step = ev.step
        for s in ev.itl:
            self.itl.append((step, s.gap))
        if self.window is not None:
            oldest = self.rows[0][0]
            while self.itl and self.itl[0][0] < oldest:
                self.itl.popleft()
            if len(reqs) > 4 * self.window:  # forget requests that finished before the window
                for k in [k for k, r in reqs.items() if r.done]:
                    del reqs[k]

    def columns(self) -> dict[str, np.ndarray]:
        import numpy as np
        if not self.rows:
            return {c: np.zeros(0) for c in COLUMNS}
        arr = np.array(self.rows, dtype=float)
        return {c: arr[:, i] for i, c in enumerate(COLUMNS)}


class Signals(msgspec.Struct, kw_only=True):
    """What the verdict rules read; every fraction is over busy steps (steps that ran a batch)."""

    steps: int
    busy_steps: int
    span_s: float
    busy_time_frac: float
    requests: int
    finished: int
    blocked_kv: float
    blocked_budget: float
    blocked_seqs: float
    blocked_static: float
    queued_frac: float  # steps with anyone waiting
    mean_queued: float
    preemptions_kv: int
    preemptions_priority: int
    preempted_per_request: float
    recompute_frac: float  # computed tokens that were recomputed after a preemption
    kv_use_p90: float
    kv_use_mean: float
    running_mean: float
    running_max: int
    tokens_fill: float  # mean tokens per busy step / budget
    padding_frac: float
    step_dur_p50: float | None
    fixed_share: float | None  # fixed share of a full step's time (None: cannot tell)
    ttft_p50: float | None
    ttft_p99: float | None
    queue_p50: float | None
    queue_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    itl_tail_prefill_share: float | None  # of the ITL samples above p99, those whose gap spans a prefill
    itl_p99_prefill: float | None  # ITL p99 of gaps that span a prefill
    itl_p50_clean: float | None  # ITL p50 of gaps that span none
    prefill_step_dur_p99: float | None
    decode_step_dur_p99: float | None
    overtaken_frac: float
    wait_ratio: float | None  # queue p99 of overtaken requests / queue p99 of the rest
    priorities: int  # distinct priorities among the requests


def _frac(mask: np.ndarray, of: np.ndarray) -> float:
    n = int(of.sum())
    return float((mask & of).sum()) / n if n else 0.0


def _pct(a: np.ndarray, q: float) -> float | None:
    return percentile(a, q) if len(a) else None


def _fixed_share(tokens: np.ndarray, dur: np.ndarray, budget: float) -> float | None:
    """Share of a full step's time that does not grow with its tokens, from a line fitted to the
    upper half of the step sizes (near the budget, where another token's cost is what matters)."""
    import numpy as np
    for lo in (budget / 2, 0.0):
        m = tokens >= lo
        t, d = tokens[m], dur[m]
        if len(t) >= 8 and t.std() > 0.05 * max(1.0, t.mean()):
            b, a = np.polyfit(t, d, 1)
            full = a + b * budget
            if full <= 0:
                return None
            return float(min(1.0, max(0.0, a / full)))
    return None


def _overtaken(reqs: list[_Req]) -> tuple[np.ndarray, np.ndarray]:
    """Per scheduled request (arrival order): was it passed by a later arrival, and its queue time."""
    import numpy as np
    sched = sorted((r for r in reqs if r.first_sched is not None), key=lambda r: r.arrival)
    if not sched:
        return np.zeros(0, dtype=bool), np.zeros(0)
    first = np.array([r.first_sched for r in sched])
    arrival = np.array([r.arrival for r in sched])
    later_min = np.minimum.accumulate(first[::-1])[::-1]  # earliest start among itself and later arrivals
    passed = np.zeros(len(sched), dtype=bool)
    passed[:-1] = later_min[1:] < first[:-1] - 1e-12
    return passed, np.maximum(0.0, first - arrival)


def measure(log: StepLog) -> Signals:
    import numpy as np
    c = log.columns()
    n = len(c["step"])
    entries = c["entries"]
    busy = entries > 0
    tokens = c["prefill"] + c["decode"]
    t0 = c["t"][0] if n else 0.0
    end = c["t"] + c["dur"]
    span = float(end.max() - t0) if n else 0.0
    adm = c["admission"]
    total_tok = float(tokens.sum())
    budget = float(np.median(c["budget"][busy])) if busy.any() else 0.0
    max_seqs = max(1, int(log.config.get("max_num_seqs") or 1))
    kv_total = np.maximum(c["kv_total"], 1)
    kv_use = c["kv_used"] / kv_total
    reqs = list(log.reqs.values())
    passed, queue = _overtaken(reqs)
    ttft = np.array([r.ttft for r in reqs if r.ttft is not None])
    step_p50 = _pct(c["dur"][busy], 50)
    # ITL: does each gap span a step that ran prefill tokens?
    itl = np.array(log.itl, dtype=float).reshape(-1, 2)
    gaps = itl[:, 1]
    tail_share = itl_p99_prefill = itl_p50_clean = None
    if len(gaps) and n:
        idx = np.searchsorted(c["step"], itl[:, 0])
        idx = np.clip(idx, 0, n - 1)
        cum = np.concatenate([[0.0], np.cumsum(c["prefill"])])
        j = np.searchsorted(end, end[idx] - gaps + 1e-9, side="left")
        spans_prefill = (cum[idx + 1] - cum[np.minimum(j, idx)]) > 0
        cut = percentile(gaps, 99)
        tail = gaps >= cut
        tail_share = float(spans_prefill[tail].mean()) if tail.any() else None
        itl_p99_prefill = _pct(gaps[spans_prefill], 99)
        itl_p50_clean = _pct(gaps[~spans_prefill], 50)
    prefill_steps = busy & (c["prefill"] > 0)
    decode_steps = busy & (c["prefill"] == 0)
    rest_p99 = _pct(queue[~passed], 99) if len(queue) else None
    wait_ratio = None
    if passed.any() and rest_p99 is not None:
        wait_ratio = float(percentile(queue[passed], 99) / max(rest_p99, step_p50 or 1e-6, 1e-6))
    return Signals(
        steps=n, busy_steps=int(busy.sum()), span_s=span,
        busy_time_frac=float(c["dur"][busy].sum() / span) if span > 0 else 0.0,
        requests=len(reqs), finished=sum(r.done for r in reqs),
        blocked_kv=_frac(adm == ADM_KV, busy), blocked_budget=_frac(adm == ADM_BUDGET, busy),
        blocked_seqs=_frac(adm == ADM_SEQS, busy), blocked_static=_frac(adm == ADM_STATIC, busy),
        queued_frac=_frac(c["queued"] > 0, busy), mean_queued=float(c["queued"][busy].mean()) if busy.any() else 0.0,
        preemptions_kv=int(c["preempt_kv"].sum()), preemptions_priority=int(c["preempt_prio"].sum()),
        preempted_per_request=float(c["preempt_kv"].sum()) / max(1, len(reqs)),
        recompute_frac=float(c["recomputed"].sum()) / total_tok if total_tok else 0.0,
        kv_use_p90=_pct(kv_use[busy], 90) or 0.0, kv_use_mean=float(kv_use[busy].mean()) if busy.any() else 0.0,
        running_mean=float(c["running"][busy].mean()) / max_seqs if busy.any() else 0.0,
        running_max=int(c["running"].max()) if n else 0,
        tokens_fill=float(tokens[busy].mean()) / budget if budget else 0.0,
        padding_frac=float(c["padding"].sum()) / (total_tok + float(c["padding"].sum())) if total_tok else 0.0,
        step_dur_p50=step_p50,
        fixed_share=_fixed_share(tokens[busy], c["dur"][busy], budget) if budget else None,
        ttft_p50=_pct(ttft, 50), ttft_p99=_pct(ttft, 99),
        queue_p50=_pct(queue, 50), queue_p99=_pct(queue, 99),
        itl_p50=_pct(gaps, 50), itl_p99=_pct(gaps, 99),
        itl_tail_prefill_share=tail_share, itl_p99_prefill=itl_p99_prefill, itl_p50_clean=itl_p50_clean,
        prefill_step_dur_p99=_pct(c["dur"][prefill_steps], 99),
        decode_step_dur_p99=_pct(c["dur"][decode_steps], 99),
        overtaken_frac=float(passed.mean()) if len(passed) else 0.0,
        wait_ratio=wait_ratio,
        priorities=len({r.priority for r in reqs}),
    )
