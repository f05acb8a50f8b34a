"""The one App: every screen's keys exist wherever it is pushed, and the keys that used to
depend on which App was running (space, d, Enter, the health counters) work on every screen."""

from __future__ import annotations

import inspect
import os

import pytest
from textual.binding import Binding

from tests.fakes.streams import ChunkedSource, drained_sim_stream

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ bindings
def _screen_classes():
    import kvscope.tui.screens as screens_pkg
    from kvscope.tui.screens import compare, dashboard, detail, diagnosis, help, overview, seek, vllm
    from textual.screen import Screen

    out = set()
    for mod in (screens_pkg, compare, dashboard, detail, diagnosis, help, overview, seek, vllm):
        for _, obj in inspect.getmembers(mod, inspect.isclass):
            if issubclass(obj, Screen) and obj.__module__.startswith("kvscope.tui"):
                out.add(obj)
    return sorted(out, key=lambda c: c.__name__)


def _bound_actions(cls):
    """(namespace, action name) of every binding a class and its bases declare."""
    for klass in cls.__mro__:
        for b in klass.__dict__.get("BINDINGS", []):
            action = b.action if isinstance(b, Binding) else b[1]
            name = action.split("(", 1)[0]
            ns, _, name = name.rpartition(".")
            yield ns, name


def test_there_is_one_app_class():
    import kvscope.tui as tui
    import pkgutil
    import importlib
    from textual.app import App

    apps = set()
    for info in pkgutil.walk_packages(tui.__path__, "kvscope.tui."):
        mod = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(mod, inspect.isclass):
            if issubclass(obj, App) and obj.__module__.startswith("kvscope.tui"):
                apps.add(obj)
    from kvscope.tui.app import KvscopeApp

    assert apps == {KvscopeApp}


@pytest.mark.parametrize("screen_cls", _screen_classes(), ids=lambda c: c.__name__)
def test_every_bound_action_exists(screen_cls):
    """A key whose action is missing only logs in Textual: here it fails, for every screen the App can push."""
    from kvscope.tui.app import KvscopeApp

    seen = list(_bound_actions(screen_cls))
    assert seen, f"{screen_cls.__name__} binds nothing"
    for ns, name in seen:
        target = KvscopeApp if ns == "app" else screen_cls
        assert ns in ("", "app", "screen"), (screen_cls, ns, name)
        assert callable(getattr(target, f"action_{name}", None)), f"{screen_cls.__name__}: {ns or 'screen'}.{name}"
    for ns, name in _bound_actions(KvscopeApp):
        assert callable(getattr(KvscopeApp, f"action_{name}", None)), name


def test_no_screen_or_widget_probes_the_app():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1] / "kvscope" / "tui"
    probe = re.compile(r"\b(getattr|hasattr)\(\s*self\.app\b")
    for path in list((root / "screens").glob("*.py")) + list((root / "widgets").glob("*.py")):
        assert not probe.search(path.read_text()), path


# ------------------------------------------------------------------ the overview's engines
@pytest.fixture(scope="module")
def stream():
    return drained_sim_stream(5, requests=32)


def _overview(stream, n=3):
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.feeds import LiveFeed

    feeds = [LiveFeed(ChunkedSource(stream, per_poll=40), name=f"engine-{i}") for i in range(n)]
    return KvscopeApp(feeds, first="overview", auto_tick=False), feeds


async def _open(app, pilot, row: int):
    from kvscope.tui.screens.overview import EngineDashboard

    app.screen.query_one("#overview-table").move_cursor(row=row)
    await pilot.press("enter")
    await pilot.pause()
    assert isinstance(app.screen, EngineDashboard)


def _header(app) -> str:
    from kvscope.tui.widgets import HeaderBar

    return app.screen.query_one(HeaderBar).render().plain


@pytest.mark.anyio
async def test_space_pauses_and_resumes_an_engine_opened_from_the_overview(stream):
    app, feeds = _overview(stream)
    async with app.run_test(size=(100, 30)) as pilot:
        for _ in range(3):
            app.pump()
        await pilot.pause()
        await _open(app, pilot, 1)
        feed = app.screen.feed
        await pilot.press("space")
        app.pump()
        await pilot.pause()
        assert feed.source.requests[-1] == "pause" and feed.paused and app.engine_paused
        assert "paused" in _header(app)
        await pilot.press("space")
        app.pump()
        await pilot.pause()
        assert feed.source.requests[-1] == "resume" and not feed.paused
        assert "paused" not in _header(app)
        others = [f for f in feeds if f is not feed]
        assert all(not f.source.requests for f in others), "only the engine on screen is steered"


@pytest.mark.anyio
async def test_enter_opens_request_detail_from_an_overview_dashboard(stream):
    from kvscope.tui.screens import RequestDetailScreen

    app, feeds = _overview(stream)
    async with app.run_test(size=(100, 30)) as pilot:
        while not feeds[0].state.running:  # to the first step with requests running
            assert app.pump(), "the stream ran out before any request ran"
        await pilot.pause()
        await _open(app, pilot, 0)
        feed = app.screen.feed
        assert feed is feeds[0] and feed.state.running
        await pilot.press("down", "up")  # move the cursor: the first running request
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, RequestDetailScreen)
        assert app.screen.feed is feed and app.screen.req == feed.state.running[0]
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen.feed is feed


