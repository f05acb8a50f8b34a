"""A log-spaced histogram with fixed memory, and percentiles from its bucket counts."""

from __future__ import annotations

import math


class LogHistogram:
    """Counts of samples in log-spaced buckets between ``lo`` and ``hi`` seconds.

    Bucket 0 holds everything below ``lo`` and the last bucket everything at or
    above ``hi``; the ones between are ``per_decade`` to a decade. Memory is fixed
    whatever the number of samples. Percentiles interpolate geometrically inside
    a bucket and are clamped to the smallest and largest sample seen.
    """

    __slots__ = ("lo", "hi", "per_decade", "counts", "n", "vmin", "vmax", "_log_lo")

    def __init__(self, lo: float = 1e-4, hi: float = 100.0, per_decade: int = 6) -> None:
        self.lo = lo
        self.hi = hi
        self.per_decade = per_decade
        inner = int(round(math.log10(hi / lo) * per_decade))
        self.counts = [0] * (inner + 2)
        self.n = 0
        self.vmin = math.inf
        self.vmax = -math.inf
        self._log_lo = math.log10(lo)

    @property
    def inner(self) -> int:
        return len(self.counts) - 2

    def clear(self) -> None:
        for i in range(len(self.counts)):
            self.counts[i] = 0
        self.n = 0
        self.vmin = math.inf
        self.vmax = -math.inf

    def index(self, x: float) -> int:
        if x < self.lo:
            return 0
        if x >= self.hi:
            return len(self.counts) - 1
        i = int((math.log10(x) - self._log_lo) * self.per_decade) + 1
        return min(max(i, 1), len(self.counts) - 2)

    def add(self, x: float) -> None:
        self.counts[self.index(x)] += 1
        self.n += 1
        if x < self.vmin:
            self.vmin = x
        if x > self.vmax:
            self.vmax = x

    def edges(self, i: int) -> tuple[float, float]:
        """Lower and upper bound of bucket ``i`` (the outer ones use min/max seen)."""
        if i == 0:
            return (min(self.vmin, self.lo), self.lo)
        if i == len(self.counts) - 1:
            return (self.hi, max(self.vmax, self.hi))
        a = 10 ** (self._log_lo + (i - 1) / self.per_decade)
        b = 10 ** (self._log_lo + i / self.per_decade)
        return (a, b)

    def quantile(self, q: float) -> float | None:
        if self.n == 0:
            return None
        target = q * self.n
        acc = 0
        for i, c in enumerate(self.counts):
            if c == 0:
                continue
            if acc + c >= target:
                a, b = self.edges(i)
                a = max(a, self.vmin) if a > 0 else self.vmin
                b = min(b, self.vmax)
                if b <= a or a <= 0:
                    v = a if a > 0 else b
                else:
                    frac = (target - acc) / c
                    v = a * (b / a) ** frac
                return min(max(v, self.vmin), self.vmax)
            acc += c
        return self.vmax

    def percentiles(self) -> tuple[float | None, float | None, float | None]:
        return (self.quantile(0.5), self.quantile(0.9), self.quantile(0.99))
