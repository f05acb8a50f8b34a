"""Pilot tests of the Textual app: replay keys, navigation, screens, live mode with fakes."""

from __future__ import annotations

import asyncio
import collections
import functools
import threading
import time

import pytest
from _helpers import DEADLINE_S
from fakes.sources import ListSource, MemoryTrace
from fakes.streams import SimRun, sim_stream

from kvscope.protocol import decode, encode
from kvscope.protocol.events import StepEvent
from kvscope.tui.app import KvscopeApp
from kvscope.tui.feeds import ReplayFeed
from kvscope.tui.model.player import Player
from kvscope.tui.palette import CB
from kvscope.tui.screens import HelpScreen, RequestDetailScreen, SeekScreen
from kvscope.tui.sources.live import LiveSource
from kvscope.tui.sources.replay import ReplayController
from kvscope.tui.model.state import CONN_CONNECTING, CONN_DISCONNECTED, CONN_LIVE
from kvscope.tui.widgets import BlockMap, HeaderBar, QueueTable


def async_test(f):
    """Run an async test on a fresh asyncio loop (no pytest async plugin needed)."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return asyncio.run(f(*args, **kwargs))

    return wrapper


class FixedClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def events():
    return sim_stream(400, seed=3, bursts=(100,))


def replay_app(events, **kw):
    clock = FixedClock()
    rc = ReplayController(MemoryTrace(events), playing=False, clock=clock)
    player = Player([rc], playing=False, clock=clock)
    return KvscopeApp([ReplayFeed(rc)], player, auto_tick=False, **kw), rc, clock


def text_of(widget) -> str:
    return widget.render().plain


@async_test
async def test_replay_keys(events):
    app, rc, clock = replay_app(events)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert app.state.config.backend == "sim" and app.state.step == 0
        await pilot.press("right", "right", "right")
        assert rc.cur_step == app.state.step == 3
        await pilot.press("left")
        assert app.state.step == 2
        await pilot.press("p")
        first = rc.preempt_steps[0]
        assert app.state.step == first and app.state.preemption_count >= 1
        await pilot.press("p")
        assert app.state.step == rc.preempt_steps[1]
        await pilot.press("g")
        await pilot.pause()
        assert isinstance(app.screen, SeekScreen)
        await pilot.press("2", "5", "0", "enter")
        await pilot.pause()
        assert app.state.step == 250 and not isinstance(app.screen, SeekScreen)
        await pilot.press("g")
        await pilot.pause()
        await pilot.press(*"1.0s", "enter")  # a time
        await pilot.pause()
        assert rc.step_t[rc.steps.index(app.state.step)] <= 1.0 < rc.step_t[rc.steps.index(app.state.step) + 1]
        await pilot.press("left")  # back across a snapshot boundary: seek via the trace
        assert app.state.step == rc.steps[rc.steps.index(rc.cur_step)] and not app.state.stale
        player = app.player
        await pilot.press("plus")
        assert player.speed == 2.0
        await pilot.press("minus", "minus")
        assert player.speed == 0.5
        for _ in range(12):
            player.faster()
        assert player.speed == 100.0
        for _ in range(12):
            player.slower()
        assert player.speed == 0.1
        for _ in range(6):
            player.faster()
        assert player.speed == 10.0
        await pilot.press("space")
        assert player.playing
        clock.t += 1.0  # 10 s of trace time: to the end
        app.pump()
        assert app.state.step == rc.last_step and player.status().done and app.state.ended == "drained"
        await pilot.press("space")  # at the end, space restarts from the top
        assert player.playing and app.state.step <= rc.first_step
        # big jumps: a tenth of the trace, then the ends
        await pilot.press("space", "shift+end")
        assert app.state.step == rc.last_step
        await pilot.press("shift+home", "shift+right")
        tenth = player.status()
        assert rc.first_step < app.state.step < rc.last_step and tenth.t > tenth.start_t
        await pilot.press("shift+left")
        assert player.status().t == tenth.start_t


@async_test
async def test_navigation_detail_and_help(events):
    app, rc, _ = replay_app(events)
    async with app.run_test(size=(80, 24)) as pilot:
        rc.seek(200)
        app.pump()
        await pilot.pause()
        running = app.query_one("#running", QueueTable)
        assert running.has_focus and running.ids == app.state.running
        await pilot.press("down")
        dash = app.screen
        assert dash.selected == app.state.running[1]
        blockmap = app.screen.query_one(BlockMap)
        assert blockmap.selected == dash.selected and "▣" in text_of(blockmap)
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, RequestDetailScreen) and app.screen.req == dash.selected
        await pilot.press("escape")
        await pilot.pause()
        await pilot.press("tab")  # to WAITING
        waiting = app.query_one("#waiting", QueueTable)
        assert waiting.has_focus
        assert "blocked" in text_of(waiting) or "admitted" in text_of(waiting)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("c")
        assert app.pal is CB
        titles = [c.title for c in app.get_system_commands(app.screen)]
        assert {"Next preemption", "Seek to step…", "Help"} <= set(titles)


@async_test
async def test_fits_80x24(events):
    app = KvscopeApp(ListSource(events[:-1]), auto_tick=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        for wid in ("header", "running", "waiting", "preempted", "blockmap", "batch", "latency"):
            w = app.screen.query_one(f"#{wid}")
            r = w.region
            assert r.width >= 30 and r.height >= 2, (wid, r)
            assert r.right <= 80 and r.bottom <= 23, (wid, r)


@async_test
async def test_repaints_are_coalesced():
    """Thousands of events a second, at most ~30 repaints a second."""
    eng = SimRun(seed=1, arrival_p=0.5)
    source = ListSource([eng.hello()], connection="live")
    fed = 1
    batches = [[ev for _ in range(50) for ev in eng.step()] for _ in range(60)]

    def produce():
        nonlocal fed
        for batch in batches:
            source.feed(batch)
            fed += len(batch)
            time.sleep(0.01)  # up to ~5,000 steps/s

    app = KvscopeApp(source)
    async with app.run_test(size=(80, 24)) as pilot:
        t = threading.Thread(target=produce, daemon=True)
        t0 = time.monotonic()
        r0 = app.repaints
        t.start()
        t.join()
        deadline = time.monotonic() + DEADLINE_S
        while app.events_applied < fed and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        elapsed = time.monotonic() - t0
        await pilot.pause()
    assert app.events_applied == fed  # every event applied, however fast they came
    assert (app.repaints - r0) <= 30 * elapsed + 3


# ------------------------------------------------------------------------------ live
class FakeEngine:
    """Stands in for an engine: a PUB queue the subscriber reads, and control replies.

    A real engine answers a snapshot between two steps; `lock` does the same here, so a snapshot
    asked for from the source's control thread never interleaves with a step the test publishes
    (when it did, a half-stepped snapshot left the view stale, and the fixed clock never let it ask again)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.eng = SimRun(seed=4, arrival_p=0.6)
        self.pub: collections.deque = collections.deque()
        self.up = True
        self.paused = False
        self.calls: list[str] = []

    def subscriber(self, addr):
        engine = self

        class Sub:  # the subscriber's frame interface, over the real codec
            def recv_frame(self, timeout_ms=100):
                if engine.pub:
                    return encode(engine.pub.popleft())
                time.sleep(min(timeout_ms, 5) / 1000)
                return None

            def decode_frame(self, data):
                return decode(data)

            def close(self):
                pass

        return Sub()

    def control(self, addr):
        engine = self

        class Ctl:
            def request(self, cmd, **args):
                engine.calls.append(cmd)
                if not engine.up:
                    return {"ok": False, "error": "timeout"}
                if cmd == "snapshot":
                    with engine.lock:
                        engine.pub.extend([engine.eng.hello(), engine.eng.snapshot()])
                        return {"ok": True, "step": engine.eng.done_step}
                if cmd in ("pause", "resume"):
                    engine.paused = cmd == "pause"
                    return {"ok": True, "paused": engine.paused}
                return {"ok": True}

            def close(self):
                pass

        return Ctl()

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def step(self) -> list:
        """One engine step, published; its events."""
        with self.lock:
            evs = self.eng.step()
            self.pub.extend(evs)
            return evs


