"""The CPU thread count, chosen online from measured step times, so a shared machine does not collapse.

With every core busy in torch's threads, one competing CPU-bound process stalls each parallel
region on the thread it preempts: issue 29 measured the tiny model's chunked bench at 2,005 tok/s
alone and 309 beside a busy loop with 2 threads, against 1,360 with one thread. Which count is
better depends on the load, which changes while the engine runs, so when --cpu-threads is left
out the runner keeps measuring:

- it runs on the best count so far (every core at first) and, every `gap` steps, a short probe
  of `probe_steps` steps on each other candidate;
- each step's time is set against its work, priced by the sim's cost model (the same step at any
  thread count costs the same work, whatever its mix of prefill and decode), so probe and
  baseline windows of different batches compare;
- a probe that is clearly faster (by `switch_margin`) takes over and the gap restarts short; a
  probe that loses doubles the gap, up to `max_gap`, so on a steady machine probing costs a few
  percent at most, and a competitor that arrives later is still noticed.

Idle torch threads also sleep instead of spinning (OMP_WAIT_POLICY=PASSIVE, set before torch is
imported unless the user set it), so a waiting thread does not take a core from the competitor.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator

WAIT_POLICY_VAR = "OMP_WAIT_POLICY"


def prefer_passive_wait() -> None:
    """Make OpenMP's idle threads sleep rather than spin; effective only before torch loads its OpenMP."""
    if "torch" not in sys.modules:
        os.environ.setdefault(WAIT_POLICY_VAR, "PASSIVE")


class ThreadTuner:
    """Chooses among candidate thread counts from (seconds, work) of each step; set_threads applies one."""

    def __init__(self, candidates: list[int], set_threads: Callable[[int], None], *, probe_steps: int = 4,
                 first_gap: int = 32, max_gap: int = 1024, switch_margin: float = 1.05, warmup_steps: int = 2) -> None:
        self.candidates = sorted(set(candidates), reverse=True)  # most threads first: today's default
        self.set_threads = set_threads
        self.probe_steps = probe_steps
        self.first_gap = first_gap
        self.max_gap = max_gap
        self.switch_margin = switch_margin
        self.best = self.candidates[0]
        self.gap = first_gap
        self._warmup = warmup_steps  # the first steps pay one-off costs (allocations, kernel choice)
        self._since_probe = 0
        self._probe: list[int] = []  # candidates still to probe in this round
        self._probing: int | None = None
        self._probe_steps: list[tuple[float, float]] = []
        self._windows: dict[int, list[tuple[float, float]]] = {}  # this round's probe steps per candidate
        self._recent: deque[tuple[float, float]] = deque(maxlen=4 * probe_steps)  # the best count's own steps
        self.current = self.best
        self.switches = 0
        self.history: list[tuple[int, int]] = []  # (step, threads) at each change of the chosen count
        self._step = 0
        set_threads(self.best)

    @property
    def active(self) -> bool:
        return len(self.candidates) > 1

    def _use(self, n: int) -> None:
        if n != self.current:
            self.set_threads(n)
            self.current = n

    def before_step(self) -> None:
        """Pick this step's thread count."""
        if not self.active or self._probing is not None:
            return
        if self._since_probe >= self.gap and len(self._recent) >= self.probe_steps:
            self._probe = [c for c in self.candidates if c != self.best]
            self._windows = {}
            self._start_next_probe()

    def _start_next_probe(self) -> None:
        self._probing = self._probe.pop(0)
        self._probe_steps = []
        self._use(self._probing)

    def after_step(self, seconds: float, work: float) -> None:
        """The step just run took `seconds` for `work` (cost-model seconds at nominal peaks)."""
        self._step += 1
        if self._warmup > 0 or work <= 0 or seconds <= 0:
            self._warmup -= 1
            return
        if self._probing is None:
            self._recent.append((seconds, work))
            self._since_probe += 1
            return
        self._probe_steps.append((seconds, work))
        if len(self._probe_steps) < self.probe_steps:
            return
        self._windows[self._probing] = self._probe_steps
        if self._probe:
            self._start_next_probe()
            return
        self._finish_round()

    def _finish_round(self) -> None:
        baseline = _rate(list(self._recent)[-self.probe_steps * 2:])
        winner, rate = max(((c, _rate(w)) for c, w in self._windows.items()), key=lambda kv: kv[1])
        self._probing = None
        self._since_probe = 0
        if rate > baseline * self.switch_margin:
            self.best = winner
            self.gap = self.first_gap
            self.switches += 1
            self.history.append((self._step, winner))
            self._recent.clear()
            self._recent.extend(self._windows[winner])  # the new best's own steps seed its baseline
        else:
            self.gap = min(self.gap * 2, self.max_gap)
        self._use(self.best)


def _rate(steps: list[tuple[float, float]]) -> float:
    """Work done per second over a window of (seconds, work) steps."""
    seconds = sum(s for s, _ in steps)
    return sum(w for _, w in steps) / seconds if seconds > 0 else 0.0


def thread_candidates(cores: int) -> list[int]:
    """One thread and every core (the two ends issue 29 measured); one candidate on a 1-core machine."""
    return sorted({1, max(1, cores)})


class StepTuner:
    """A ThreadTuner fed by the runner: each step is timed on the wall clock and priced by the cost model."""

    def __init__(self, tuner: ThreadTuner, price: Callable) -> None:
        self.tuner = tuner
        self.price = price  # SchedulerOutput -> work (seconds at the cost model's nominal peaks)

    @contextmanager
    def step(self, out) -> Iterator[None]:
        self.tuner.before_step()
        t0 = time.perf_counter()
        yield
        self.tuner.after_step(time.perf_counter() - t0, self.price(out))


def cost_model_price(hf_config, dtype_name: str) -> Callable:
    """Prices a step by the sim's roofline at the catalog CPU's nominal peaks: only relative sizes matter."""
    from kvscope.engine.sim.catalog import CATALOG_DTYPES, GPUS, shape_of_hf_config
    from kvscope.engine.sim.cost import CostModel, Efficiency
    from kvscope.engine.sim.runner import SimRunner

    shape = shape_of_hf_config(hf_config, CATALOG_DTYPES.get(dtype_name, "fp32"))
    cost = CostModel(GPUS["cpu"], shape, efficiency=Efficiency(eff_bw=1.0, eff_flops=1.0, overhead_s=0.0))

    def price(out) -> float:
        t = cost.terms(SimRunner.shape(out))
        return max(t.linear_comp + t.attn_comp, t.weight_mem + t.kv_mem)

    return price
