"""The TUI against a real engine (tiny model on the CPU): live Pilot test, and
"a replay at step N shows what live showed at step N" from the engine's own trace."""

from __future__ import annotations

import asyncio
import sys

import pytest
from _helpers import DEADLINE_S, async_wait_for, free_port, wait_for

from kvscope.protocol.events import StepEvent
from kvscope.tui.model.state import new_state, picture, reduce, reduce_all

pytest.importorskip("zmq")
pytest.importorskip("torch")


async def wait_until(cond, what: str, proc=None) -> bool:
    """cond() within the deadline, or a failure naming what never came (sooner if the engine died)."""
    alive = (lambda: proc.poll() is None) if proc is not None else (lambda: True)
    if not await async_wait_for(lambda: cond() or not alive()):
        raise AssertionError(f"timed out after {DEADLINE_S:.0f}s waiting for {what}")
    assert alive(), f"the engine exited {proc.returncode} before {what}"
    return True


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
    from kvscope.tui.launch.supervise import start_engine, stop_engine
    from kvscope.protocol.transport import ControlClient
    from kvscope.tui.sources.live import LiveSource
    from kvscope.tui.sources.replay import ReplayController, open_trace

    ev_addr = f"tcp://127.0.0.1:{free_port()}"
    ctl_addr = f"tcp://127.0.0.1:{free_port()}"
    trace = tmp_path / "live.kvtrace"
    # --forever: the engine cannot run out of work before the TUI has paused and resumed it, however
    # far the TUI lags on a loaded machine; the test stops it over control once it has seen enough.
    cmd = [sys.executable, "-m", "kvscope.cli", "serve", "--device", "cpu", "--workload", "demo", "--forever",
           "--num-blocks", "40", "--max-num-batched-tokens", "128",
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
            assert await wait_until(lambda: app.state.steps_seen > 30, "30 live steps", proc)
            await pilot.press("space")  # pause the engine over control
            paused_seen = await wait_until(lambda: app.engine_paused, "the engine paused", proc)
            await pilot.press("space")  # and resume it
            resumed = await wait_until(lambda: not app.engine_paused, "the engine resumed", proc)
            seen = app.state.steps_seen
            assert await wait_until(lambda: app.state.steps_seen > seen + 30, "30 steps after resuming", proc)
            stop = ControlClient(ctl_addr, timeout_ms=int(DEADLINE_S * 1000))
            try:
                assert stop.request("stop")["ok"]  # it says bye and closes its trace
            finally:
                stop.close()
            assert await wait_until(lambda: app.state.ended, "the engine's bye", proc=None)
            assert app.state.config.model == "tiny" and not app.state.stale
            assert app.state.conn == "live"

    try:
        asyncio.run(run())
        proc.wait(timeout=DEADLINE_S)  # it said bye: let it close its trace and exit by itself
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
    from kvscope.protocol.transport import Subscriber
    from kvscope.tui.launch.demo import demo_command
    from kvscope.tui.launch.supervise import start_engine, stop_engine
    from kvscope.tui.sources.live import LiveSource

    ev_addr = f"tcp://127.0.0.1:{free_port()}"
    ctl_addr = f"tcp://127.0.0.1:{free_port()}"
    extra = ("--num-blocks", "64", "--max-num-batched-tokens", "128")
    cmd = demo_command(ev_addr, ctl_addr, device="cpu", extra_args=extra)
    procs = []
    source = LiveSource(ev_addr, ctl_addr)

    def engine_has_stepped(sub) -> bool:
        ev = sub.recv(100)
        return isinstance(ev, StepEvent) and ev.step >= 5

    async def run() -> None:
        proc, _ = start_engine(cmd, str(tmp_path / "engine1.log"))
        procs.append(proc)
        # the engine runs before the TUI connects: a bare subscriber sees it step first
        probe = Subscriber(ev_addr)
        try:
            assert wait_for(lambda: engine_has_stepped(probe) or proc.poll() is not None), "the engine never stepped"
        finally:
            probe.close()
        assert proc.poll() is None, f"the engine exited {proc.returncode}"
        app = KvscopeApp(source, address=ev_addr)
        async with app.run_test(size=(80, 24)):
            st = lambda: app.state  # noqa: E731
            await wait_until(lambda: st().steps_seen > 5 and not st().stale and st().config, "a live picture", proc)
            first_run = st().wall_start
            assert st().snapshots >= 1  # resynced from a snapshot it asked for
            stop_engine(proc, ctl_addr)
            await wait_until(lambda: st().conn == "disconnected", "the TUI to see the engine go")
            # the last picture is kept, not cleared
            assert st().step > 5 and st().config is not None and st().requests is not None
            proc2, _ = start_engine(cmd, str(tmp_path / "engine2.log"))
            procs.append(proc2)
            await wait_until(lambda: st().conn == "live" and st().wall_start not in (None, first_run)
                             and not st().stale and st().steps_seen > 5, "the new engine's picture", proc2)

    try:
        asyncio.run(run())
    finally:
        source.close()
        for p in procs:
            stop_engine(p, ctl_addr)
    assert all(p.poll() is not None for p in procs)