async def wait_until(app, pilot, cond, timeout=DEADLINE_S):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        app.pump()
        if cond():
            return True
        await asyncio.sleep(0.02)
    return False


@async_test
async def test_live_mode_survives_late_start_drops_and_restart():
    fake = FakeEngine()
    clock = FixedClock()
    src = LiveSource("tcp://fake:1", "tcp://fake:2", subscriber_factory=fake.subscriber,
                     control_factory=fake.control, clock=clock, silence_s=2.0)
    fake.up = False  # the TUI starts first
    app = KvscopeApp(src, auto_tick=False, address="tcp://fake:1")
    try:
        async with app.run_test(size=(80, 24)) as pilot:
            app.pump()
            assert app.state.conn == CONN_CONNECTING
            assert "disconnected" in text_of(app.screen.query_one(HeaderBar))
            # the engine comes up mid-stream: we missed its hello
            fake.up = True
            with fake.lock:
                fake.eng.step()  # a step nobody saw
            fake.run(20)
            assert await wait_until(app, pilot, lambda: app.state.step > 0 and not app.state.stale)
            assert "snapshot" in fake.calls  # asked for one on first contact / while stale
            assert app.state.conn == CONN_LIVE and app.state.config.backend == "sim"
            # control keys
            await pilot.press("b", "l", "space")
            assert await wait_until(app, pilot, lambda: app.engine_paused)
            assert {"burst", "long", "pause"} <= set(fake.calls)
            assert "paused" in text_of(app.screen.query_one(HeaderBar))
            await pilot.press("space")
            assert await wait_until(app, pilot, lambda: not app.engine_paused)
            # dropped events: counter and stale until the next snapshot
            with fake.lock:
                evs = fake.eng.step()
                for ev in evs:
                    if isinstance(ev, StepEvent):
                        ev.dropped = 7
                fake.pub.extend(evs)
            assert await wait_until(app, pilot, lambda: app.state.dropped == 7)
            clock.t += 1.1  # snapshot requests are rate-limited to one a second
            assert await wait_until(app, pilot, lambda: not app.state.stale)  # resynced
            # the engine goes away: disconnected after 2 s of silence, last picture kept
            fake.up = False
            before = dict(app.state.requests)
            clock.t += 4.0  # no events and no control reply for longer than silence_s
            assert await wait_until(app, pilot, lambda: app.state.conn == CONN_DISCONNECTED)
            assert app.state.requests.keys() == before.keys()
            assert "disconnected" in text_of(app.screen.query_one(HeaderBar))
            # a new engine run: hello, snapshot at step 0, steps from 1
            fake.up = True
            with fake.lock:
                fake.eng = SimRun(seed=8)
                fake.pub.extend([fake.eng.hello(), fake.eng.snapshot()])
            clock.t += 0.1
            fake.run(5)
            assert await wait_until(app, pilot, lambda: app.state.conn == CONN_LIVE and app.state.step == 5)
            assert not app.state.stale and app.state.restarts >= 1
    finally:
        src.close()


