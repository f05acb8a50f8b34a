"""Panels of the vLLM view: queues and rates from /metrics, latency from its histograms, the prefix cache.

Each panel draws from a VllmState copy handed to ``show``; labels say what vLLM gives
and what it does not (counts, not per-request queues; cache blocks by hash, not slots).
"""

from __future__ import annotations

import math

from rich.text import Text

from kvscope.tui import fmt
from kvscope.tui.widgets.base import StateWidget, join_lines


def _finite(v: float | None) -> float | None:
    """A value as drawn: a server (or a trace) may send NaN or ±Inf, which no bar or number can show."""
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def _num(v: float | None, f=fmt.rate) -> str:
    v = _finite(v)
    return "-" if v is None else f(v)


class VllmHeader(StateWidget):
    def render(self) -> Text:
        st, pal = self.state, self.pal
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(" vLLM ", style="bold reverse")
        if st is None:
            return t
        if st.replay is not None:
            r = st.replay
            mark = "■ end" if r.done else ("▶" if r.playing else "❚❚")
            t.append(f" replay {r.name}  {mark} {r.speed:g}×  {fmt.dur(r.t)} / {fmt.dur(r.t_total)}  "
                     f"tick {r.tick}/{r.last_tick} ", style=f"bold {pal.warn}")
        if st.url:
            err = st.metrics.last_error
            t.append(f" {st.url} ", style=f"bold {pal.bad}" if err else "bold")
            t.append("● " if not err and st.metrics.last else "○ ", style=pal.bad if err else pal.ok)
        if st.kv_addr:
            bound = getattr(st, "kv_bound", False) and not st.kv_addr.startswith("bind:")
            t.append(f" kv {st.kv_addr}{' (bound here: vLLM connects)' if bound else ''} ", style=pal.dim)
        if st.metrics.last_error:
            t.append(f" {st.metrics.last_error}", style=pal.bad)
        elif st.kv.last_error:
            t.append(f" {st.kv.last_error}", style=pal.warn)
        return t


class VllmQueues(StateWidget):
    """running / waiting (by reason), KV use, preemption rate, token rates, prefix-cache hit rate."""

    def render(self) -> Text:
        st, pal = self.state, self.pal
        lines = [Text(" QUEUES & RATES (from /metrics: counts, not per-request queues)", style="bold")]
        if st is None or st.metrics.last is None:
            lines.append(Text(" waiting for the first scrape", style=pal.dim))
            return join_lines(lines)
        m = st.metrics
        running = m.gauge("num_requests_running")
        waiting = m.gauge("num_requests_waiting")
        kv = _finite(m.gauge("kv_cache_usage_perc", "gpu_cache_usage_perc"))
        ln = Text(" ")
        ln.append(f"running {_num(running, lambda v: f'{v:.0f}')}", style="bold")
        ln.append(f"   waiting {_num(waiting, lambda v: f'{v:.0f}')}", style="bold")
        reasons = m.last.by_label.get("num_requests_waiting_by_reason", {})
        if reasons:
            ln.append("  (" + ", ".join(f"{k} {_num(v, lambda x: f'{x:.0f}')}" for k, v in sorted(reasons.items()))
                      + ")", style=pal.dim)
        lines.append(ln)
        ln = Text(" KV cache ")
        if kv is not None:
            width = 20
            filled = int(round(min(1.0, max(0.0, kv)) * width))  # a usage past 1 (up to 1.8e308) fills the bar
            ln.append("█" * filled, style=pal.bad if kv > 0.95 else pal.ok)
            ln.append("·" * (width - filled), style=pal.dim)
            ln.append(f" {fmt.pct(kv)}")
        else:
            ln.append("-")
        lines.append(ln)
        pre = m.rate("num_preemptions")
        lines.append(Text(f" preemptions/s {_num(pre)}   prompt tok/s {_num(m.rate('prompt_tokens'))}   "
                          f"generation tok/s {_num(m.rate('generation_tokens'))}"))
        per = m.preempted()
        if per is not None:  # vllm:request_num_preemptions, where the server has it
            finished, total, twice = per
            mean = f"{total / finished:.2f}" if finished else "-"
            lines.append(Text(f" finished requests {finished:.0f}: preemptions per request {mean}, "
                              f"preempted twice or more {twice:.0f}", style=pal.dim))
        hit = _finite(m.hit_rate())
        lines.append(Text(f" prefix-cache hit rate {fmt.pct(hit) if hit is not None else '-'}   "
                          f"(over the last {m.window_s:.0f} s)", style=pal.dim))
        return join_lines(lines)


