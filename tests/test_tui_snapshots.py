"""SVG snapshots of the main screens from a deterministic sim-backend event stream.

Update with ``pytest tests/test_tui_snapshots.py --snapshot-update`` after a
deliberate visual change, and look at the report before committing.
"""

from __future__ import annotations

import pytest
from fakes.sources import ListSource, MemoryTrace
from fakes.streams import sim_stream

from kvscope.tui.app import KvscopeApp
from kvscope.tui.sources import ReplayController


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
