"""The five figures a diagnosis compares runs by, and the one percentile rule they use.

``RunFigures`` is what a knob's ``baseline`` and ``predicted`` carry, and what the
trace's own run is summarised as, computed the same way as ``kvscope serve``'s
summary: output tokens over (last finish - first arrival), nearest-rank percentiles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import msgspec

from kvscope.quantiles import nearest_rank

if TYPE_CHECKING:  # imported where it is used, so importing this module stays cheap
    import numpy as np


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]), exact, by the one rule (kvscope.quantiles, docs/QUANTILES.md)."""
    n = len(values)
    if n == 0:
        return None
    rank = nearest_rank(q / 100, n)
    import numpy as np

    arr = np.asarray(values, dtype=float)
    return float(np.partition(arr, rank - 1)[rank - 1])


class RunFigures(msgspec.Struct, kw_only=True, omit_defaults=True):  # no SLO: no goodput keys
    output_tok_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p99_s: float | None
    preemptions: int
    # with an SLO (docs/GOODPUT.md): good requests' output tokens over the same span, and their share
    goodput_tok_per_s: float | None = None
    slo_attainment: float | None = None


def run_figures(ttft: Sequence[float], itl: Sequence[float], output_tokens: int, first_arrival: float | None,
                last_finish: float | None, preemptions: int, goodput=None) -> RunFigures:
    """``goodput``: a GoodputTally over the same requests (kvscope.goodput), when an SLO is set."""
    span = (last_finish or 0.0) - (first_arrival or 0.0)
    good = goodput.figures(span) if goodput is not None and goodput.slo else None
    return RunFigures(
        output_tok_per_s=output_tokens / span if span > 0 else 0.0,
        ttft_p50_s=percentile(ttft, 50),
        ttft_p99_s=percentile(ttft, 99),
        itl_p99_s=percentile(itl, 99),
        preemptions=preemptions,
        goodput_tok_per_s=good.goodput_tok_per_s if good is not None else None,
        slo_attainment=good.attainment if good is not None else None,
    )


def relative_change(new: float | None, old: float | None) -> float | None:
    """(new - old) / old, or None when either is missing or old is 0."""
    if new is None or old is None or old == 0:
        return None
    return (new - old) / old
