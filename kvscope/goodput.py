"""Goodput and SLO attainment from per-request records: the one definition every figure uses.

The definitions are vLLM's `vllm bench serve --goodput KEY:MS ...` (benchmarks/serve.py):
- SLO keys ``ttft``, ``tpot`` and ``e2el``, each a target in milliseconds;
- TPOT of a request = (e2e - ttft) / (output_tokens - 1), 0 for a one-token output;
- a request is *good* when it meets every SLO given (value <= target).
kvscope adds the token view the lesson uses: goodput = output tokens of good requests / the
same span tok/s divides by (first arrival to last finish), so goodput <= tok/s always, and
they are equal when every request meets its SLOs. vLLM's "request goodput" (good req/s) is
given too. A request that ended in ``abort`` or ``error`` is never good.

Pure: no torch, no engine. The dashboard, bench, race/compare, report, diagnose and
/metrics all build ``RequestRecord``s from the same finish records (``Finish``: req, ttft,
e2e, output_len, reason) and fold them here, so they agree to the request. docs/GOODPUT.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from kvscope.errors import KvscopeError

SLO_KEYS = ("ttft", "tpot", "e2el")  # vLLM's --goodput keys, in its order
MAX_SLO_MS = 1e9  # about 11.6 days: the trace reader refuses more (protocol.engine_info.SloMs)
MAX_COST_PER_HOUR = 1e6  # USD
UNGOOD_REASONS = ("abort", "error")  # finish reasons that never count as good
WIRE_PREFIX = "slo_"  # hello.config keys: slo_ttft_ms, slo_tpot_ms, slo_e2el_ms


class SloError(KvscopeError):
    """A bad --slo (one line)."""


@dataclass(frozen=True)
class Slo:
    """Targets in milliseconds; None: not set. An Slo with none set judges nothing (all good)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(k for k in SLO_KEYS if self.target_ms(k) is not None)

    def __bool__(self) -> bool:
        return bool(self.keys)

    def target_ms(self, key: str) -> float | None:
        return getattr(self, f"{key}_ms")

    def describe(self) -> str:
        """As the flag takes it: ``ttft:500 tpot:50`` ("" when none)."""
        return " ".join(f"{k}:{self.target_ms(k):g}" for k in self.keys)

    def to_wire(self) -> dict[str, float]:
        """hello.config's flat keys (docs/PROTOCOL.md): only the targets that are set."""
        return {f"{WIRE_PREFIX}{k}_ms": float(self.target_ms(k)) for k in self.keys}


NO_SLO = Slo()