@async_test
async def test_live_backlog_overflow_drops_the_oldest_and_counts_them():
    fake = FakeEngine()
    fake.up = True
    src = LiveSource("tcp://fake:1", None, subscriber_factory=fake.subscriber, max_backlog=10, start=False)
    fake.pub.extend([fake.eng.hello()] + [ev for _ in range(30) for ev in fake.eng.step()])
    sent = list(fake.pub)
    src.start()
    deadline = time.monotonic() + DEADLINE_S
    while src.received < len(sent) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    src.close()
    assert src.poll() == sent[-10:]  # the newest kept
    assert src.take_local_dropped() == len(sent) - 10


def _cells(app):
    """(char, fg, bg, bold, reverse) for every cell of the screen; fg of blanks ignored."""
    import io

    from rich.console import Console

    w, _ = app.size
    console = Console(width=w, file=io.StringIO(), force_terminal=True, color_system="truecolor")
    rows: list[list] = [[]]
    for seg in console.render(app.screen._compositor.render_update(full=True)):
        if seg.control:
            if rows[-1]:
                rows.append([])
            continue
        st = seg.style
        for ch in seg.text:
            fg = st.color.triplet if st and st.color and ch != " " else None
            bg = st.bgcolor.triplet if st and st.bgcolor else None
            rows[-1].append((ch, fg, bg, bool(st and st.bold), bool(st and st.reverse)))
    return rows


