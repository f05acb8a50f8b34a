"""The TUI against a real engine (tiny model on the CPU): live Pilot test, and
"a replay at step N shows what live showed at step N" from the engine's own trace."""

from __future__ import annotations

import asyncio
import socket
import sys
import time

import pytest

from kvscope.protocol.events import StepEvent
from kvscope.tui.state import new_state, picture, reduce, reduce_all

pytest.importorskip("zmq")
pytest.importorskip("torch")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Recording:
    """Wraps a source: passes events to the app and keeps live pictures after each step."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.state = new_state()
        self.pictures: dict[int, dict] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def poll(self):
        events = self.inner.poll()
        for ev in events:
            self.state = reduce(self.state, ev)
            if type(ev) is StepEvent and not self.state.stale and len(self.pictures) < 400:
                self.pictures[ev.step] = picture(self.state)
        return events


@pytest.mark.slow
def test_live_engine_then_replay_equals_live(tmp_path):
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.supervise import start_engine, stop_engine
    from kvscope.tui.sources import LiveSource, ReplayController, open_trace

    ev_addr = f"tcp://127.0.0.1:{free_port()}"
    ctl_addr = f"tcp://127.0.0.1:{free_port()}"
    trace = tmp_path / "live.kvtrace"
    cmd = [sys.executable, "-m", "kvscope.cli", "serve", "--device", "cpu", "--workload", "demo",
           "--num-requests", "24", "--num-blocks", "40", "--max-num-batched-tokens", "128",
           "--events", ev_addr, "--control", ctl_addr, "--record", str(trace), "--no-progress"]
    source = Recording(LiveSource(ev_addr, ctl_addr))
    app = KvscopeApp(source, mode="live", address=ev_addr)
    proc = None
    paused_seen = resumed = False

    async def run() -> None:
        nonlocal proc, paused_seen, resumed
        async with app.run_test(size=(100, 30)) as pilot:
            await asyncio.sleep(0.3)
            assert app.state.conn == "connecting"  # the TUI starts first
            proc, _ = start_engine(cmd, str(tmp_path / "engine.log"))
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and not app.state.ended:
                await asyncio.sleep(0.05)
                if app.state.steps_seen > 30 and not paused_seen:
                    await pilot.press("space")  # pause the engine over control
                    t0 = time.monotonic()
                    while not app.engine_paused and time.monotonic() - t0 < 5:
                        await asyncio.sleep(0.05)
                    paused_seen = app.engine_paused
                    await pilot.press("space")  # and resume it
                    t0 = time.monotonic()
                    while app.engine_paused and time.monotonic() - t0 < 5:
                        await asyncio.sleep(0.05)
                    resumed = not app.engine_paused
            assert app.state.ended, "the engine did not finish in time"
            assert app.state.config.model == "tiny" and not app.state.stale
            assert app.state.conn == "live"

    try:
        asyncio.run(run())
        proc.wait(timeout=60)  # it drained and said bye: let it close its trace and exit by itself
    finally:
        source.close()
        if proc is not None:
            stop_engine(proc, ctl_addr)
    assert paused_seen and resumed
    assert proc.returncode == 0
    assert len(source.pictures) > 20

    # Replay the trace the engine recorded: at each step live showed, the same picture.
    rc = ReplayController(open_trace(str(trace)), playing=False, clock=lambda: 0.0)
    steps = sorted(source.pictures)
    sample = steps[:: max(1, len(steps) // 25)] + [steps[-1]]
    state = None
    for n in sample:
        rc.seek(n)
        events = rc.poll()
        state = reduce_all(new_state() if state is None or events[:1] and events[0].type == "hello" else state,
                           events)
        assert state.step == n
        assert picture(state) == source.pictures[n], n
    # and backwards, through the reader's seek
    for n in reversed(sample[:5]):
        rc.seek(n)
        state = reduce_all(new_state(), rc.poll())
        assert picture(state) == source.pictures[n], n


@pytest.mark.slow
def test_late_join_engine_exit_and_restart(tmp_path):
    """Join a running engine late, see it go away, then a new engine on the same ports."""
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.demo import demo_command
    from kvscope.tui.supervise import start_engine, stop_engine
    from kvscope.tui.sources import LiveSource

    ev_addr = f"tcp://127.0.0.1:{free_port()}"
    ctl_addr = f"tcp://127.0.0.1:{free_port()}"
    extra = ("--num-blocks", "64", "--max-num-batched-tokens", "128")
    cmd = demo_command(ev_addr, ctl_addr, device="cpu", extra_args=extra)
    procs = []
    source = LiveSource(ev_addr, ctl_addr)

    async def wait(cond, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end and not cond():
            await asyncio.sleep(0.05)
        return cond()

    async def run() -> None:
        proc, _ = start_engine(cmd, str(tmp_path / "engine1.log"))
        procs.append(proc)
        await asyncio.sleep(4.0)  # the engine runs before the TUI connects
        app = KvscopeApp(source, address=ev_addr)
        async with app.run_test(size=(80, 24)):
            st = lambda: app.state  # noqa: E731
            assert await wait(lambda: st().steps_seen > 5 and not st().stale and st().config, 30)
            first_run = st().wall_start
            assert st().snapshots >= 1  # resynced from a snapshot it asked for
            stop_engine(proc, ctl_addr)
            assert await wait(lambda: st().conn == "disconnected", 10)
            kept = st().step
            assert st().step == kept and st().config is not None and st().requests is not None  # last picture kept
            proc2, _ = start_engine(cmd, str(tmp_path / "engine2.log"))
            procs.append(proc2)
            assert await wait(lambda: st().conn == "live" and st().wall_start not in (None, first_run)
                              and not st().stale and st().steps_seen > 5, 40)

    try:
        asyncio.run(run())
    finally:
        source.close()
        for p in procs:
            stop_engine(p, ctl_addr)
    assert all(p.poll() is not None for p in procs)
