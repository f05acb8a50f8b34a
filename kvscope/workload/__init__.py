"""Synthetic workloads: when requests arrive, how long their prompts and outputs are.

A :class:`WorkloadSpec` describes traffic (arrival process, prompt and output length
distributions, an optional shared system prompt, optional priorities). ``generate``
turns a spec into a deterministic list of :class:`WorkloadRequest` for a seed;
``generate_forever`` makes an endless stream for ``kvscope serve --forever`` and the
demo; ``make_burst`` / ``make_long_prompt`` build requests injected from the control
channel. Specs come from ``PRESETS`` or from JSON (``parse_spec`` / ``load_spec``);
docs/WORKLOADS.md describes the format.

Pure Python: no torch, no numpy. Randomness is ``random.Random`` seeded from strings,
so a seed gives the same workload on every machine and Python run.
"""

from __future__ import annotations

import copy
import heapq
import json
import math
import os
from dataclasses import dataclass
from random import Random
from typing import Any, Iterable, Iterator

__all__ = [
    "WorkloadRequest",
    "ArrivalSpec",
    "LengthDist",
    "WorkloadSpec",
    "PRESETS",
    "parse_spec",
    "load_spec",
    "spec_to_dict",
    "generate",
    "generate_forever",
    "make_burst",
    "make_long_prompt",
]

_ERR = "invalid workload spec"
MAX_LEN = 1 << 20  # no length (prompt, output) exceeds this, even from an unbounded distribution


def _fail(msg: str) -> None:
    raise ValueError(f"{_ERR}: {msg}")


def _key(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _r(v: Any, limit: int = 60) -> str:
    """A short one-line repr for error messages."""
    s = repr(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v))


def _check_int(v: Any, where: str, lo: int | None = None, hi: int | None = None) -> None:
    if not _is_int(v):
        _fail(f"{where} must be an integer, got {_r(v)}")
    if lo is not None and v < lo:
        _fail(f"{where} must be >= {lo}, got {_r(v)}")
    if hi is not None and v > hi:
        _fail(f"{where} must be <= {hi}, got {_r(v)}")


def _check_num(v: Any, where: str, *, positive: bool = False, nonneg: bool = False) -> None:
    if not _is_num(v):
        _fail(f"{where} must be a finite number, got {_r(v)}")
    if positive and v <= 0:
        _fail(f"{where} must be > 0, got {_r(v)}")
    if nonneg and v < 0:
        _fail(f"{where} must be >= 0, got {_r(v)}")


def _check_fields(kind_key: str, kind: Any, table: dict[str, tuple[tuple[str, ...], tuple[str, ...]]],
                  vals: dict[str, Any], path: str) -> None:
    """Kind is known, every required field is set, no field of another kind is set."""
    if not isinstance(kind, str) or kind not in table:
        _fail(f"{kind_key} must be one of {', '.join(table)}, got {_r(kind)}")
    required, optional = table[kind]
    for k in vals:
        if k not in required and k not in optional:
            allowed = ", ".join(required + optional) or "nothing else"
            _fail(f"{_key(path, k)} is not used by kind {_r(kind)} (it takes {allowed})")
    for k in required:
        if k not in vals:
            _fail(f"{_key(path, k)} is required for kind {_r(kind)}")


# --------------------------------------------------------------------------- requests


@dataclass(slots=True)
class WorkloadRequest:
    arrival: float  # seconds from the start of the workload
    prompt: list[int]  # token ids
    max_tokens: int
    priority: int = 0
    ignore_eos: bool = True


# --------------------------------------------------------------------------- arrivals

_ARRIVAL_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "all": ((), ()),
    "poisson": (("rate",), ()),
    "burst": (("burst_size", "burst_interval"), ("burst_size_max", "background_rate")),
}
_ARRIVAL_NAMES = ("rate", "burst_size", "burst_interval", "burst_size_max", "background_rate")