@pytest.mark.anyio
async def test_d_opens_diagnosis_from_the_overview_and_its_engines(stream):
    from kvscope.tui.screens import DiagnosisScreen

    app, feeds = _overview(stream)
    async with app.run_test(size=(100, 34)) as pilot:
        for _ in range(30):
            app.pump()
        await pilot.pause()
        await pilot.press("d")
        await pilot.pause()
        assert isinstance(app.screen, DiagnosisScreen) and app.screen.feed is feeds[0]
        assert "bottleneck:" in str(app.screen.query_one("#diagnosis-body").render())
        await pilot.press("escape")
        await pilot.pause()
        await _open(app, pilot, 2)
        await pilot.press("d")
        await pilot.pause()
        assert isinstance(app.screen, DiagnosisScreen) and app.screen.feed is feeds[2]


@pytest.mark.anyio
async def test_overview_engines_count_drops_and_malformed_and_resync_when_stale(stream):
    from kvscope.protocol.events import StepEvent

    events = list(stream)
    k = next(i for i, ev in enumerate(events) if type(ev) is StepEvent and ev.step == 10)
    events[k] = type(events[k])(**{**{f: getattr(events[k], f) for f in events[k].__struct_fields__}, "dropped": 4})
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.feeds import LiveFeed

    sick = ChunkedSource(events, per_poll=40)
    well = ChunkedSource(stream, per_poll=40)
    feeds = [LiveFeed(sick, name="sick"), LiveFeed(well, name="well")]
    app = KvscopeApp(feeds, first="overview", auto_tick=False)
    async with app.run_test(size=(100, 30)) as pilot:
        sick.dropped_locally, sick.malformed = 3, 2
        for _ in range(2):
            app.pump()
        await pilot.pause()
        h = feeds[0].health()
        assert h.dropped == 4 + 3 and h.malformed == 2 and h.stale
        assert "snapshot" in sick.requests, "a stale engine asks for a snapshot"
        assert feeds[1].health() == type(h)("live", 0, 0, False) and "snapshot" not in well.requests
        rows = {str(r[0]).split()[1]: str(r[0]) for r in
                (app.screen.query_one("#overview-table").get_row(name) for name in ("sick", "well"))}
        assert rows["sick"].endswith("⚠") and not rows["well"].endswith("⚠")
        await _open(app, pilot, 0)
        assert "drop 7" in _header(app) and "bad 2" in _header(app)


# ------------------------------------------------------------------ compare and vLLM
VLLM_TRACE = "traces/vllm/kvscope-as-vllm.kvtrace"


@pytest.mark.anyio
async def test_vllm_replay_steps_one_tick_and_d_diagnoses_it():
    import os

    from kvscope.tui.launch import make_replay_app
    from kvscope.tui.screens import DiagnosisScreen
    from kvscope.tui.screens.vllm import VllmReplayScreen

    path = os.path.join(os.path.dirname(__file__), "..", VLLM_TRACE)
    app = make_replay_app(path, playing=False, auto_tick=False)
    src = app.feeds[0].source
    async with app.run_test(size=(100, 30), notifications=True) as pilot:
        await pilot.pause()
        assert isinstance(app.screen, VllmReplayScreen)
        assert src.step == src.steps[0]
        await pilot.press("right")
        assert src.step == src.steps[1], "→ is one recorder tick, as it is one step in a kvscope replay"
        await pilot.press("left")
        assert src.step == src.steps[0]
        await pilot.press("shift+end")  # every scrape of the recording in the view
        await pilot.pause()
        await pilot.press("d")
        await pilot.pause()
        assert isinstance(app.screen, DiagnosisScreen)
        d = app.feeds[0].diagnose()  # what the panel shows: the verdict `kvscope diagnose` gives a recorded vLLM
        assert d is not None and d.vllm is not None
        body = str(app.screen.query_one("#diagnosis-body").render())
        assert d.bottleneck in body


@pytest.mark.anyio
async def test_the_palette_s_screenshot_is_saved_where_the_app_started(tmp_path, monkeypatch):
    """Ctrl+P, "Screenshot", Enter, as a user does: an SVG of the screen lands in the working folder (Textual's
    default, the desktop's Downloads folder, is missing on a server) and a toast says where."""
    from kvscope.tui.launch import make_replay_app

    monkeypatch.chdir(tmp_path)
    app = make_replay_app(os.path.join(ROOT, "traces", "demo-cpu.kvtrace"), playing=False)
    async with app.run_test(size=(100, 30), notifications=True) as pilot:
        await pilot.pause()
        await pilot.press("ctrl+p")
        await pilot.pause()
        for ch in "Screenshot":
            await pilot.press(ch)
        await pilot.pause(0.3)
        await pilot.press("enter")
        for _ in range(50):
            await pilot.pause(0.1)
            if list(tmp_path.glob("*.svg")):
                break
        (shot,) = tmp_path.glob("*.svg")
        await pilot.pause(0.2)
        messages = [n.message for n in app._notifications]
    assert shot.read_text(encoding="utf-8").lstrip().startswith("<svg") and "kvscope" in shot.read_text()
    assert any("Saved screenshot to" in m and str(shot) in m for m in messages), messages
