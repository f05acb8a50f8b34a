"""WorkloadSpec: one description of traffic, and its JSON form (docs/WORKLOADS.md).

``spec_from_dict`` builds a spec from a JSON object whose keys are all given (no
``base``); kvscope.workload.files adds presets as bases and reading files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvscope.protocol.events import INT64_MAX, INT64_MIN

from .arrivals import ArrivalSpec, check_arrival
from .checks import MAX_LEN, check_int, check_num, fail, is_int, is_num, key, short_repr
from .lengths import LengthDist, check_length

MAX_REQUESTS = 1_000_000  # per spec or burst: the generated list is held in memory
MAX_MIXTURE_DEPTH = 8  # mixtures of mixtures: more is a mistake (or a hostile file)

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
            fail(f"name must be a non-empty string, got {short_repr(self.name)}")
        check_int(self.num_requests, "num_requests", lo=1, hi=MAX_REQUESTS)
        for k, typ in (("arrival", ArrivalSpec), ("prompt_len", LengthDist), ("output_len", LengthDist)):
            if not isinstance(getattr(self, k), typ):
                fail(f"{k} must be a {typ.__name__}, got {short_repr(getattr(self, k))}")
        f = self.shared_prefix_fraction
        if not is_num(f) or not 0.0 <= f <= 1.0:
            fail(f"shared_prefix_fraction must be in [0, 1], got {short_repr(f)}")
        self.shared_prefix_fraction = float(f)
        check_int(self.shared_prefix_len, "shared_prefix_len", lo=0, hi=MAX_LEN)
        if self.shared_prefix_fraction > 0 and self.shared_prefix_len == 0:
            fail("shared_prefix_len must be >= 1 when shared_prefix_fraction > 0")
        if self.priority_levels is not None:
            p = self.priority_levels
            if not isinstance(p, (list, tuple)) or not 1 <= len(p) <= 1024 or not all(is_int(x) for x in p):
                fail(f"priority_levels must be a non-empty list of integers or null, got {short_repr(p)}")
            for i, x in enumerate(p):
                # the engine's rule (engine/request.py): an int64 whose negation is one too
                check_int(x, f"priority_levels[{i}]", lo=-INT64_MAX, hi=INT64_MAX)
            self.priority_levels = list(p)
        check_int(self.seed, "seed", lo=INT64_MIN, hi=INT64_MAX)
        if not isinstance(self.description, str):
            fail(f"description must be a string, got {short_repr(self.description)}")

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


SPEC_KEYS = ("base", "name", "description", "num_requests", "arrival", "prompt_len", "output_len",
              "shared_prefix_fraction", "shared_prefix_len", "priority_levels", "seed")


def _parse_kinded(obj: Any, path: str) -> tuple[str, dict[str, Any]]:
    if not isinstance(obj, dict):
        fail(f"{path} must be an object with a 'kind', got {short_repr(obj)}")
    if "kind" not in obj:
        fail(f"{key(path, 'kind')} is required")
    vals = {k: v for k, v in obj.items() if k != "kind" and v is not None}
    return obj["kind"], vals


def _parse_arrival(obj: Any, path: str) -> ArrivalSpec:
    kind, vals = _parse_kinded(obj, path)
    check_arrival(kind, vals, path)
    return ArrivalSpec(kind, **vals)


def parse_length(obj: Any, path: str, depth: int = 0) -> LengthDist:
    kind, vals = _parse_kinded(obj, path)
    if kind == "mixture" and "components" in vals:
        if depth >= MAX_MIXTURE_DEPTH:
            fail(f"{path} nests mixtures more than {MAX_MIXTURE_DEPTH} deep")
        raw = vals["components"]
        where = key(path, "components")
        if not isinstance(raw, list) or not raw:
            fail(f"{where} must be a non-empty list, got {short_repr(raw)}")
        comps = []
        for i, c in enumerate(raw):
            cpath = f"{where}[{i}]"
            if isinstance(c, dict):
                extra = set(c) - {"weight", "dist"}
                if extra:
                    fail(f"{cpath} has unknown key {short_repr(sorted(map(str, extra))[0])} (it takes weight, dist)")
                if "weight" not in c or "dist" not in c:
                    fail(f"{cpath} needs both 'weight' and 'dist'")
                w, d = c["weight"], c["dist"]
            elif isinstance(c, list) and len(c) == 2:
                w, d = c
            else:
                fail(f"{cpath} must be {{'weight': w, 'dist': {{...}}}} or [w, {{...}}], got {short_repr(c)}")
            check_num(w, f"{cpath}.weight", positive=True)
            comps.append((w, parse_length(d, f"{cpath}.dist", depth + 1)))
        vals["components"] = comps
    check_length(kind, vals, path)
    return LengthDist(kind, **vals)


def spec_from_dict(obj: dict) -> WorkloadSpec:
    """A spec from a JSON object with every required key (no ``base``); one-line WorkloadError."""
    for k in ("num_requests", "arrival", "prompt_len", "output_len"):
        if k not in obj:
            fail(f"missing required key {short_repr(k)}")
    return WorkloadSpec(
        name=obj.get("name", "custom"),
        num_requests=obj["num_requests"],
        arrival=_parse_arrival(obj["arrival"], "arrival"),
        prompt_len=parse_length(obj["prompt_len"], "prompt_len"),
        output_len=parse_length(obj["output_len"], "output_len"),
        shared_prefix_fraction=obj.get("shared_prefix_fraction", 0.0),
        shared_prefix_len=obj.get("shared_prefix_len", 0),
        priority_levels=obj.get("priority_levels"),
        seed=obj.get("seed", 0),
        description=obj.get("description", ""),
    )