def test_fast_line_rendering_matches_textual(events):
    """The widgets' Strip fast path draws exactly what Textual's own path draws."""
    from kvscope.tui.widgets.base import StateWidget

    async def grid(fast: bool, keys):
        StateWidget.FAST_LINES = fast
        try:
            app = KvscopeApp(ListSource(events[:-1], connection="live"), mode="live", auto_tick=False)
            async with app.run_test(size=(90, 26)) as pilot:
                await pilot.pause()
                await pilot.press(*keys)
                await pilot.pause()
                return _cells(app)
        finally:
            StateWidget.FAST_LINES = True

    for keys in (["down"], ["down", "enter"]):
        assert asyncio.run(grid(True, keys)) == asyncio.run(grid(False, keys))


@async_test
async def test_live_subscriber_error_is_shown():
    def broken(addr):
        raise ValueError("bad address")

    src = LiveSource("nonsense", None, subscriber_factory=broken)
    app = KvscopeApp(src, auto_tick=False)
    try:
        async with app.run_test(size=(80, 24), notifications=True) as pilot:
            deadline = time.monotonic() + DEADLINE_S
            while src.error is None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            app.pump()
            await pilot.pause()
            assert app.state.conn == CONN_DISCONNECTED
            assert any("bad address" in str(n.message) for n in app._notifications)
    finally:
        src.close()


def _focused_table(app) -> QueueTable:
    table = app.focused
    assert isinstance(table, QueueTable)
    return table


@async_test
async def test_cursor_follows_its_request_not_its_row(events):
    """Rows above come and go, the request moves between queues, then finishes: the cursor stays on it."""
    app, rc, _ = replay_app(events)
    async with app.run_test(size=(100, 40)) as pilot:
        app.player.seek(200)
        app.pump()
        await pilot.pause()
        await pilot.press("down", "down")
        table = _focused_table(app)
        req = table.cursor_req
        assert req == app.state.running[2] and app.screen.selected == req
        index_moved = False
        finished_at = None
        for _ in range(300):
            await pilot.press("right")
            await pilot.pause()
            table = _focused_table(app)
            assert table.cursor_req == req, f"step {app.state.step}: the cursor left #{req}"
            live = app.state.requests.get(req)
            if live is not None and req in app.state.running and app.state.running.index(req) != 2:
                index_moved = True
            if live is None:
                finished_at = app.state.step
                break
        assert index_moved and finished_at is not None
        assert "done" in text_of(table)
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, RequestDetailScreen) and app.screen.req == req


@async_test
async def test_enter_at_the_end_of_a_replay_opens_a_finished_request():
    app, rc, _ = replay_app(sim_stream(300, seed=3, arrival_p=0.0, bursts=(1,)))  # drains: every queue ends empty
    async with app.run_test(size=(100, 40)) as pilot:
        await pilot.pause()
        await pilot.press("shift+end")
        await pilot.pause()
        assert app.state.step == rc.last_step and not app.state.running
        running = app.query_one("#running", QueueTable)
        assert running.has_focus and running.ids and "finished last" in text_of(running)
        await pilot.press("down", "enter")
        await pilot.pause()
        assert isinstance(app.screen, RequestDetailScreen)
        assert app.screen.req == running.ids[1] and app.state.get(app.screen.req).state == "finished"


@async_test
async def test_ctrl_c_quits_a_dashboard(events):
    app, _, _ = replay_app(events)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert app._exit, "ctrl+c ends the app (no 'press ctrl+q to quit')"


@async_test
async def test_help_scrolls_on_a_short_terminal_and_control_toasts_do_not_pile_up(events):
    app, _, _ = replay_app(events)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        for i in range(5):  # five `b` presses' replies: one toast, the last
            app.toast(f"burst: ok (added {i})", timeout=30, key="control")
        app.toast("something else", timeout=30)
        await pilot.pause()
        texts = [str(n.message) for n in app._notifications]
        assert texts == ["burst: ok (added 4)", "something else"]
        await pilot.press("question_mark")
        await pilot.pause()
        body = app.screen.query_one("#help-body")
        assert body.has_focus and body.max_scroll_y > 0, "the help is longer than the screen"
        await pilot.press("end")
        await pilot.pause()
        assert body.scroll_y == body.max_scroll_y