class VllmLatency(StateWidget):
    """TTFT and ITL percentiles from histogram bucket deltas, with the buckets drawn on a log axis."""

    FAMILIES = (("TTFT", "time_to_first_token_seconds"), ("ITL", "inter_token_latency_seconds"))

    def render(self) -> Text:
        st, pal = self.state, self.pal
        width = max(20, self.size.width)
        lines = [Text(" LATENCY (vLLM histograms; percentiles interpolated within buckets)", style="bold")]
        if st is None or st.metrics.last is None:
            return join_lines(lines)
        m = st.metrics
        for label, name in self.FAMILIES:
            fam = name if name in m.last.buckets else name.replace("inter_token_latency", "time_per_output_token")
            p50, p90, p99 = (_finite(p) for p in m.percentiles(fam))
            ln = Text(f" {label:<5}", style="bold")
            ln.append(f"p50 {fmt.dur(p50)}  ", style=pal.p50)
            ln.append(f"p90 {fmt.dur(p90)}  ", style=pal.p90)
            ln.append(f"p99 {fmt.dur(p99)}", style=pal.p99)
            lines.append(ln)
            lines.append(self._bars(m.window_buckets(fam), width - 2))
        return join_lines(lines)

    def _bars(self, buckets: list[tuple[float, float]], width: int) -> Text:
        """One cell per decade step of the bucket bounds, height = share of the window's samples."""
        pal = self.pal
        t = Text(" ", no_wrap=True, overflow="ellipsis")
        # a bound may be +Inf (the last bucket); a count that is not finite cannot be drawn: left out
        buckets = [(le, c) for le, c in buckets if _finite(c) is not None and (_finite(le) is not None or le == math.inf)]
        if not buckets or buckets[-1][1] <= 0:
            t.append("no samples in the window", style=pal.dim)
            return t
        total = buckets[-1][1]
        prev = 0.0
        cells = []
        for le, c in buckets:
            n = c - prev  # two counts near ±1.8e308 differ by more than a float holds: drawn as none
            cells.append((le, n if 0.0 < n < math.inf else 0.0))
            prev = c
        peak = max(n for _, n in cells) or 1.0
        glyphs = " ▁▂▃▄▅▆▇█"
        for le, n in cells[: max(1, width // 2)]:
            g = glyphs[min(8, int(math.ceil(n / peak * 8)))] if n else "·"  # n / peak first: 8 * 1e308 overflows
            t.append(g * 2, style=pal.bar if n else pal.dim)
        bound = lambda le: "+Inf" if math.isinf(le) else fmt.dur(le)  # noqa: E731
        t.append(f"  ≤{bound(cells[0][0])} … {bound(cells[-1][0])}"
                 f", {total:.0f} samples" if total < 1e15 else f", {total:.3g} samples", style=pal.dim)
        return t


class VllmCache(StateWidget):
    """Cached blocks by hash (from KV events): per medium, rates, churn, prefix-tree shape."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.top: list = []  # refreshed by the app at most once a second (it walks every block)

    def render(self) -> Text:
        st, pal = self.state, self.pal
        lines = [Text(" PREFIX CACHE (KV events: blocks by hash, not physical slots)", style="bold")]
        if st is None or not st.kv_addr:
            lines.append(Text(" no --kv-events address given", style=pal.dim))
            return join_lines(lines)
        c, kv = st.cache, st.kv
        media = ", ".join(f"{k} {v}" for k, v in sorted(c.per_medium.items()) if v) or "none"
        lines.append(Text(f" cached blocks {c.cached_blocks}  ({media})", style="bold"))
        stored, removed = c.rates()
        lines.append(Text(f" stored/s {fmt.rate(stored)}  removed/s {fmt.rate(removed)}  churn {fmt.pct(c.churn())}"
                          f"  cleared {c.cleared}"))
        lines.append(Text(f" prefix tree: {c.roots} roots, depth ≤ {c.max_depth}", style=""))
        for h, depth, conts in self.top:
            label = h.hex()[:12] if isinstance(h, bytes) else str(h)[:12]
            lines.append(Text(f"   {label:<12} depth {depth:<4} {conts} continuations", style=pal.dim))
        lines.append(Text(f" batches {kv.received} live + {kv.replayed} replayed · gaps {kv.gaps} · "
                          f"missed {kv.missed} · malformed {kv.malformed} · unknown events {c.unknown_events}"
                          + (f" · seq resets {kv.resets}" if getattr(kv, "resets", 0) else ""),
                          style=pal.dim))
        return join_lines(lines)
