"""SVG snapshots of the main screens from a deterministic sim-backend event stream.

Update with ``pytest tests/test_tui_snapshots.py --snapshot-update`` after a
deliberate visual change, and look at the report before committing.
"""

from __future__ import annotations

import pytest
from fakes.sources import ListSource, MemoryTrace
from fakes.streams import sim_stream

from kvscope.tui.app import KvscopeApp
from kvscope.tui.sources.replay import ReplayController


@pytest.fixture(scope="module")
def events():
    return sim_stream(300, seed=3, bursts=(100, 200), bye=False)


def dashboard(events, **kw):
    return KvscopeApp(ListSource(events, connection="live"), mode="live", auto_tick=False, **kw)


def replay(events):
    rc = ReplayController(MemoryTrace(events), playing=False, clock=lambda: 0.0)
    return KvscopeApp(rc, auto_tick=False)


def test_dashboard_80x24(snap_compare, events):
    assert snap_compare(dashboard(events), terminal_size=(80, 24))


def test_dashboard_120x36_cb_palette(snap_compare, events):
    assert snap_compare(dashboard(events, palette="cb"), terminal_size=(120, 36), press=["down"])


def test_request_detail(snap_compare, events):
    assert snap_compare(dashboard(events), terminal_size=(100, 30), press=["down", "enter"])


def test_replay_80x24(snap_compare, events):
    assert snap_compare(replay(events), terminal_size=(80, 24), press=["right", "right", "p", "plus"])


def test_help(snap_compare, events):
    assert snap_compare(dashboard(events), terminal_size=(80, 24), press=["question_mark"])


def _with_slo(events, slo: str):
    """The same stream, its hello carrying an SLO (as `serve --slo` records it; docs/GOODPUT.md)."""
    from kvscope.goodput import parse_slo
    from kvscope.protocol.events import HelloEvent

    return [HelloEvent(ev.version, {**ev.config.as_dict(), **parse_slo(slo).to_wire()}, ev.wall_start)
            if isinstance(ev, HelloEvent) else ev for ev in events]


def test_request_detail_with_slo(snap_compare, events):
    """Header: goodput beside tok/s and the share meeting each target; the detail of a finished request
    that missed: which target, by how much."""
    from kvscope.tui.screens import RequestDetailScreen

    async def open_missed(pilot) -> None:
        feed = pilot.app.feeds[0]
        missed = next(r for r in feed.state.finished.values() if r.judgement is not None and not r.judgement.good)
        await pilot.app.push_screen(RequestDetailScreen(feed, missed.req))
        await pilot.pause()

    assert snap_compare(dashboard(_with_slo(events, "ttft:1000 tpot:9")), terminal_size=(120, 30),
                        run_before=open_missed)