def _check_arrival(kind: Any, vals: dict[str, Any], path: str) -> None:
    _check_fields(_key(path, "kind"), kind, _ARRIVAL_FIELDS, vals, path)
    for k, v in vals.items():
        where = _key(path, k)
        if k in ("rate", "burst_interval"):
            _check_num(v, where, positive=True)
        elif k == "background_rate":
            _check_num(v, where, nonneg=True)
        else:  # burst_size, burst_size_max
            _check_int(v, where, lo=1)
    if "burst_size_max" in vals and vals["burst_size_max"] < vals["burst_size"]:
        _fail(f"{_key(path, 'burst_size_max')}={vals['burst_size_max']} is below "
              f"{_key(path, 'burst_size')}={vals['burst_size']}")


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
        _check_arrival(self.kind, self._set_fields(), "arrival")
        for k in ("rate", "burst_interval", "background_rate"):
            if getattr(self, k) is not None:
                setattr(self, k, float(getattr(self, k)))

    def _set_fields(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _ARRIVAL_NAMES if getattr(self, k) is not None}

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
            yield from _poisson(self.rate, rng)
            return
        bursts = _bursts(self.burst_interval, self.burst_size,
                         self.burst_size_max or self.burst_size, Random(rng.getrandbits(64)))
        if self.background_rate:
            yield from heapq.merge(bursts, _poisson(self.background_rate, Random(rng.getrandbits(64))))
        else:
            yield from bursts


def _poisson(rate: float, rng: Random) -> Iterator[float]:
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        yield t


def _bursts(interval: float, lo: int, hi: int, rng: Random, first: int = 0) -> Iterator[float]:
    k = first
    while True:
        t = k * interval
        for _ in range(rng.randint(lo, hi)):
            yield t
        k += 1


# --------------------------------------------------------------------------- lengths

_LENGTH_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "const": (("value",), ()),
    "uniform": (("lo", "hi"), ()),
    "lognormal": (("median", "sigma"), ("lo", "hi")),
    "normal": (("mean", "std"), ("lo", "hi")),
    "mixture": (("components",), ()),
}
_LENGTH_NAMES = ("value", "median", "sigma", "mean", "std", "lo", "hi", "components")


def _check_length(kind: Any, vals: dict[str, Any], path: str) -> None:
    """Values of a length distribution; mixture components are already LengthDist."""
    _check_fields(_key(path, "kind"), kind, _LENGTH_FIELDS, vals, path)
    for k, v in vals.items():
        where = _key(path, k)
        if k in ("value", "lo", "hi"):
            _check_int(v, where, lo=1, hi=MAX_LEN)
        elif k in ("median", "mean"):
            _check_num(v, where, positive=True)
        elif k in ("sigma", "std"):
            _check_num(v, where, nonneg=True)
    if "lo" in vals and "hi" in vals and vals["lo"] > vals["hi"]:
        _fail(f"{_key(path, 'lo')}={vals['lo']} > {_key(path, 'hi')}={vals['hi']}")
    if kind == "mixture":
        comps = vals["components"]
        where = _key(path, "components")
        if not isinstance(comps, (list, tuple)) or not comps:
            _fail(f"{where} must be a non-empty list of (weight, dist), got {_r(comps)}")
        for i, c in enumerate(comps):
            if not (isinstance(c, (list, tuple)) and len(c) == 2 and isinstance(c[1], LengthDist)):
                _fail(f"{where}[{i}] must be a (weight, LengthDist) pair, got {_r(c)}")
            _check_num(c[0], f"{where}[{i}].weight", positive=True)


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
        _check_length(self.kind, self._set_fields(), "")
        for k in ("median", "sigma", "mean", "std"):
            if getattr(self, k) is not None:
                setattr(self, k, float(getattr(self, k)))
        if self.components is not None:
            self.components = [(float(w), d) for w, d in self.components]

    def _set_fields(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _LENGTH_NAMES if getattr(self, k) is not None}

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


# --------------------------------------------------------------------------- specs


