"""The latency histograms the TUI draws: exact-enough figures, coarse picture.

The figures (p50/p90/p99) come from ``kvscope.quantiles.QuantileSketch``, the one
nearest-rank estimator (within 0.5%). The picture bins the same samples coarsely,
``per_decade`` buckets to a decade between ``lo`` and ``hi``, which is all a
terminal row can show.
"""

from __future__ import annotations

import math

from kvscope.quantiles import QuantileSketch


class LogHistogram(QuantileSketch):
    """A ``QuantileSketch`` plus coarse bucket counts for drawing.

    Coarse bucket 0 holds everything below ``lo`` and the last one everything at
    or above ``hi``; the ones between are ``per_decade`` to a decade. They are
    derived from the sketch's fine buckets when drawn, so ``add`` costs one sketch
    update and memory stays fixed.
    """

    __slots__ = ("lo", "hi", "per_decade", "_log_lo", "_inner", "_coarse", "_coarse_n")

    def __init__(self, lo: float = 1e-4, hi: float = 100.0, per_decade: int = 6) -> None:
        super().__init__()
        self.lo = lo
        self.hi = hi
        self.per_decade = per_decade
        self._log_lo = math.log10(lo)
        self._inner = int(round(math.log10(hi / lo) * per_decade))
        self._coarse: list[int] = [0] * (self._inner + 2)
        self._coarse_n = 0

    def copy(self) -> "LogHistogram":
        other = super().copy()
        for name in LogHistogram.__slots__:
            setattr(other, name, getattr(self, name))
        other._coarse = list(self._coarse)
        return other

    def clear(self) -> None:
        super().clear()
        self._coarse_n = -1

    @property
    def inner(self) -> int:
        return self._inner

    @property
    def counts(self) -> list[int]:
        """Coarse bucket counts (rebuilt from the fine buckets when samples came in)."""
        if self._coarse_n != self.n:
            coarse = [0] * (self._inner + 2)
            for v, c in self.buckets():
                coarse[self.index(min(max(v, self.vmin), self.vmax))] += c
            self._coarse = coarse
            self._coarse_n = self.n
        return self._coarse

    def index(self, x: float) -> int:
        """The coarse bucket of ``x``."""
        if x < self.lo:
            return 0
        if x >= self.hi:
            return self._inner + 1
        i = int((math.log10(x) - self._log_lo) * self.per_decade) + 1
        return min(max(i, 1), self._inner)

    def edges(self, i: int) -> tuple[float, float]:
        """Lower and upper bound of coarse bucket ``i`` (the outer ones use min/max seen)."""
        if i == 0:
            return (min(self.vmin, self.lo), self.lo)
        if i == self._inner + 1:
            return (self.hi, max(self.vmax, self.hi))
        a = 10 ** (self._log_lo + (i - 1) / self.per_decade)
        b = 10 ** (self._log_lo + i / self.per_decade)
        return (a, b)
