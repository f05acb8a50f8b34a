"""The one percentile definition (nearest rank) and its fixed-memory estimator.

The sketch against exact nearest-rank percentiles on random samples from 1 µs to
100 s and on the shipped traces; memory after 10^6 samples; the dashboard's
figures after a replay to the end, and after seeking back, against the trace's own.
"""

from __future__ import annotations

import asyncio
import glob
import math
import os
import random
import re
import tracemalloc

import pytest

from kvscope.quantiles import QuantileSketch, nearest_rank, percentile
from kvscope.traces.reader import TraceReader
from kvscope.tui import fmt
from kvscope.tui.model.histogram import LogHistogram

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = sorted(glob.glob(os.path.join(ROOT, "traces", "*.kvtrace")))
QS = [0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999]


def exact(xs: list[float], q: float) -> float:
    return sorted(xs)[nearest_rank(q, len(xs)) - 1]


def trace_samples(path: str) -> tuple[list[float], list[float]]:
    ttft, itl = [], []
    for ev in TraceReader(path):
        if ev.type == "step":
            ttft += [f.ttft for f in ev.first_tokens]
            itl += [s.gap for s in ev.itl]
    return ttft, itl


def test_nearest_rank_definition():
    xs = list(range(1, 11))
    assert [percentile(xs, p) for p in (0, 10, 50, 90, 91, 99, 100)] == [1, 1, 5, 9, 10, 10, 10]
    assert percentile([], 50) is None and percentile([3.0], 99) == 3.0
    # 0.07 * 100 is 7.000000000000001 in floating point: still rank 7.
    assert percentile(list(range(1, 101)), 7) == 7
    assert nearest_rank(0.5, 320) == 160 and nearest_rank(0.99, 320) == 317


@pytest.mark.parametrize("dist", ["log-uniform", "lognormal", "bimodal", "ties"])
def test_sketch_within_half_percent_of_exact(dist):
    rng = random.Random(dist)
    n = 20_000
    if dist == "log-uniform":  # 1 µs .. 100 s
        xs = [10 ** rng.uniform(-6, 2) for _ in range(n)]
    elif dist == "lognormal":
        xs = [math.exp(rng.gauss(math.log(0.02), 1.5)) for _ in range(n)]
    elif dist == "bimodal":
        xs = [rng.uniform(1e-6, 2e-6) if rng.random() < 0.7 else rng.uniform(50, 100) for _ in range(n)]
    else:
        xs = [rng.choice((0.001, 0.0123, 7.5)) for _ in range(n)]
    sk = QuantileSketch()
    sk.extend(xs)
    assert sk.n == n and math.isclose(sk.mean, sum(xs) / n)
    for q, v in zip(QS, sk.quantiles(QS)):
        want = exact(xs, q)
        assert abs(v - want) / want <= 0.005 + 1e-12, (q, v, want)
    assert sk.quantile(0.0) == min(xs) and sk.quantile(1.0) == max(xs)


@pytest.mark.parametrize("path", TRACES, ids=os.path.basename)
def test_sketch_on_recorded_traces(path):
    for xs in trace_samples(path):
        assert xs
        sk = QuantileSketch()
        sk.extend(xs)
        for p in range(1, 100):
            v, want = sk.percentile(p), percentile(xs, p)
            assert abs(v - want) / want <= 0.01, (path, p, v, want)


def test_memory_flat_after_a_million_samples():
    rng = random.Random(0)
    sk = QuantileSketch()
    size = len(sk._counts)
    values = [10 ** rng.uniform(-6, 2) for _ in range(10_000)]
    for _ in range(100):  # 10^6 samples
        for x in values:
            sk.add(x)
    # Then trace 10^5 more: anything kept per sample would show as growth.
    tracemalloc.start()
    before, _ = tracemalloc.get_traced_memory()
    for _ in range(10):
        for x in values:
            sk.add(x)
    after, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert sk.n == 1_100_000 and len(sk._counts) == size
    assert after - before < 4096