@dataclass
class WorkloadSpec:
    name: str
    num_requests: int
    arrival: ArrivalSpec
    prompt_len: LengthDist
    output_len: LengthDist
    shared_prefix_fraction: float = 0.0
    shared_prefix_len: int = 0
    priority_levels: list[int] | None = None
    seed: int = 0
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            _fail(f"name must be a non-empty string, got {_r(self.name)}")
        _check_int(self.num_requests, "num_requests", lo=1)
        for k, typ in (("arrival", ArrivalSpec), ("prompt_len", LengthDist), ("output_len", LengthDist)):
            if not isinstance(getattr(self, k), typ):
                _fail(f"{k} must be a {typ.__name__}, got {_r(getattr(self, k))}")
        f = self.shared_prefix_fraction
        if not _is_num(f) or not 0.0 <= f <= 1.0:
            _fail(f"shared_prefix_fraction must be in [0, 1], got {_r(f)}")
        self.shared_prefix_fraction = float(f)
        _check_int(self.shared_prefix_len, "shared_prefix_len", lo=0, hi=MAX_LEN)
        if self.shared_prefix_fraction > 0 and self.shared_prefix_len == 0:
            _fail("shared_prefix_len must be >= 1 when shared_prefix_fraction > 0")
        if self.priority_levels is not None:
            p = self.priority_levels
            if not isinstance(p, (list, tuple)) or not p or not all(_is_int(x) for x in p):
                _fail(f"priority_levels must be a non-empty list of integers or null, got {_r(p)}")
            self.priority_levels = list(p)
        _check_int(self.seed, "seed")
        if not isinstance(self.description, str):
            _fail(f"description must be a string, got {_r(self.description)}")

    def describe(self) -> str:
        s = (f"{self.name}: {self.num_requests} requests, {self.arrival.describe()}; "
             f"prompt {self.prompt_len.describe()}; output {self.output_len.describe()}")
        if self.shared_prefix_fraction:
            s += f"; {self.shared_prefix_fraction:.0%} share a {self.shared_prefix_len}-token prefix"
        if self.priority_levels:
            s += f"; priorities {self.priority_levels}"
        return s


def spec_to_dict(spec: WorkloadSpec) -> dict[str, Any]:
    """A JSON-ready dict; ``parse_spec(spec_to_dict(s)) == s``."""
    d: dict[str, Any] = {
        "name": spec.name,
        "num_requests": spec.num_requests,
        "arrival": spec.arrival.to_dict(),
        "prompt_len": spec.prompt_len.to_dict(),
        "output_len": spec.output_len.to_dict(),
        "shared_prefix_fraction": spec.shared_prefix_fraction,
        "shared_prefix_len": spec.shared_prefix_len,
        "priority_levels": None if spec.priority_levels is None else list(spec.priority_levels),
        "seed": spec.seed,
    }
    if spec.description:
        d["description"] = spec.description
    return d


_SPEC_KEYS = ("base", "name", "description", "num_requests", "arrival", "prompt_len", "output_len",
              "shared_prefix_fraction", "shared_prefix_len", "priority_levels", "seed")


def _parse_kinded(obj: Any, path: str) -> tuple[str, dict[str, Any]]:
    if not isinstance(obj, dict):
        _fail(f"{path} must be an object with a 'kind', got {_r(obj)}")
    if "kind" not in obj:
        _fail(f"{_key(path, 'kind')} is required")
    vals = {k: v for k, v in obj.items() if k != "kind" and v is not None}
    return obj["kind"], vals


def _parse_arrival(obj: Any, path: str) -> ArrivalSpec:
    kind, vals = _parse_kinded(obj, path)
    _check_arrival(kind, vals, path)
    return ArrivalSpec(kind, **vals)


def _parse_length(obj: Any, path: str) -> LengthDist:
    kind, vals = _parse_kinded(obj, path)
    if kind == "mixture" and "components" in vals:
        raw = vals["components"]
        where = _key(path, "components")
        if not isinstance(raw, list) or not raw:
            _fail(f"{where} must be a non-empty list, got {_r(raw)}")
        comps = []
        for i, c in enumerate(raw):
            cpath = f"{where}[{i}]"
            if isinstance(c, dict):
                extra = set(c) - {"weight", "dist"}
                if extra:
                    _fail(f"{cpath} has unknown key {sorted(extra)[0]!r} (it takes weight, dist)")
                if "weight" not in c or "dist" not in c:
                    _fail(f"{cpath} needs both 'weight' and 'dist'")
                w, d = c["weight"], c["dist"]
            elif isinstance(c, list) and len(c) == 2:
                w, d = c
            else:
                _fail(f"{cpath} must be {{'weight': w, 'dist': {{...}}}} or [w, {{...}}], got {_r(c)}")
            _check_num(w, f"{cpath}.weight", positive=True)
            comps.append((w, _parse_length(d, f"{cpath}.dist")))
        vals["components"] = comps
    _check_length(kind, vals, path)
    return LengthDist(kind, **vals)


