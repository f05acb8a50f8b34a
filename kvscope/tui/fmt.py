"""Small text formatters shared by the widgets."""

from __future__ import annotations


def dur(seconds: float | None) -> str:
    """A duration in at most 5 characters: 850µs, 12ms, 1.2s, 12s, 3m05."""
    if seconds is None:
        return "-"
    s = float(seconds)
    if s != s:  # NaN: no duration at all
        return "-"
    if s < 0:
        s = 0.0
    if s >= 3.6e9:  # a million hours and more (a hostile trace, +Inf): no digits to spell out
        return ">1e6h"
    if s < 1e-3:
        return f"{s * 1e6:.0f}µs"
    if s < 1.0:
        return f"{s * 1e3:.0f}ms"
    if s < 10.0:
        return f"{s:.1f}s"
    if s < 60.0:
        return f"{s:.0f}s"
    if s < 3600.0:
        m, r = divmod(int(s), 60)
        return f"{m}m{r:02d}"
    h, r = divmod(int(s), 3600)
    return f"{h}h{r // 60:02d}"


def latency(seconds: float | None) -> str:
    """A latency figure to three significant digits (the sketch is within 0.5%): 850µs, 7.80ms, 2.31s, 12.3s."""
    if seconds is None:
        return "-"
    s = max(0.0, float(seconds))
    if s == 0.0:
        return "0µs"
    for scale, unit, limit in ((1e6, "µs", 1e-3), (1e3, "ms", 1.0), (1.0, "s", 60.0)):
        if s < limit:
            v = float(f"{s * scale:.3g}")  # round first: 999.7µs is 1.00ms
            if v < 1000.0 and (unit != "s" or v < 60.0):
                decimals = 2 if v < 10 else 1 if v < 100 else 0
                return f"{v:.{decimals}f}{unit}"
    return dur(s)


def rate(x: float) -> str:
    """A rate in a few characters: 950, 1.2k, 12k, 1.2M."""
    if x < 0:
        x = 0.0
    if x < 10:
        return f"{x:.1f}"
    if x < 1000:
        return f"{x:.0f}"
    if x < 10_000:
        return f"{x / 1e3:.1f}k"
    if x < 1_000_000:
        return f"{x / 1e3:.0f}k"
    return f"{x / 1e6:.1f}M"


def pct(x: float) -> str:
    return f"{100.0 * x:.0f}%" if x >= 0.1 or x == 0 else f"{100.0 * x:.1f}%"
