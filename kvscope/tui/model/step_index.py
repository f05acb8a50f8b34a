"""A trace's step index for the replay player, built by one pass over the trace.

Per step: its number, the trace time it ended and whether it preempted or swapped, plus
the TTFT/ITL checkpoints a backward seek restarts from (``latency_seed``). Decoding a
whole trace takes seconds on a large one, so ``kvscope replay`` builds the index on a
background thread (``start``) with a second reader of the trace (``TraceReader.fork``):
the first frame needs only the trace's start. Whatever needs a step not yet indexed
(a seek to the end, say) waits for it (``wait``).

The lists only grow, a batch at a time, ``steps`` before ``step_t``: a reader on the UI
thread that bisects ``step_t`` always finds the step at that index in ``steps``.
"""

from __future__ import annotations

import threading

from kvscope.protocol.events import StepEvent
from kvscope.goodput import Slo, resolve_slo
from kvscope.tui.model.latency_seed import LatencyCheckpoints

BATCH_STEPS = 512  # steps handed over to the UI thread at once


class StepIndex:
    def __init__(self, trace, slo: Slo | None = None) -> None:
        self.steps: list[int] = []
        self.step_t: list[float] = []  # trace time each step ended
        self.preempt_steps: list[int] = []  # steps with a preemption or a swap ('p' jumps to the next)
        self.latency = LatencyCheckpoints(resolve_slo(slo, getattr(getattr(trace, "hello", None), "config", None)))
        self.error: str | None = None  # why a background pass stopped early (the index then ends there)
        self.warnings: list[str] = []  # what the background pass's reader found that the trace's had not
        self._trace = trace
        self._done = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def complete(self) -> bool:
        return self._done.is_set()

    @property
    def started(self) -> bool:
        return self._thread is not None or self.complete

    def build(self) -> None:
        """Index the whole trace on this thread (errors propagate, as from iterating the trace)."""
        with self._lock:
            if self.started:
                return
            self._thread = threading.current_thread()
        try:
            self._run(self._trace)
        finally:
            self._done.set()

    def start(self) -> None:
        """Index on a background thread; a trace that cannot be read twice at once is indexed here."""
        with self._lock:
            if self.started:
                return
            fork = getattr(self._trace, "fork", None)
            reader = fork() if fork is not None else None
            if reader is not None:
                self._thread = threading.Thread(target=self._background, args=(reader,),
                                                name="kvscope-replay-index", daemon=True)
                self._thread.start()
                return
        self.build()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the index is complete (starting it if need be); False on timeout."""
        self.start()
        return self._done.wait(timeout)

    def close(self) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread() and t.is_alive():
            t.join(timeout=2.0)

    # -- the pass -------------------------------------------------------------------
    def _background(self, reader) -> None:
        try:
            self._run(reader)
        except Exception as e:  # a file gone or changed under us: the index ends where it got to
            self.error = f"indexing stopped: {e}"
        finally:
            self.warnings = [w for w in reader.warnings if w not in self._trace.warnings]
            self._done.set()

    def _run(self, trace) -> None:
        steps: list[int] = []
        ends: list[float] = []
        pre: list[int] = []
        observe = self.latency.observe
        stop = self._stop
        for ev in trace:
            observe(ev)
            if type(ev) is StepEvent:
                steps.append(ev.step)
                ends.append(ev.t + ev.dur)
                if ev.preemptions or ev.swaps:  # swaps in count too: 'p' finds them
                    pre.append(ev.step)
                if len(steps) >= BATCH_STEPS:
                    self._publish(steps, ends, pre)
                    steps, ends, pre = [], [], []
                    if stop.is_set():
                        return
        self._publish(steps, ends, pre)

    def _publish(self, steps: list[int], ends: list[float], pre: list[int]) -> None:
        self.steps.extend(steps)  # first: len(step_t) <= len(steps) at every moment
        self.step_t.extend(ends)
        self.preempt_steps.extend(pre)
