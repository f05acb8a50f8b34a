"""Distributions of token counts (prompt and output lengths): const, uniform, lognormal,
normal and mixtures of them. Every sample is an integer in [1, MAX_LEN]."""

from __future__ import annotations

import math
from dataclasses import dataclass
from random import Random
from typing import Any, Iterable

from .checks import MAX_LEN, KindTable, check_fields, check_int, check_num, fail, key, short_repr

LENGTH_FIELDS: KindTable = {
    "const": (("value",), ()),
    "uniform": (("lo", "hi"), ()),
    "lognormal": (("median", "sigma"), ("lo", "hi")),
    "normal": (("mean", "std"), ("lo", "hi")),
    "mixture": (("components",), ()),
}
LENGTH_NAMES = ("value", "median", "sigma", "mean", "std", "lo", "hi", "components")


def check_length(kind: Any, vals: dict[str, Any], path: str) -> None:
    """Values of a length distribution; mixture components are already LengthDist."""
    check_fields(key(path, "kind"), kind, LENGTH_FIELDS, vals, path)
    for k, v in vals.items():
        where = key(path, k)
        if k in ("value", "lo", "hi"):
            check_int(v, where, lo=1, hi=MAX_LEN)
        elif k in ("median", "mean"):
            check_num(v, where, positive=True)
        elif k in ("sigma", "std"):
            check_num(v, where, nonneg=True)
    if "lo" in vals and "hi" in vals and vals["lo"] > vals["hi"]:
        fail(f"{key(path, 'lo')}={vals['lo']} > {key(path, 'hi')}={vals['hi']}")
    if kind == "mixture":
        comps = vals["components"]
        where = key(path, "components")
        if not isinstance(comps, (list, tuple)) or not comps:
            fail(f"{where} must be a non-empty list of (weight, dist), got {short_repr(comps)}")
        for i, c in enumerate(comps):
            if not (isinstance(c, (list, tuple)) and len(c) == 2 and isinstance(c[1], LengthDist)):
                fail(f"{where}[{i}] must be a (weight, LengthDist) pair, got {short_repr(c)}")
            check_num(c[0], f"{where}[{i}].weight", positive=True)


@dataclass
class LengthDist:
    """A distribution of token counts (always >= 1).

    - ``const``: ``value``.
    - ``uniform``: integers in [lo, hi], both inclusive.
    - ``lognormal``: ``median`` * exp(``sigma`` * N(0,1)), rounded, clipped to [lo, hi]
      (lo defaults to 1, hi to unbounded).
    - ``normal``: N(``mean``, ``std``), rounded, clipped to [lo, hi] (same defaults).
    - ``mixture``: ``components`` is a list of (weight, LengthDist); weights are relative.
    """

    kind: str
    value: int | None = None
    lo: int | None = None
    hi: int | None = None
    median: float | None = None
    sigma: float | None = None
    mean: float | None = None
    std: float | None = None
    components: list[tuple[float, "LengthDist"]] | None = None

    def __post_init__(self) -> None:
        check_length(self.kind, self._set_fields(), "")
        for k in ("median", "sigma", "mean", "std"):
            if getattr(self, k) is not None:
                setattr(self, k, float(getattr(self, k)))
        if self.components is not None:
            self.components = [(float(w), d) for w, d in self.components]

    def _set_fields(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in LENGTH_NAMES if getattr(self, k) is not None}

    @classmethod
    def const(cls, value: int) -> "LengthDist":
        return cls("const", value=value)

    @classmethod
    def uniform(cls, lo: int, hi: int) -> "LengthDist":
        return cls("uniform", lo=lo, hi=hi)

    @classmethod
    def lognormal(cls, median: float, sigma: float, lo: int | None = None,
                  hi: int | None = None) -> "LengthDist":
        return cls("lognormal", median=median, sigma=sigma, lo=lo, hi=hi)

    @classmethod
    def normal(cls, mean: float, std: float, lo: int | None = None,
               hi: int | None = None) -> "LengthDist":
        return cls("normal", mean=mean, std=std, lo=lo, hi=hi)

    @classmethod
    def mixture(cls, components: Iterable[tuple[float, "LengthDist"]]) -> "LengthDist":
        return cls("mixture", components=list(components))

    def bounds(self) -> tuple[int, int | None]:
        """(smallest, largest) value ``sample`` can return; largest is None if unbounded."""
        if self.kind == "const":
            return self.value, self.value
        if self.kind == "mixture":
            bs = [d.bounds() for _, d in self.components]
            his = [b[1] for b in bs]
            return min(b[0] for b in bs), (None if None in his else max(his))
        lo = 1 if self.lo is None else self.lo
        if self.kind == "uniform" or self.hi is not None:
            return lo, self.hi
        return lo, None

    def sample(self, rng: Random) -> int:
        kind = self.kind
        if kind == "const":
            return self.value
        if kind == "uniform":
            return rng.randint(self.lo, self.hi)
        if kind == "mixture":
            x = rng.random() * sum(w for w, _ in self.components)
            for w, d in self.components:
                x -= w
                if x < 0:
                    return d.sample(rng)
            return self.components[-1][1].sample(rng)
        if kind == "lognormal":
            x = math.exp(min(40.0, math.log(self.median) + self.sigma * rng.gauss(0.0, 1.0)))
        else:  # normal
            x = rng.gauss(self.mean, self.std)
        lo, hi = self.bounds()
        n = int(round(min(max(x, 0.0), MAX_LEN)))
        return max(lo, min(n, MAX_LEN if hi is None else hi))

    def describe(self) -> str:
        k = self.kind
        if k == "const":
            return f"{self.value}"
        if k == "uniform":
            return f"uniform {self.lo}-{self.hi}"
        if k == "mixture":
            total = sum(w for w, _ in self.components)
            return " + ".join(f"{100 * w / total:.0f}% {d.describe()}" for w, d in self.components)
        lo, hi = self.bounds()
        clip = f" [{lo}, {hi if hi is not None else 'inf'}]"
        if k == "lognormal":
            return f"lognormal median {self.median:g} sigma {self.sigma:g}{clip}"
        return f"normal {self.mean:g}±{self.std:g}{clip}"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind}
        for k, v in self._set_fields().items():
            if k == "components":
                v = [{"weight": w, "dist": c.to_dict()} for w, c in v]
            d[k] = v
        return d