def parse_spec(obj: dict) -> WorkloadSpec:
    """Build a spec from a JSON object; any problem is a one-line ValueError naming the key.

    ``"base": "<preset>"`` starts from a preset and overrides the keys given.
    """
    if not isinstance(obj, dict):
        _fail(f"expected a JSON object, got {type(obj).__name__}")
    for k in obj:
        if k not in _SPEC_KEYS:
            _fail(f"unknown key {_r(k)} (expected one of {', '.join(_SPEC_KEYS)})")
    if "base" in obj:
        base = obj["base"]
        if base not in PRESETS:
            _fail(f"base must be a preset ({', '.join(PRESETS)}), got {_r(base)}")
        merged = spec_to_dict(PRESETS[base])
        merged.update({k: v for k, v in obj.items() if k != "base"})
        obj = merged
    for k in ("num_requests", "arrival", "prompt_len", "output_len"):
        if k not in obj:
            _fail(f"missing required key {_r(k)}")
    return WorkloadSpec(
        name=obj.get("name", "custom"),
        num_requests=obj["num_requests"],
        arrival=_parse_arrival(obj["arrival"], "arrival"),
        prompt_len=_parse_length(obj["prompt_len"], "prompt_len"),
        output_len=_parse_length(obj["output_len"], "output_len"),
        shared_prefix_fraction=obj.get("shared_prefix_fraction", 0.0),
        shared_prefix_len=obj.get("shared_prefix_len", 0),
        priority_levels=obj.get("priority_levels"),
        seed=obj.get("seed", 0),
        description=obj.get("description", ""),
    )


def load_spec(name_or_path: str) -> WorkloadSpec:
    """A preset by name (a fresh copy), or a spec from a .json file."""
    if name_or_path in PRESETS:
        return copy.deepcopy(PRESETS[name_or_path])
    if not (name_or_path.endswith(".json") or os.path.exists(name_or_path)):
        raise ValueError(f"unknown workload {name_or_path!r} "
                         f"(choose from {', '.join(PRESETS)} or a .json file)")
    try:
        with open(name_or_path, encoding="utf-8") as f:
            obj = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read workload file {name_or_path!r}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"invalid JSON in workload file {name_or_path!r}: {e}") from None
    if isinstance(obj, dict) and "name" not in obj and "base" not in obj:
        obj = {**obj, "name": os.path.splitext(os.path.basename(name_or_path))[0]}
    try:
        return parse_spec(obj)
    except ValueError as e:
        raise ValueError(f"{name_or_path}: {e}") from None


# --------------------------------------------------------------------------- generation


def _rng(seed: int, stream: str) -> Random:
    return Random(f"kvscope.workload/{seed}/{stream}")


def _check_gen_args(vocab_size: int, reserved_ids: int, max_prompt_len: int | None,
                    max_tokens_cap: int | None) -> int:
    if not _is_int(vocab_size) or not _is_int(reserved_ids) or reserved_ids < 0:
        raise ValueError(f"vocab_size and reserved_ids must be integers >= 0, "
                         f"got {_r(vocab_size)}, {_r(reserved_ids)}")
    usable = vocab_size - reserved_ids
    if usable < 1:
        raise ValueError(f"no usable token ids: vocab_size={vocab_size} reserved_ids={reserved_ids}")
    if max_prompt_len is not None and (not _is_int(max_prompt_len) or max_prompt_len < 1):
        raise ValueError(f"max_prompt_len must be an integer >= 1, got {_r(max_prompt_len)}")
    if max_tokens_cap is not None and (not _is_int(max_tokens_cap) or max_tokens_cap < 1):
        raise ValueError(f"max_tokens_cap must be an integer >= 1, got {_r(max_tokens_cap)}")
    return usable


def _tokens(rng: Random, n: int, usable: int) -> list[int]:
    return rng.choices(range(usable), k=n)


def shared_prefix_tokens(spec: WorkloadSpec, *, vocab_size: int, reserved_ids: int = 0) -> list[int]:
    """The spec's shared prefix. It depends on the spec's name and seed only (not the seed
    given to ``generate``), so requests injected later share it with the running workload."""
    usable = _check_gen_args(vocab_size, reserved_ids, None, None)
    return _tokens(_rng(spec.seed, f"prefix/{spec.name}"), spec.shared_prefix_len, usable)


