"""The `d` diagnosis panel: opens over the dashboard, judges the recent window, follows a burst."""

from __future__ import annotations

import asyncio
import functools

from fakes.sources import ListSource

from kvscope import workload as wl
from kvscope.protocol.sinks import ListSink as _ListSink
from kvscope.analysis.signals import StepLog
from kvscope.engine.config import EngineConfig
from kvscope.engine.llm_engine import LLMEngine
from kvscope.serve.driver import ServeOptions, Server
from kvscope.tui.app import KvscopeApp
from kvscope.tui.screens import DiagnosisScreen
from kvscope.tui.model.state import CONN_LIVE


def async_test(f):
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return asyncio.run(f(*args, **kwargs))

    return wrapper


def _quiet_then_burst() -> tuple[list, int]:
    """A sim engine with max_num_seqs 4: a trickle it serves easily, then a burst it must queue.

    Returns the events and the index where the burst's first request event is."""
    engine = LLMEngine(EngineConfig(backend="sim", model="llama-3.1-8b", gpu="h100-sxm5", max_num_seqs=4))
    sink = _ListSink()
    engine.attach(sink)
    vocab = engine.loaded.vocab_size - 1
    spec = wl.load_spec("chat")
    quiet = [wl.WorkloadRequest(arrival=i * 0.5, prompt=[5] * 64, max_tokens=16) for i in range(20)]
    burst = wl.make_burst(spec, 48, at=11.0, vocab_size=vocab, seed=1)
    Server(engine, ServeOptions(workload="chat", verbose_rejects=False)).run(quiet + burst)
    engine.close()
    at = next(i for i, e in enumerate(sink.events) if getattr(e, "type", "") == "request" and e.arrival >= 11.0)
    return sink.events, at


@async_test
async def test_d_opens_the_panel_and_the_verdict_follows_a_burst():
    events, at = _quiet_then_burst()
    source = ListSource(events[:at], connection=CONN_LIVE)
    app = KvscopeApp(source, mode="live", auto_tick=False)
    app.feeds[0].log = StepLog(window=400)  # the window the panel judges
    async with app.run_test(size=(100, 34)) as pilot:
        app.pump()
        await pilot.press("d")
        await pilot.pause()
        assert isinstance(app.screen, DiagnosisScreen)
        before = app.screen.diagnosis()
        assert before.bottleneck == "underloaded" and before.knobs == []
        assert "bottleneck: underloaded" in str(app.screen.query_one("#diagnosis-body").render())
        source.feed(events[at:])  # the burst: requests pile up behind max_num_seqs
        app.pump()
        app.screen.refresh_diagnosis()
        await pilot.pause()
        after = app.screen.diagnosis()
        assert after.bottleneck == "max_num_seqs"
        assert after.knobs[0].flag == "--max-num-seqs" and after.knobs[0].to > 4
        assert "--max-num-seqs 4 → 8" in str(app.screen.query_one("#diagnosis-body").render())
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, DiagnosisScreen)


@async_test
async def test_panel_before_any_step_says_so():
    app = KvscopeApp(ListSource([], connection=CONN_LIVE), mode="live", auto_tick=False)
    async with app.run_test(size=(100, 34)) as pilot:
        await pilot.press("d")
        await pilot.pause()
        assert "no steps yet" in str(app.screen.query_one("#diagnosis-body").render())