def test_replay_takes_compares_speed_and_paused(monkeypatch):
    import kvscope.tui.launch as launch
    from kvscope.cli.main import main

    seen = {}
    monkeypatch.setattr(launch, "run_replay", lambda path, **kw: seen.update(kw, path=path))
    assert main(["replay", "traces/demo-cpu.kvtrace", "--speed", "4", "--paused"]) == 0
    assert seen["speed"] == 4.0 and seen["paused"] is True
    app = launch.make_replay_app("traces/demo-cpu.kvtrace", speed=seen["speed"], playing=not seen["paused"])
    assert app.player.speed == 4.0 and not app.player.playing


@async_test
async def test_p_lands_on_the_victim_even_when_it_was_readmitted_within_the_step(events):
    app, rc, _ = replay_app(events)
    async with app.run_test(size=(100, 40)) as pilot:
        await pilot.pause()
        seen = set()
        for _ in range(8):
            await pilot.press("p")
            await pilot.pause()
            st = app.state
            assert st.step in rc.preempt_steps and st.preempted_now
            victim = st.preempted_now[0][0]
            table = _focused_table(app)
            assert app.screen.selected == victim and table.cursor_req == victim, f"step {st.step}"
            where = "running" if victim in st.running else "preempted" if victim in st.preempted else "waiting"
            assert table.id == where
            seen.add(where)
            toast = [str(n.message) for n in app._notifications if "preempted" in str(n.message)]
            assert toast and f"#{victim} preempted" in toast[-1]
            if where == "running":
                assert "re-admitted in the same step" in toast[-1]
        assert {"running", "preempted"} <= seen


def _with_text(events, req: int):
    """The events, with real-model text for ``req``: a prompt, and a completion that grows a word a token."""
    from kvscope.protocol.events import OutputText

    out = []
    n = 0
    for e in events:
        e = decode(encode(e))
        if e.type == "request" and e.req == req:
            e.prompt_text = "Question: name every planet of the solar system, one line each."
        if e.type == "step" and req in e.sampled and not any(f.req == req for f in e.finished):
            n += 1
            e.text = [OutputText(req, f"planet{n} " + ("\n" if n % 3 == 0 else ""))]
        out.append(e)
    return out, n


@async_test
async def test_request_detail_streams_the_completion_and_shows_all_of_it(events):
    from kvscope.tui.widgets.request import RequestText

    probe = [e for e in events if e.type == "step"]
    req = next(r for r in probe[150].running if sum(r in s.sampled for s in probe) > 40)
    evs, _ = _with_text(events, req)
    clock = FixedClock()
    rc = ReplayController(MemoryTrace(evs), playing=False, clock=clock)
    app = KvscopeApp([ReplayFeed(rc)], Player([rc], playing=False, clock=clock), auto_tick=False)
    async with app.run_test(size=(100, 30)) as pilot:
        first = next(s.step for s in probe if req in s.sampled)
        app.player.seek(first + 3)
        app.pump()
        await pilot.pause()
        app.push_screen(RequestDetailScreen(app.feeds[0], req))
        await pilot.pause()
        text = app.screen.query_one(RequestText)
        early = text_of(text)
        assert "planet1" in early and "generating" in early and "Question: name every planet" in early
        for _ in range(60):
            app.player.step_forward()
            app.pump()
        await pilot.pause()
        r = app.state.get(req)
        later = text_of(text)
        assert later.count("planet") > early.count("planet") + 20, "the completion grew on screen"
        last = r.output_text.split()[-1]
        assert last in later, "nothing cut: the newest words are on screen"
        scroll = app.screen.query_one("#lifecycle-scroll")
        assert text.size.height >= len(later.splitlines()) > 12, "the widget grew to every line (no cut at 2)"
        assert scroll.max_scroll_y > 0, "text and lifecycle are taller than the screen: they scroll"
