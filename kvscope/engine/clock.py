"""The engine's clock. Wall time for the model backend, virtual time for the sim backend.

Both have the same three calls, used by the engine (now) and the serve loop (sleep_until):
- now(): seconds since the engine started;
- advance(dt): time passes by dt (virtual: the cost of a step; wall: nothing to do, it passes anyway);
- sleep_until(t): wait for t (wall: sleep; virtual: jump there at once).
"""

from __future__ import annotations

import time


class WallClock:
    virtual = False
    jumps = False  # idle waits must be polled in small slices (control requests may arrive)

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def advance(self, dt: float) -> None:
        pass

    def sleep_until(self, t: float) -> None:
        wait = t - self.now()
        if wait > 0:
            time.sleep(wait)


class VirtualClock:
    """Time moves only when told to. With pace=P, virtual time is also held to at most P x wall time,
    so a live dashboard sees the simulated GPU at a watchable speed (pace=1: real time)."""

    virtual = True

    def __init__(self, pace: float | None = None) -> None:
        if pace is not None and pace <= 0:
            raise ValueError(f"pace must be > 0, got {pace!r}")
        self.pace = pace
        self.t = 0.0
        self._wall0 = time.perf_counter()

    @property
    def jumps(self) -> bool:
        return self.pace is None  # an unpaced clock jumps idle gaps in one go

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError(f"time cannot go back (dt={dt!r})")
        self.t += dt
        self._keep_pace()

    def sleep_until(self, t: float) -> None:
        if t > self.t:
            self.t = t
        self._keep_pace()

    def _keep_pace(self) -> None:
        if self.pace is not None:
            ahead = self.t / self.pace - (time.perf_counter() - self._wall0)
            if ahead > 0:
                time.sleep(ahead)
