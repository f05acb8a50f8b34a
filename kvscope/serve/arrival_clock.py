"""When a workload's next request is due: the workload's own clock, which stops while the engine is paused.

Two kinds of clock:

* wall (default): the workload's times are engine seconds since the start, minus the time spent
  paused. A presenter who pauses for 20 s comes back to the traffic of the moment they paused,
  not to 20 s of arrivals queued at once. Without a pause the arrival times are exactly
  ``start + item.arrival`` (a bench's and the sim's runs stay what they were).
* steps (``step_s``): the clock advances ``step_s`` seconds per engine step, and in real time
  while the engine idles. The same traffic then loads a fast and a slow machine alike (the demo:
  its queue, its preemptions and its prefix hits come at the same steps on a laptop and on a
  loaded 2-core box), and it stops with the engine, whatever stops it.
"""

from __future__ import annotations


class ArrivalClock:
    def __init__(self, start: float, step_s: float | None = None) -> None:
        self.start = start
        self.step_s = step_s
        self.paused_total = 0.0  # wall: engine seconds spent paused, added to every later arrival
        self._paused_at: float | None = None
        self.t = 0.0  # steps: the workload's seconds
        self._last = start
        self._stepped = False

    @property
    def paused(self) -> bool:
        return self._paused_at is not None

    def set_paused(self, paused: bool, now: float) -> None:
        if paused and self._paused_at is None:
            self._paused_at = now
        elif not paused and self._paused_at is not None:
            self.paused_total += now - self._paused_at
            self._paused_at = None

    def stepped(self) -> None:
        """The engine ran one step since the last tick."""
        self._stepped = True

    def tick(self, now: float) -> None:
        """Advance the step clock to engine time ``now`` (a step's worth, or the idle time since the last tick)."""
        if self.step_s is not None and self._paused_at is None:
            self.t += self.step_s if self._stepped else max(0.0, now - self._last)
        self._stepped = False
        self._last = now

    def due(self, arrival: float, now: float) -> bool:
        if self._paused_at is not None:
            return False
        if self.step_s is not None:
            return arrival <= self.t
        return self.start + self.paused_total + arrival <= now

    def engine_time(self, arrival: float, now: float) -> float:
        """The engine time a due request arrived at (its TTFT counts from it)."""
        if self.step_s is not None:
            return now
        return self.start + self.paused_total + arrival

    def due_time(self, arrival: float, now: float) -> float:
        """The engine time ``arrival`` is due at while the engine idles (exact on the wall clock: a virtual
        clock jumps to it and finds it due)."""
        if self.step_s is not None:
            return now + max(0.0, arrival - self.t)
        return self.start + self.paused_total + arrival

    def wait_s(self, arrival: float, now: float) -> float:
        """Engine seconds until ``arrival`` is due, if nothing else happens (idle: the clock runs in real time)."""
        if self.step_s is not None:
            return arrival - self.t
        return self.start + self.paused_total + arrival - now
