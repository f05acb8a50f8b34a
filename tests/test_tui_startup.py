"""`kvscope replay`'s first frame needs only the trace's start: the step index is built afterwards,
in the background (tui/model/step_index.py), and whatever needs an unindexed step waits for it."""

from __future__ import annotations

import os

import pytest
from test_tui_tracefile import write_trace

from kvscope.protocol.events import StepEvent
from kvscope.tui.model.state import new_state, picture, reduce

STEPS = 1500  # 64-step chunks: about 24 of them, so the index has something to do after the first frame


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    path = tmp_path_factory.mktemp("index") / "big.kvtrace"
    events = write_trace(str(path), steps=STEPS, seed=5)
    return str(path), events


def _live_at(events, step: int):
    live = new_state()
    for ev in events:
        live = reduce(live, ev)
        if type(ev) is StepEvent and ev.step == step:
            return live
    raise AssertionError(f"no step {step}")


def _controller(path: str, background: bool):
    from kvscope.tui.sources.replay import ReplayController, open_trace

    return ReplayController(open_trace(path), playing=False, clock=lambda: 0.0, index_in_background=background)


@pytest.mark.anyio
async def test_first_frame_is_drawn_before_the_index_is_built(big):
    from kvscope.tui.launch import make_replay_app

    path, events = big
    app = make_replay_app(path, playing=False, clock=lambda: 0.0, auto_tick=False)
    cursor = app.feeds[0].cursor
    async with app.run_test(size=(160, 45)) as pilot:
        await pilot.pause()
        assert app.repaints >= 1, "the first frame is drawn"
        assert not cursor.indexed and not cursor.index.started, "drawn from the trace's start alone"
        assert app.state.config is not None and app.state.synced, "it shows the trace's opening snapshot"
        st = app.player.status()
        assert st.indexing and not st.done
        assert st.last_step == events_last_step(events), "the bar's end comes from the trace's own index"
        app.pump()  # the second poll: the index starts, on its own thread
        assert cursor.index.started
        cursor.wait_indexed()
        assert cursor.indexed and cursor.index.error is None
        assert cursor.steps == [ev.step for ev in events if type(ev) is StepEvent]
        app.pump()
        assert not app.player.status().indexing
        # seeking is as exact as with an index built up front: the end, then back into the middle
        app.player.to_end()
        app.pump()
        last = events_last_step(events)
        assert app.state.step == last and picture(app.state) == picture(_live_at(events, last))
        app.player.seek(700)
        app.pump()
        assert app.state.step == 700 and picture(app.state) == picture(_live_at(events, 700))


def events_last_step(events) -> int:
    return max(ev.step for ev in events if type(ev) is StepEvent)


def test_what_needs_an_unindexed_step_waits_for_the_index(big):
    from kvscope.tui.model.player import Player

    path, events = big
    cursor = _controller(path, background=True)
    player = Player([cursor], playing=False, clock=cursor.now)
    assert not cursor.indexed and cursor.steps == []
    assert player.status().start_t == cursor.start_t
    player.to_end()  # needs the end: waits for (and starts) the index
    assert cursor.indexed
    player.sync()
    assert cursor.cur_step == events_last_step(events)
    st = player.status()
    assert st.done and not st.indexing and st.last_step == events_last_step(events)

    later = _controller(path, background=True)
    later.seek(1200)  # a seek past what is indexed waits too, then lands exactly
    assert later.indexed and later.cur_step == 1200


def test_background_index_equals_the_one_built_up_front(big, tmp_path):
    path, _ = big
    cut = tmp_path / "cut.kvtrace"
    with open(path, "rb") as f:
        data = f.read()
    cut.write_bytes(data[: int(len(data) * 0.6)])  # cut short: no footer, the index ends at the damage
    for p in (path, str(cut)):
        now, later = _controller(p, background=False), _controller(p, background=True)
        later.wait_indexed()
        assert later.index.error is None
        assert (later.steps, later.step_t, later.preempt_steps) == (now.steps, now.step_t, now.preempt_steps)
        assert later.steps, p
        if p != path:
            assert later.end_hint is None, "a trace with no index gives no end before the steps are indexed"
            assert later.steps[-1] < events_last_step(big[1])
    assert os.path.getsize(cut) < os.path.getsize(path)


def test_first_frames_import_neither_torch_nor_numpy():
    """What `kvscope replay` and the dashboard of `kvscope demo` load before their first frame."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trace = os.path.join(root, "traces", "demo-cpu.kvtrace")
    code = (
        "import asyncio, sys\n"
        "from textual.app import App\n"
        "def headless(self, *a, **k):  # the real app, mounted once headless until its first frame\n"
        "    async def go():\n"
        "        async with self.run_test() as pilot:\n"
        "            await pilot.pause()\n"
        "            assert self.repaints >= 1\n"
        "    asyncio.run(go())\n"
        "App.run = headless\n"
        "from kvscope.cli import main\n"
        f"assert main(['replay', {trace!r}]) == 0\n"
        "from kvscope.tui.launch.demo import run_demo\n"
        "from kvscope.tui.feeds import LiveFeed\n"
                "from kvscope.tui.sources.live import LiveSource\n"
        "LiveFeed(LiveSource('tcp://127.0.0.1:1', None, start=False))  # the demo's feed, diagnosis log and all\n"
        "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))\n")
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
