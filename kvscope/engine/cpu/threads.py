"""The CPU thread count, chosen online from measured step times, so a shared machine does not collapse.

With every core busy in torch's threads, one competing CPU-bound process stalls each parallel
region on the thread it preempts: the tiny model's chunked bench measured 2,005 tok/s
alone and 309 beside a busy loop with 2 threads, against 1,360 with one thread. Which count is
better depends on the load, which changes while the engine runs, so when --cpu-threads is left
out the runner keeps measuring:

- it runs on the best count so far (every core at first) and, every `gap` steps, probes each other
  candidate in `probe_pairs` pairs of adjacent steps, one on the best count and the next on the
  candidate: two adjacent steps serve nearly the same batch, under nearly the same load;
- each step's time is set against its work, priced by the sim's cost model (the same step at any
  thread count costs the same work, whatever its mix of prefill and decode), and the probe compares
  the candidate's total seconds per unit of work with the best count's over its pairs. Totals, not a
  median of pairs: what a competitor costs a parallel step is mostly the rare step whose thread it
  descheduled for a whole time slice (a tiny-model step of 15 ms took 108 ms), which a median
  would drop as an outlier, and which is the whole loss;
- a candidate clearly faster (by `switch_margin`) takes over, and the next probe (of the count it
  replaced) waits a few gaps; one that loses doubles the gap, up to `max_gap`. A clear loser
  (`CLEAR_RATIO`) is decided after two pairs, and so is a clear winner where a competitor is seen
  (below), so a collapse is left within a dozen steps and a clear loser costs two steps; on a
  steady machine probing costs a few percent at most. The first probe comes a few steps in, so a
  machine that is already shared is found out at once.

Other processes' load, from the kernel's accounting (cpu_load.py), says where to start (every core,
or fewer where other processes keep cores busy while the model loads) and when to look again: a
change of half a core or more since the count was settled brings the next probe forward, so a
competitor that arrives late is met within a few dozen steps rather than at the next doubled gap.
Beside a competitor, once fewer threads have won, every core is not asked again until the load
changes; on a quiet machine two lucky pairs decide nothing (a clear win needs the competitor).

An explicit --cpu-threads N (N > 1) is a ceiling, not a promise to collapse: the same tuner runs
between N and one thread, but only while the kernel's accounting shows a competitor (half a core or
more); on a quiet machine, or where there is no reading, the engine runs on exactly N, and when
the competitor leaves it goes back to N at once. A fixed 2 threads beside one
busy loop measured 637-733 tok/s against 1,092-2,024 on one thread; the passive wait alone recovered part
of it. KVSCOPE_FIXED_THREADS=1 keeps the old meaning (exactly N, always), for measurements of N itself.

Idle torch threads also spin only briefly before they sleep (GOMP_SPINCOUNT=20000, set before torch is
imported unless the user set it, kvscope/openmp_wait.py: by the command line's package before any command runs, and by the
model backend for library use), so a waiting thread does not take a core from the competitor.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Callable, Iterator

FIXED_THREADS_ENV = "KVSCOPE_FIXED_THREADS"  # set (not 0): an explicit --cpu-threads is exactly that, always
CLEAR_RATIO = 1.5  # after two pairs, a candidate this much slower (or faster) ends its probe: the case is clear
AFTER_SWITCH = 4  # after a switch the next probe waits this many first gaps
LOAD_EVERY = 16  # steps between readings of other processes' load (cpu_load.py)
LOAD_CHANGE = 0.5  # cores: a change of other processes' load this large brings the next probe forward


def explicit_count_tunes() -> bool:
    """Whether an explicit --cpu-threads N may drop to fewer beside a competitor (the default; see above)."""
    return os.environ.get(FIXED_THREADS_ENV, "") in ("", "0")


class ThreadTuner:
    """Chooses among candidate thread counts from (seconds, work) of each step; set_threads applies one."""

    def __init__(self, candidates: list[int], set_threads: Callable[[int], None], *, probe_pairs: int = 4,
                 first_gap: int = 8, max_gap: int = 1024, switch_margin: float = 1.05, warmup_steps: int = 2,
                 load=None, only_beside_competitor: bool = False) -> None:
        """load: an OtherLoad (cpu_load.py), or None: where to start, and when the machine changed.
        only_beside_competitor: an explicit count (the most candidates) held unless load reads a competitor."""
        self.candidates = sorted(set(candidates), reverse=True)  # most threads first: today's default
        self.load = load
        self.only_beside_competitor = only_beside_competitor
        self._load_at_choice: float | None = None  # other processes' cores when the count was last settled
        self._last_load: float | None = None  # the latest reading
        self.set_threads = set_threads
        self.probe_pairs = probe_pairs
        self.first_gap = first_gap
        self.max_gap = max_gap
        self.switch_margin = switch_margin
        self.best = self.candidates[0]
        self.gap = first_gap
        self._warmup = warmup_steps  # the first steps pay one-off costs (allocations, kernel choice)
        self._since_probe = 0
        self._probe: list[int] = []  # candidates still to probe in this probe cycle
        self._probing: int | None = None
        self._on_candidate = False  # this probe step runs on the candidate (else on the best count)
        # this probe's totals, seconds and priced work, on the best count and on the candidate
        self._best_s = self._best_w = self._cand_s = self._cand_w = 0.0
        self._pairs = 0
        self._ratios: dict[int, float] = {}  # this probe cycle's ratio per candidate: its seconds per work over the best's
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

    @property
    def _starting(self) -> bool:
        """No reading of other processes' load yet, and the first probe not begun: the starting count is open
        (read every step until a window is long enough: a model loaded from a cache leaves none)."""
        return self._load_at_choice is None and self.switches == 0 and self._step < self.first_gap

    def _read_load(self) -> None:
        """Other processes' load: its first reading picks the starting count; later, a change of
        LOAD_CHANGE cores or more since the count was settled brings the next probe forward."""
        busy = self.load.busy_cores()
        if busy is None:
            return
        self._last_load = busy
        if self._starting:  # the window since the engine started: the model's load, or its first steps
            free = max(1, self.candidates[0] - round(busy))
            start = max((c for c in self.candidates if c <= free), default=self.candidates[-1])
            if start != self.best:
                self.best = start
                self.history.append((self._step, start))
                self._use(start)
        elif self._load_at_choice is not None and abs(busy - self._load_at_choice) >= LOAD_CHANGE:
            self._since_probe = self.gap = self.first_gap  # the machine changed: look again now
        elif self._load_at_choice is not None:
            return
        self._load_at_choice = busy

    def before_step(self) -> None:
        """Pick this step's thread count."""
        if not self.active:
            return
        if self.load is not None and self._probing is None and (self._starting or self._step % LOAD_EVERY == 0):
            self._read_load()
        if self.only_beside_competitor and not (self._last_load is not None and self._last_load >= LOAD_CHANGE):
            self._hold_the_explicit_count()
            return
        if self._probing is None and self._since_probe >= self.gap:
            self._probe = [c for c in self.candidates if c != self.best]
            self._ratios = {}
            self._start_next_probe()
        if self._probing is not None:
            self._use(self._probing if self._on_candidate else self.best)

    def _hold_the_explicit_count(self) -> None:
        """No competitor in sight: the count the user asked for, and no probe (one under way is dropped)."""
        self._probing = None
        if self.best != self.candidates[0]:
            self.best = self.candidates[0]
            self.history.append((self._step, self.best))
            self._since_probe, self.gap = 0, self.first_gap
        self._use(self.best)

    def _start_next_probe(self) -> None:
        self._probing = self._probe.pop(0)
        self._on_candidate, self._pairs = False, 0
        self._best_s = self._best_w = self._cand_s = self._cand_w = 0.0

    def after_step(self, seconds: float, work: float) -> None:
        """The step just run took `seconds` for `work` (cost-model seconds at nominal peaks)."""
        self._step += 1
        if self._warmup > 0 or work <= 0 or seconds <= 0:
            self._warmup -= 1
            return
        if self._probing is None:
            self._since_probe += 1
            return
        if not self._on_candidate:
            self._best_s += seconds
            self._best_w += work
            self._on_candidate = True
            return
        self._cand_s += seconds
        self._cand_w += work
        self._on_candidate = False
        self._pairs += 1
        ratio = (self._cand_s / self._cand_w) / (self._best_s / self._best_w)
        # a clear loser stops at once; a clear winner only where a competitor is seen, or cannot be looked for
        # (on a quiet machine two pairs of ~10 ms steps can look 1.5x apart by chance)
        clear = self._pairs >= 2 and (ratio >= CLEAR_RATIO or (ratio <= 1 / CLEAR_RATIO and self._competitor_seen))
        if self._pairs < self.probe_pairs and not clear:  # a clear case is not run longer
            return
        self._ratios[self._probing] = ratio
        if self._probe:
            self._start_next_probe()
            return
        self._finish_round()

    def _finish_round(self) -> None:
        winner, ratio = min(self._ratios.items(), key=lambda kv: kv[1])
        self._probing = None
        self._since_probe = 0
        self._load_at_choice = None  # the next reading of other processes' load is the settled count's
        if ratio * self.switch_margin < 1.0:
            self.best = winner
            self.gap = self.first_gap * AFTER_SWITCH  # the count it left just lost: not asked again at once
            self.switches += 1
            self.history.append((self._step, winner))
        elif self._competitor_seen and self.best < self.candidates[0]:
            # fewer threads just beat every core beside a competitor: no use asking again while the load stays
            # as it is; a change of LOAD_CHANGE cores brings the next probe forward (_read_load)
            self.gap = self.max_gap
        else:
            self.gap = min(self.gap * 2, self.max_gap)
        self._use(self.best)

    @property
    def _competitor_seen(self) -> bool:
        """Other processes keep half a core or more busy (or there is no reading: the probes decide alone)."""
        return self._last_load is None or self._last_load >= LOAD_CHANGE


def thread_candidates(cores: int) -> list[int]:
    """One thread and every core (the two ends worth measuring); one candidate on a 1-core machine."""
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
