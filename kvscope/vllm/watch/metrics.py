"""vLLM's Prometheus metrics, read with prometheus_client's own parser, turned into a view.

Gauges are shown as scraped (summed over the `engine` label: data-parallel ranks).
Counters become rates, and histograms become bucket deltas, over a sliding window of
scrapes. Percentiles come from those deltas by linear interpolation inside the bucket
that holds the rank, as Prometheus' histogram_quantile does: they are estimates, and the
screen says so.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from dataclasses import dataclass, field

from kvscope.errors import KvscopeError

MAX_TEXT_BYTES = 8 << 20
PREFIX = "vllm:"
INFO_SKIP = ("model_name", "engine")  # an info gauge's labels kept as "key=value" (these are on every series)
MAX_INFO_LABELS = 256
MAX_INFO_CHARS = 200  # the protocol's name length


class MetricsError(KvscopeError):
    """Metric text that cannot be read (one line)."""


@dataclass
class Scrape:
    t: float  # wall seconds
    gauges: dict[str, float] = field(default_factory=dict)
    # gauge -> reason -> value; an info gauge (name ending _info) -> "key=value" -> 1
    by_label: dict[str, dict[str, float]] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)  # name without _total; histogram sums as NAME_sum
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # cumulative (le, count)
    skipped: int = 0  # malformed or unknown samples
    model: str | None = None  # the first model_name label seen


def parse(text: str, t: float) -> Scrape:
    """One /metrics body to a Scrape (only `vllm:` families are kept)."""
    from prometheus_client.parser import text_string_to_metric_families

    if len(text) > MAX_TEXT_BYTES:
        raise MetricsError(f"metrics text of {len(text)} bytes is over the {MAX_TEXT_BYTES}-byte limit")
    scrape = Scrape(t)
    buckets: dict[str, dict[float, float]] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as e:  # the parser raises ValueError and friends on bad lines
        raise MetricsError(f"not Prometheus text: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}") \
            from None
    for fam in families:
        if not fam.name.startswith(PREFIX):
            continue
        name = fam.name[len(PREFIX):]
        for s in fam.samples:
            value = s.value
            if scrape.model is None and "model_name" in s.labels:
                scrape.model = str(s.labels["model_name"])[:256]
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                scrape.skipped += 1  # NaN and ±Inf are valid Prometheus text, but no count, rate or gauge
                continue
            if fam.type == "gauge":
                scrape.gauges[name] = scrape.gauges.get(name, 0.0) + value
                if name.endswith("_info"):  # an info gauge (cache_config_info): its labels are the data
                    info = scrape.by_label.setdefault(name, {})
                    for k, v in s.labels.items():
                        if k not in INFO_SKIP and len(info) < MAX_INFO_LABELS:
                            info[f"{k}={v}"[:MAX_INFO_CHARS]] = 1.0
                    continue
                label = s.labels.get("reason")
                if label is not None:
                    scrape.by_label.setdefault(name, {})
                    scrape.by_label[name][label] = scrape.by_label[name].get(label, 0.0) + value
            elif fam.type == "counter" and s.name.endswith("_total"):
                scrape.counters[name] = scrape.counters.get(name, 0.0) + value
            elif fam.type == "histogram" and s.name.endswith("_sum"):
                key = name + "_sum"  # kept with the counters: a mean per observation is a delta of both
                scrape.counters[key] = scrape.counters.get(key, 0.0) + value
            elif fam.type == "histogram" and s.name.endswith("_bucket"):
                try:
                    le = float(s.labels["le"])
                except (KeyError, ValueError):
                    le = math.nan
                if not (math.isfinite(le) or le == math.inf):  # +Inf is the last bucket; NaN, -Inf are not bounds
                    scrape.skipped += 1
                    continue
                per = buckets.setdefault(name, {})
                per[le] = per.get(le, 0.0) + value
    for name, per in buckets.items():
        scrape.buckets[name] = sorted(per.items())
    return scrape


def info_labels(kept: dict[str, float]) -> dict[str, str]:
    """The labels of an info gauge as parse() keeps them ("key=value" -> 1) back to key -> value."""
    out = {}
    for kv in kept:
        k, _, v = kv.partition("=")
        out[k] = v
    return out


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """histogram_quantile over cumulative (le, count) pairs; None when empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lo_bound, lo_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lo_bound  # the rank is past the last finite bucket: its bound is all we know
            width = count - lo_count
            frac = (rank - lo_count) / width if width > 0 else 1.0
            return lo_bound + (le - lo_bound) * frac
        lo_bound, lo_count = le, count
    return lo_bound