def _target(key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise SloError(f"--slo {key}:{text}: {text!r} is not a number of milliseconds") from None
    if not math.isfinite(value) or value < 0 or value > MAX_SLO_MS:
        raise SloError(f"--slo {key}:{text}: the target must be a number of milliseconds in [0, {MAX_SLO_MS:g}]")
    return value


def parse_slo(items: Iterable[str] | str | None) -> Slo:
    """``["ttft:500", "tpot:50"]`` (or one string, items split on spaces or commas) -> Slo.

    The keys are vLLM's --goodput keys; each at most once; values are milliseconds, >= 0."""
    if items is None:
        return NO_SLO
    if isinstance(items, str):
        items = [items]
    parts = [p for item in items for p in str(item).replace(",", " ").split()]
    if len(parts) > 2 * len(SLO_KEYS):
        raise SloError(f"--slo: too many targets ({len(parts)}); give each of {', '.join(SLO_KEYS)} at most once")
    values: dict[str, float] = {}
    for part in parts:
        key, sep, text = part.partition(":")
        key = key.strip().lower()
        if not sep or not text.strip():
            raise SloError(f"--slo {part[:64]!r}: expected KEY:MILLISECONDS, e.g. ttft:500 tpot:50")
        if key not in SLO_KEYS:
            raise SloError(f"--slo {part[:64]!r}: unknown key {key[:32]!r} (choose from {', '.join(SLO_KEYS)})")
        if key in values:
            raise SloError(f"--slo: {key} given twice")
        values[key] = _target(key, text.strip())
    return Slo(**{f"{k}_ms": v for k, v in values.items()})


def slo_of(info: Any) -> Slo:
    """The SLO a trace recorded (hello.config's ``slo`` section, or None/absent: no SLO)."""
    section = getattr(info, "slo", None) if info is not None else None
    if section is None:
        return NO_SLO
    out = {}
    for k in SLO_KEYS:
        v = getattr(section, f"{k}_ms", None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{k}_ms"] = float(v)
    return Slo(**out)


def slo_of_flat(config: dict | None) -> Slo:
    """The SLO in a flat hello.config map (``slo_ttft_ms``...; EngineInfo.as_dict())."""
    out = {}
    for k in SLO_KEYS:
        v = (config or {}).get(f"{WIRE_PREFIX}{k}_ms")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v <= MAX_SLO_MS:
            out[f"{k}_ms"] = float(v)
    return Slo(**out)


def resolve_slo(override: Slo | None, info: Any = None) -> Slo:
    """The SLO a view judges by: the command line's when given, else the one the trace recorded."""
    return override if override else slo_of(info)


# ---------------------------------------------------------------------------------- one request
@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What a finish record says of one request (seconds)."""

    req: int
    ttft: float
    e2e: float
    output_len: int
    reason: str = ""

    @classmethod
    def of_finish(cls, f: Any) -> "RequestRecord":
        """From a protocol ``Finish`` (a step event's ``finished`` entry)."""
        return cls(int(f.req), float(f.ttft or 0.0), float(f.e2e or 0.0), int(f.output_len), str(f.reason or ""))

    @property
    def tpot(self) -> float:
        """vLLM's: mean time per output token after the first."""
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 else 0.0

    def value(self, key: str) -> float:
        return {"ttft": self.ttft, "tpot": self.tpot, "e2el": self.e2e}[key]


@dataclass(frozen=True)
class Judgement:
    """One request against the SLO: each key's value and target (seconds), and the verdict."""

    good: bool
    checks: tuple[tuple[str, float, float], ...]  # (key, value_s, target_s)
    ended_badly: bool = False  # aborted or failed: never good

    @property
    def missed(self) -> tuple[tuple[str, float, float], ...]:
        return tuple(c for c in self.checks if c[1] > c[2])


def judge(rec: RequestRecord, slo: Slo) -> Judgement:
    checks = tuple((k, rec.value(k), slo.target_ms(k) / 1000.0) for k in slo.keys)
    bad_end = rec.reason in UNGOOD_REASONS
    return Judgement(not bad_end and all(v <= t for _, v, t in checks), checks, bad_end)


# ---------------------------------------------------------------------------------- many requests
@dataclass
class GoodputFigures:
    slo: str  # Slo.describe()
    requests: int  # finished requests judged
    good_requests: int
    output_tokens: int
    good_tokens: int
    duration_s: float
    output_tok_per_s: float
    goodput_tok_per_s: float
    good_req_per_s: float  # vLLM's "request goodput"
    attainment: float | None  # good / requests
    met: dict[str, float | None]  # per SLO key: share of requests meeting it

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class GoodputTally:
    """Fold finish records in order; fixed memory. ``add(record, end_t)``: end_t is when it finished
    (its step's end); the span is first arrival (end_t - e2e) to last finish, as tok/s uses."""

    slo: Slo = NO_SLO
    requests: int = 0
    good: int = 0
    output_tokens: int = 0
    good_tokens: int = 0
    met: dict[str, int] = field(default_factory=dict)
    first_arrival: float | None = None
    last_finish: float | None = None

    def add(self, rec: RequestRecord, end_t: float | None = None) -> Judgement:
        j = judge(rec, self.slo)
        self.requests += 1
        self.output_tokens += rec.output_len
        if j.good:
            self.good += 1
            self.good_tokens += rec.output_len
        for k, v, t in j.checks:
            if v <= t and not j.ended_badly:
                self.met[k] = self.met.get(k, 0) + 1
        if end_t is not None and math.isfinite(end_t):
            start = end_t - rec.e2e
            if self.first_arrival is None or start < self.first_arrival:
                self.first_arrival = start
            if self.last_finish is None or end_t > self.last_finish:
                self.last_finish = end_t
        return j

    def add_step(self, ev: Any) -> None:
        """Every finish of a protocol StepEvent."""
        end = float(ev.t + ev.dur)
        for f in ev.finished:
            self.add(RequestRecord.of_finish(f), end)

    def copy(self) -> "GoodputTally":
        return GoodputTally(self.slo, self.requests, self.good, self.output_tokens, self.good_tokens, dict(self.met),
                            self.first_arrival, self.last_finish)

    @property
    def span(self) -> float:
        if self.first_arrival is None or self.last_finish is None:
            return 0.0
        return max(0.0, self.last_finish - self.first_arrival)

    def figures(self, duration_s: float | None = None) -> GoodputFigures:
        """Rates over ``duration_s`` (the caller's tok/s span), else over the tally's own span."""
        d = self.span if duration_s is None else max(0.0, float(duration_s))
        n = self.requests
        return GoodputFigures(
            slo=self.slo.describe(),
            requests=n,
            good_requests=self.good,
            output_tokens=self.output_tokens,
            good_tokens=self.good_tokens,
            duration_s=d,
            output_tok_per_s=self.output_tokens / d if d > 0 else 0.0,
            goodput_tok_per_s=self.good_tokens / d if d > 0 else 0.0,
            good_req_per_s=self.good / d if d > 0 else 0.0,
            attainment=self.good / n if n else None,
            met={k: (self.met.get(k, 0) / n if n else None) for k in self.slo.keys},
        )


# ---------------------------------------------------------------------------------- cost
def check_cost_per_hour(value: float | None) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 < value <= MAX_COST_PER_HOUR:
        raise KvscopeError(f"--cost-per-hour must be a number of USD in (0, {MAX_COST_PER_HOUR:g}], got {value!r}")
    return float(value)


def usd_per_mtok(cost_per_hour: float | None, tok_per_s: float | None) -> float | None:
    """$ per million tokens at a rate: cost_per_hour / (tokens per hour / 1e6). None without a price or a rate."""
    if cost_per_hour is None or not tok_per_s or tok_per_s <= 0:
        return None
    return cost_per_hour / (tok_per_s * 3600.0 / 1e6)


def row_fields(fig: GoodputFigures, cost_per_hour: float | None = None) -> dict[str, Any]:
    """The keys a benchmarks/race/report row gains (bench --json rows, docs/GOODPUT.md): the goodput keys with
    an SLO only (without one there is no goodput, as in vLLM), the cost keys with a price only."""
    out: dict[str, Any] = {}
    if fig.slo:
        out.update({
            "slo": fig.slo,
            "goodput_tok_per_s": fig.goodput_tok_per_s,
            "good_req_per_s": fig.good_req_per_s,
            "good_requests": fig.good_requests,
            "good_tokens": fig.good_tokens,
            "judged_requests": fig.requests,
            "slo_attainment": fig.attainment,
            "slo_met": fig.met,
        })
    if cost_per_hour is not None:
        out["cost_per_hour"] = cost_per_hour
        out["usd_per_mtok"] = usd_per_mtok(cost_per_hour, fig.output_tok_per_s)
        out["usd_per_mgood"] = usd_per_mtok(cost_per_hour, fig.goodput_tok_per_s) if fig.slo else None
    return out


def fmt_usd(value: float | None) -> str:
    return "-" if value is None else (f"${value:,.2f}" if value >= 0.1 else f"${value:.4f}")


def fmt_share(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"
