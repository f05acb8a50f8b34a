"""Percentiles: the one definition kvscope uses, and a fixed-memory estimator of it.

The definition (docs/QUANTILES.md): the q-quantile of n values is the nearest-rank
value, the one at 1-based rank ``ceil(q * n)`` (at least 1) in ascending order;
p99 is q = 0.99. ``percentile`` computes it exactly from a list. ``QuantileSketch``
estimates it for a stream in fixed memory: log-spaced buckets of ratio
``gamma = (1 + a) / (1 - a)`` (the DDSketch scheme, Masson et al., VLDB 2019), where
a bucket answers ``2 * gamma**k / (gamma + 1)``, within a relative ``a`` of every
value in it, so an estimate is within ``a`` (0.5% by default) of the exact
nearest-rank value. The smallest and largest values are kept exactly.

Leaf module: standard library only, so the TUI, the engine and the traces can all
use it.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence

DEFAULT_REL_ERR = 0.005
MIN_VALUE = 1e-7  # 100 ns; smaller values (0 included) are answered as this, clamped to the min seen
MAX_VALUE = 1e5  # about 28 h; larger values share the top bucket (answered as at most the max seen)
STANDARD = (0.5, 0.9, 0.99)  # the p50 / p90 / p99 kvscope shows


def nearest_rank(q: float, n: int) -> int:
    """1-based rank of the q-quantile (q in [0, 1]) among n values: ceil(q * n), clamped to [1, n]."""
    # round() first so that 0.07 * 100 = 7.000000000000001 is rank 7, not 8.
    return min(n, max(1, math.ceil(round(q * n, 9))))


def percentile(values: Iterable[float], p: float) -> float | None:
    """Exact nearest-rank percentile, p in [0, 100]; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[nearest_rank(p / 100.0, len(ordered)) - 1]


