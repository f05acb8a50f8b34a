"""When requests arrive: all at once, a Poisson process, or bursts over a trickle."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from random import Random
from typing import Any, Iterator

from .checks import KindTable, check_fields, check_int, check_num, fail, key

ARRIVAL_FIELDS: KindTable = {
    "all": ((), ()),
    "poisson": (("rate",), ()),
    "burst": (("burst_size", "burst_interval"), ("burst_size_max", "background_rate")),
}
ARRIVAL_NAMES = ("rate", "burst_size", "burst_interval", "burst_size_max", "background_rate")


def check_arrival(kind: Any, vals: dict[str, Any], path: str) -> None:
    check_fields(key(path, "kind"), kind, ARRIVAL_FIELDS, vals, path)
    for k, v in vals.items():
        where = key(path, k)
        if k in ("rate", "burst_interval"):
            check_num(v, where, positive=True)
        elif k == "background_rate":
            check_num(v, where, nonneg=True)
        else:  # burst_size, burst_size_max
            check_int(v, where, lo=1)
    if "burst_size_max" in vals and vals["burst_size_max"] < vals["burst_size"]:
        fail(f"{key(path, 'burst_size_max')}={vals['burst_size_max']} is below "
              f"{key(path, 'burst_size')}={vals['burst_size']}")


@dataclass
class ArrivalSpec:
    """When requests arrive.

    - ``all``: every request at t=0 (offline batch).
    - ``poisson``: a Poisson process of ``rate`` requests/s (first arrival after one gap).
    - ``burst``: ``burst_size`` requests at t = 0, ``burst_interval``, 2*``burst_interval``...;
      with ``burst_size_max`` each burst's size is uniform in [burst_size, burst_size_max];
      ``background_rate`` adds a Poisson stream in between.
    """

    kind: str
    rate: float | None = None
    burst_size: int | None = None
    burst_interval: float | None = None
    burst_size_max: int | None = None
    background_rate: float | None = None

    def __post_init__(self) -> None:
        check_arrival(self.kind, self._set_fields(), "arrival")
        for k in ("rate", "burst_interval", "background_rate"):
            if getattr(self, k) is not None:
                setattr(self, k, float(getattr(self, k)))

    def _set_fields(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ARRIVAL_NAMES if getattr(self, k) is not None}

    @classmethod
    def all_at_once(cls) -> "ArrivalSpec":
        return cls("all")

    @classmethod
    def poisson(cls, rate: float) -> "ArrivalSpec":
        return cls("poisson", rate=rate)

    @classmethod
    def burst(cls, size: int, interval: float, *, size_max: int | None = None,
              background_rate: float | None = None) -> "ArrivalSpec":
        return cls("burst", burst_size=size, burst_interval=interval,
                   burst_size_max=size_max, background_rate=background_rate)

    def describe(self) -> str:
        if self.kind == "all":
            return "all at t=0"
        if self.kind == "poisson":
            return f"poisson {self.rate:g}/s"
        size = (f"{self.burst_size}" if self.burst_size_max is None
                else f"{self.burst_size}-{self.burst_size_max}")
        s = f"bursts of {size} every {self.burst_interval:g}s"
        if self.background_rate:
            s += f" + poisson {self.background_rate:g}/s"
        return s

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self._set_fields()}

    def times(self, rng: Random) -> Iterator[float]:
        """Endless, non-decreasing arrival times (``all`` yields 0.0 forever)."""
        if self.kind == "all":
            while True:
                yield 0.0
        if self.kind == "poisson":
            yield from poisson_times(self.rate, rng)
            return
        bursts = burst_times(self.burst_interval, self.burst_size,
                         self.burst_size_max or self.burst_size, Random(rng.getrandbits(64)))
        if self.background_rate:
            yield from heapq.merge(bursts, poisson_times(self.background_rate, Random(rng.getrandbits(64))))
        else:
            yield from bursts


def poisson_times(rate: float, rng: Random) -> Iterator[float]:
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        yield t


def burst_times(interval: float, lo: int, hi: int, rng: Random, first: int = 0) -> Iterator[float]:
    k = first
    while True:
        t = k * interval
        for _ in range(rng.randint(lo, hi)):
            yield t
        k += 1