class _Maker:
    """Draws one request at a time from a spec."""

    def __init__(self, spec: WorkloadSpec, seed: int, usable: int, max_prompt_len: int | None,
                 max_tokens_cap: int | None, prefix: list[int]):
        self.spec, self.usable, self.prefix = spec, usable, prefix
        self.max_prompt_len, self.max_tokens_cap = max_prompt_len, max_tokens_cap
        self.rng = _rng(seed, "requests")

    def make(self, arrival: float, shared: bool) -> WorkloadRequest:
        spec, rng = self.spec, self.rng
        n = spec.prompt_len.sample(rng)
        out = spec.output_len.sample(rng)
        if self.max_tokens_cap is not None:
            out = min(out, self.max_tokens_cap)
        prio = rng.choice(spec.priority_levels) if spec.priority_levels else 0
        cap = self.max_prompt_len
        if shared:
            pre = self.prefix if cap is None else self.prefix[:cap]
            if cap is not None:
                n = min(n, cap - len(pre))
            prompt = pre + _tokens(rng, n, self.usable)
        else:
            if cap is not None:
                n = min(n, cap)
            prompt = _tokens(rng, max(1, n), self.usable)
        return WorkloadRequest(arrival=arrival, prompt=prompt, max_tokens=max(1, out), priority=prio)


def _batch(spec: WorkloadSpec, times: list[float], seed: int, vocab_size: int, reserved_ids: int,
           max_prompt_len: int | None, max_tokens_cap: int | None) -> list[WorkloadRequest]:
    usable = _check_gen_args(vocab_size, reserved_ids, max_prompt_len, max_tokens_cap)
    n = len(times)
    prefix = shared_prefix_tokens(spec, vocab_size=vocab_size, reserved_ids=reserved_ids)
    # Exactly round(fraction * n) requests carry the prefix, chosen at random.
    shared = set(_rng(seed, "shared").sample(range(n), round(spec.shared_prefix_fraction * n)))
    maker = _Maker(spec, seed, usable, max_prompt_len, max_tokens_cap, prefix)
    reqs = [maker.make(t, i in shared) for i, t in enumerate(times)]
    reqs.sort(key=lambda r: r.arrival)
    return reqs


def generate(spec: WorkloadSpec, *, vocab_size: int, num_requests: int | None = None,
             seed: int | None = None, max_prompt_len: int | None = None,
             max_tokens_cap: int | None = None, reserved_ids: int = 0) -> list[WorkloadRequest]:
    """The spec's requests, sorted by arrival; the same list for the same arguments.

    Token ids are uniform in [0, vocab_size - reserved_ids). Prompts are clipped to
    ``max_prompt_len`` (the shared prefix first keeps its tokens), outputs to
    ``max_tokens_cap``; both stay >= 1.
    """
    n = spec.num_requests if num_requests is None else num_requests
    if not _is_int(n) or n < 0:
        raise ValueError(f"num_requests must be an integer >= 0, got {_r(n)}")
    seed = spec.seed if seed is None else seed
    arrivals = spec.arrival.times(_rng(seed, "arrival"))
    times = [next(arrivals) for _ in range(n)]
    return _batch(spec, times, seed, vocab_size, reserved_ids, max_prompt_len, max_tokens_cap)


def generate_forever(spec: WorkloadSpec, *, vocab_size: int, seed: int | None = None,
                     reserved_ids: int = 0, max_prompt_len: int | None = None,
                     burst_every_s: float | None = None, burst_size: int = 16,
                     max_tokens_cap: int | None = None) -> Iterator[WorkloadRequest]:
    """An endless stream with non-decreasing arrivals (``num_requests`` is ignored).

    With ``burst_every_s``, ``burst_size`` extra requests arrive together at
    t = burst_every_s, 2*burst_every_s, ... Each request carries the shared prefix with
    probability ``shared_prefix_fraction``. Arguments are checked at the call, not lazily.
    """
    if spec.arrival.kind == "all" and burst_every_s is None:
        raise ValueError(f"workload {_r(spec.name)} has arrival kind 'all'; an endless stream "
                         "needs poisson or burst arrivals (or burst_every_s)")
    if burst_every_s is not None:
        if not _is_num(burst_every_s) or burst_every_s <= 0:
            raise ValueError(f"burst_every_s must be > 0, got {_r(burst_every_s)}")
        if not _is_int(burst_size) or burst_size < 1:
            raise ValueError(f"burst_size must be an integer >= 1, got {_r(burst_size)}")
    usable = _check_gen_args(vocab_size, reserved_ids, max_prompt_len, max_tokens_cap)
    seed = spec.seed if seed is None else seed
    prefix = shared_prefix_tokens(spec, vocab_size=vocab_size, reserved_ids=reserved_ids)
    maker = _Maker(spec, seed, usable, max_prompt_len, max_tokens_cap, prefix)
    share_rng = _rng(seed, "shared")

    def stream() -> Iterator[WorkloadRequest]:
        streams: list[Iterator[float]] = []
        if spec.arrival.kind != "all":
            streams.append(spec.arrival.times(_rng(seed, "arrival")))
        if burst_every_s is not None:
            streams.append(_bursts(float(burst_every_s), burst_size, burst_size, Random(0), first=1))
        frac = spec.shared_prefix_fraction
        for t in heapq.merge(*streams):
            yield maker.make(t, frac > 0 and share_rng.random() < frac)

    return stream()