class QuantileSketch:
    """Nearest-rank quantiles of a stream within ``rel_err``, in fixed memory.

    ``add`` is O(1); memory is one array of bucket counts sized by the value range
    (about 2,800 buckets for 100 ns .. 100,000 s at 0.5%), whatever the count.
    NaN is ignored; values at or below ``MIN_VALUE`` share bucket 0.
    """

    __slots__ = ("rel_err", "n", "total", "vmin", "vmax", "_counts", "_inv_log_gamma", "_offset", "_top",
                 "_gamma", "_lo", "_hi")

    def __init__(self, rel_err: float = DEFAULT_REL_ERR, lo: float = MIN_VALUE, hi: float = MAX_VALUE) -> None:
        if not 0.0 < rel_err < 0.5 or not 0.0 < lo < hi:
            raise ValueError("need 0 < rel_err < 0.5 and 0 < lo < hi")
        self.rel_err = rel_err
        self._gamma = (1.0 + rel_err) / (1.0 - rel_err)
        self._inv_log_gamma = 1.0 / math.log(self._gamma)
        self._lo = lo
        self._hi = hi
        self._offset = math.ceil(math.log(lo) * self._inv_log_gamma)  # bucket k covers (gamma^(k-1), gamma^k]
        self._top = math.ceil(math.log(hi) * self._inv_log_gamma) - self._offset
        self._counts = array("q", bytes(8 * (self._top + 1)))
        self.n = 0
        self.total = 0.0
        self.vmin = math.inf
        self.vmax = -math.inf

    # -- building -------------------------------------------------------------------
    def bucket(self, x: float) -> int:
        if x <= self._lo:
            return 0
        if x >= self._hi:
            return self._top
        return min(self._top, max(0, math.ceil(math.log(x) * self._inv_log_gamma) - self._offset))

    def add(self, x: float) -> None:
        if x != x:  # NaN
            return
        self.n += 1
        self.total += x
        if x < self.vmin:
            self.vmin = x
        if x > self.vmax:
            self.vmax = x
        if x <= self._lo:
            i = 0
        elif x >= self._hi:
            i = self._top
        else:
            i = math.ceil(math.log(x) * self._inv_log_gamma) - self._offset
        self._counts[i] += 1

    def extend(self, xs: Iterable[float]) -> None:
        for x in xs:
            self.add(x)

    def clear(self) -> None:
        self._counts = array("q", bytes(8 * (self._top + 1)))
        self.n = 0
        self.total = 0.0
        self.vmin = math.inf
        self.vmax = -math.inf

    def copy(self) -> "QuantileSketch":
        other = QuantileSketch.__new__(type(self))
        for name in QuantileSketch.__slots__:
            setattr(other, name, getattr(self, name))
        other._counts = array("q", self._counts)
        return other

    def packed(self) -> tuple:
        """A compact copy of the state (only the occupied bucket range) for ``unpack``."""
        if self.n == 0:
            return (0, 0.0, math.inf, -math.inf, 0, array("q"))
        a, b = self.bucket(self.vmin), self.bucket(self.vmax)
        return (self.n, self.total, self.vmin, self.vmax, a, self._counts[a:b + 1])

    def unpack(self, packed: tuple) -> None:
        """Replace this sketch's samples with a ``packed()`` state of one with the same parameters."""
        n, total, vmin, vmax, a, part = packed
        self.clear()
        self._counts[a:a + len(part)] = part
        self.n, self.total, self.vmin, self.vmax = n, total, vmin, vmax

    def merge(self, other: "QuantileSketch") -> None:
        """Add another sketch's samples (same rel_err and range)."""
        if (other.rel_err, other._lo, other._hi) != (self.rel_err, self._lo, self._hi):
            raise ValueError("sketches with different parameters do not merge")
        for i, c in enumerate(other._counts):
            if c:
                self._counts[i] += c
        self.n += other.n
        self.total += other.total
        self.vmin = min(self.vmin, other.vmin)
        self.vmax = max(self.vmax, other.vmax)

    # -- reading --------------------------------------------------------------------
    def value(self, i: int) -> float:
        """What bucket ``i`` answers, before clamping to the min/max seen."""
        if i == 0:
            return self._lo
        return 2.0 * self._gamma ** (i + self._offset) / (self._gamma + 1.0)

    def buckets(self) -> Iterable[tuple[float, int]]:
        """(answer value, count) of every non-empty bucket, ascending."""
        if self.n == 0:
            return
        counts = self._counts
        for i in range(self.bucket(self.vmin), self.bucket(self.vmax) + 1):
            c = counts[i]
            if c:
                yield self.value(i), c

    def quantiles(self, qs: Sequence[float]) -> list[float | None]:
        """Nearest-rank estimates for each q in [0, 1], in one pass over the buckets."""
        if self.n == 0:
            return [None] * len(qs)
        out: list[float | None] = [None] * len(qs)
        order = sorted(range(len(qs)), key=lambda j: qs[j])
        ranks = [nearest_rank(qs[j], self.n) for j in order]
        k = 0
        acc = 0
        counts = self._counts
        for i in range(self.bucket(self.vmin), self.bucket(self.vmax) + 1):
            acc += counts[i]
            while k < len(ranks) and acc >= ranks[k]:
                r = ranks[k]
                if r == 1:
                    v = self.vmin
                elif r == self.n:
                    v = self.vmax
                else:
                    v = min(max(self.value(i), self.vmin), self.vmax)
                out[order[k]] = v
                k += 1
            if k == len(ranks):
                break
        return out

    def quantile(self, q: float) -> float | None:
        return self.quantiles((q,))[0]

    def percentile(self, p: float) -> float | None:
        """Like ``percentile(values, p)``: p in [0, 100]."""
        return self.quantiles((p / 100.0,))[0]

    def percentiles(self) -> tuple[float | None, float | None, float | None]:
        """(p50, p90, p99)."""
        a, b, c = self.quantiles(STANDARD)
        return a, b, c

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None