def test_merge_pack_copy_and_hostile_values():
    rng = random.Random(2)
    xs = [10 ** rng.uniform(-5, 1) for _ in range(3000)]
    a, b, whole = QuantileSketch(), QuantileSketch(), QuantileSketch()
    a.extend(xs[:1000])
    b.extend(xs[1000:])
    whole.extend(xs)
    c = a.copy()
    c.merge(b)
    assert c.quantiles(QS) == whole.quantiles(QS) and a.n == 1000
    d = QuantileSketch()
    d.unpack(whole.packed())
    assert d.quantiles(QS) == whole.quantiles(QS) and d.n == whole.n
    with pytest.raises(ValueError):
        a.merge(QuantileSketch(rel_err=0.01))
    h = QuantileSketch()
    for x in (float("nan"), 0.0, -1.0, float("inf"), 1e-12, 1e9):
        h.add(x)
    assert h.n == 5 and h.quantile(0.0) == -1.0 and h.quantile(1.0) == float("inf")
    assert QuantileSketch().percentiles() == (None, None, None)


def test_histogram_picture_bins_the_same_samples():
    h = LogHistogram(1e-4, 1e2, 6)
    xs = [1e-5, 0.002, 0.0021, 0.05, 0.5, 200.0]
    h.extend(xs)
    assert sum(h.counts) == len(xs) == h.n
    assert h.counts[0] == 1 and h.counts[-1] == 1 and h.counts[h.index(0.002)] == 2
    h.clear()
    h.add(0.05)
    assert sum(h.counts) == 1 and h.counts[h.index(0.05)] == 1


def test_latency_format_has_three_digits():
    assert [fmt.latency(x) for x in (2.3126, 0.0078, 0.01425, 0.000850, 0.9996, 12.34, None)] == [
        "2.31s", "7.80ms", "14.2ms", "850µs", "1.00s", "12.3s", "-"]


def _parse(text: str) -> float:
    m = re.fullmatch(r"([0-9.]+)(µs|ms|s)", text)
    assert m, text
    return float(m.group(1)) * {"µs": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]


def test_dashboard_figures_after_replay_to_the_end_and_seeking_back():
    """The shown p50/p90/p99 are the trace's own within 1%."""
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.sources.replay import ReplayController, open_trace
    from kvscope.tui.widgets import LatencyPanel

    path = os.path.join(ROOT, "traces", "demo-cpu.kvtrace")
    ttft, itl = trace_samples(path)
    want = {"TTFT": ttft, "ITL": itl}

    class Clock:
        t = 0.0

        def __call__(self) -> float:
            return self.t

    def latency_text(app) -> str:
        text = app.screen.query_one(LatencyPanel).render().plain
        # The histograms; the tok/s sparkline is the recent step history, which a restart rebuilds.
        return text[:text.index(" tok/s")]

    async def panels(play_to_end: bool, step: int) -> list[str]:
        clock = Clock()
        rc = ReplayController(open_trace(path), playing=False, clock=clock)
        app = KvscopeApp(rc, auto_tick=False)
        shown = []
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause()
            if play_to_end:  # play in trace time, fast, to the end
                await pilot.press("space")
                for _ in range(5):
                    rc.faster()
                while not rc.done:
                    clock.t += 10.0
                    app.pump()
                await pilot.pause()
                assert app.state.step == rc.last_step
                shown.append(latency_text(app))
            rc.seek(step)  # after the end: back, from a snapshot; from the start: forward
            app.pump()
            await pilot.pause()
            assert app.state.step == step
            shown.append(latency_text(app))
        return shown

    middle = 3001  # just past the snapshot at step 3000
    at_end, back = asyncio.run(panels(True, middle))
    (forward,) = asyncio.run(panels(False, middle))
    assert back == forward and back != at_end
    for name, xs in want.items():
        m = re.search(rf"{name}\s+▲p50 (\S+) ◆p90 (\S+) ●p99 (\S+) n={len(xs)}", at_end)
        assert m, at_end
        for p, shown in zip((50, 90, 99), m.groups()):
            truth = percentile(xs, p)
            assert abs(_parse(shown) - truth) / truth <= 0.01, (name, p, shown, truth)