def make_burst(spec_or_name: WorkloadSpec | str, n: int, *, at: float, vocab_size: int, seed: int,
               reserved_ids: int = 0, max_prompt_len: int | None = None,
               max_tokens_cap: int | None = None) -> list[WorkloadRequest]:
    """``n`` requests drawn from a workload (a spec, preset name or .json path), all
    arriving at ``at``. They share the workload's prefix, if it has one."""
    spec = load_spec(spec_or_name) if isinstance(spec_or_name, str) else spec_or_name
    if not _is_int(n) or n < 0:
        raise ValueError(f"burst size must be an integer >= 0, got {_r(n)}")
    if not _is_num(at) or at < 0:
        raise ValueError(f"burst time must be >= 0, got {_r(at)}")
    return _batch(spec, [float(at)] * n, seed, vocab_size, reserved_ids, max_prompt_len, max_tokens_cap)


def make_long_prompt(length: int, *, at: float, vocab_size: int, seed: int, max_tokens: int = 64,
                     reserved_ids: int = 0) -> WorkloadRequest:
    """One request with a random prompt of exactly ``length`` tokens, arriving at ``at``."""
    usable = _check_gen_args(vocab_size, reserved_ids, None, None)
    if not _is_int(length) or length < 1:
        raise ValueError(f"prompt length must be an integer >= 1, got {_r(length)}")
    if not _is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {_r(max_tokens)}")
    prompt = _tokens(_rng(seed, f"long/{length}"), length, usable)
    return WorkloadRequest(arrival=float(at), prompt=prompt, max_tokens=max_tokens)


# --------------------------------------------------------------------------- presets

_U, _LN = LengthDist.uniform, LengthDist.lognormal

PRESETS: dict[str, WorkloadSpec] = {
    s.name: s
    for s in (
        WorkloadSpec(
            name="chat", num_requests=128, arrival=ArrivalSpec.poisson(8.0),
            prompt_len=_LN(96, 0.6, 32, 256), output_len=_LN(96, 0.6, 32, 256),
            description="interactive chat: short prompts and answers, steady Poisson traffic",
        ),
        WorkloadSpec(
            name="mixed", num_requests=128, arrival=ArrivalSpec.poisson(4.0),
            prompt_len=LengthDist.mixture([(0.9, _LN(160, 0.7, 32, 512)), (0.1, _U(2048, 8192))]),
            output_len=_U(32, 256),
            description="mostly short prompts plus ~10% long documents: the chunked-prefill case",
        ),
        WorkloadSpec(
            name="long", num_requests=64, arrival=ArrivalSpec.poisson(1.0),
            prompt_len=_U(2048, 8192), output_len=_U(64, 256),
            description="long-context summarisation: prefill-heavy, KV-hungry",
        ),
        WorkloadSpec(
            name="burst", num_requests=192,
            arrival=ArrivalSpec.burst(16, 4.0, size_max=32, background_rate=1.0),
            prompt_len=_U(32, 256), output_len=_U(32, 128),
            description="16-32 requests at once every 4 s over a trickle: queueing and admission",
        ),
        WorkloadSpec(
            name="shared-prefix", num_requests=128, arrival=ArrivalSpec.poisson(8.0),
            prompt_len=_U(16, 128), output_len=_U(32, 128),
            shared_prefix_fraction=0.8, shared_prefix_len=256,
            description="80% of requests start with the same 256-token system prompt: prefix caching",
        ),
        WorkloadSpec(
            name="demo", num_requests=96,
            arrival=ArrivalSpec.burst(16, 6.0, size_max=28, background_rate=4.0),
            prompt_len=LengthDist.mixture([(0.93, _LN(64, 0.6, 16, 192)), (0.07, _U(1024, 2048))]),
            output_len=_U(32, 256),
            shared_prefix_fraction=0.25, shared_prefix_len=64,
            description="live CPU demo with the tiny model: short chat, a few long prompts, bursts",
        ),
    )
}