@dataclass
class MetricsView:
    """The last scrape plus a window of earlier ones, for rates and bucket deltas."""

    window_s: float = 30.0
    scrapes: deque = field(default_factory=lambda: deque(maxlen=512))
    errors: int = 0
    last_error: str | None = None

    def add(self, scrape: Scrape) -> None:
        self.scrapes.append(scrape)
        while len(self.scrapes) > 2 and self.scrapes[1].t < scrape.t - self.window_s:
            self.scrapes.popleft()

    def copy(self) -> "MetricsView":
        """A view with its own list of scrapes (the scrapes themselves never change once parsed)."""
        view = copy.copy(self)
        view.scrapes = deque(self.scrapes, maxlen=self.scrapes.maxlen)
        return view

    def fail(self, message: str) -> None:
        self.errors += 1
        self.last_error = message

    @property
    def last(self) -> Scrape | None:
        return self.scrapes[-1] if self.scrapes else None

    def info(self, name: str = "cache_config_info") -> dict[str, str]:
        """An info gauge's labels from the last scrape that had it (cache_config_info: vLLM's CacheConfig)."""
        for s in reversed(self.scrapes):
            if name in s.by_label:
                return info_labels(s.by_label[name])
        return {}

    def gauge(self, name: str, *aliases: str) -> float | None:
        s = self.last
        if s is None:
            return None
        for n in (name, *aliases):
            if n in s.gauges:
                return s.gauges[n]
        return None

    def rate(self, name: str) -> float | None:
        if len(self.scrapes) < 2:
            return None
        a, b = self.scrapes[0], self.scrapes[-1]
        if name not in b.counters or b.t <= a.t:
            return None
        delta = b.counters[name] - a.counters.get(name, 0.0)
        r = max(0.0, delta) / (b.t - a.t)  # a counter reset reads as 0, not negative
        return r if math.isfinite(r) else None  # two huge finite values can still overflow

    def hit_rate(self) -> float | None:
        if len(self.scrapes) < 2:
            return None
        a, b = self.scrapes[0], self.scrapes[-1]
        q = b.counters.get("prefix_cache_queries", 0.0) - a.counters.get("prefix_cache_queries", 0.0)
        h = b.counters.get("prefix_cache_hits", 0.0) - a.counters.get("prefix_cache_hits", 0.0)
        return h / q if q > 0 else None

    def preempted(self) -> tuple[float, float, float] | None:
        """vLLM's per-request preemption histogram (`vllm:request_num_preemptions`, vLLM 0.32 on) over the
        window: (finished requests, their preemptions, those preempted more than once); None without it.
        Its first bucket is le=1, so "at least once" is not in it: a mean per request and "twice or more" are."""
        name = "request_num_preemptions"
        b = self.window_buckets(name)
        if not b:
            return None
        finished = b[-1][1]
        first, last = self.scrapes[0], self.scrapes[-1]
        total = last.counters.get(name + "_sum", 0.0) - (first.counters.get(name + "_sum", 0.0)
                                                         if len(self.scrapes) > 1 else 0.0)
        at_most_once = next((c for le, c in b if le >= 1.0), finished)
        out = (finished, max(0.0, total), max(0.0, finished - at_most_once))
        return out if all(map(math.isfinite, out)) else None

    def window_buckets(self, name: str) -> list[tuple[float, float]]:
        """Cumulative bucket counts added over the window (all since start with one scrape)."""
        if not self.scrapes:
            return []
        b = self.scrapes[-1].buckets.get(name, [])
        if len(self.scrapes) < 2:
            return list(b)
        a = dict(self.scrapes[0].buckets.get(name, []))
        return [(le, d) for le, c in b if math.isfinite(d := max(0.0, c - a.get(le, 0.0)))]

    def percentiles(self, name: str) -> tuple[float | None, float | None, float | None]:
        b = self.window_buckets(name)
        return quantile(b, 0.5), quantile(b, 0.9), quantile(b, 0.99)
