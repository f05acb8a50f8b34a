"""Replay from a real .kvtrace file (TraceWriter/TraceReader), screenshots, demo child cleanup."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from fakes.streams import SimRun

from kvscope.protocol.events import StepEvent
from kvscope.tui.model.state import new_state, picture, reduce, reduce_all


def write_trace(path, steps: int = 300, seed: int = 3) -> list:
    """A sim-backend run recorded with the TraceWriter; returns the events in file order."""
    from kvscope.traces.writer import TraceWriter

    eng = SimRun(seed=seed, snapshot_every=0, bursts=(60, 180))
    eng.take()  # the hello and snapshot it opened with: the writer gets its own
    written: list = [eng.hello()]

    def provide():
        snap = eng.snapshot()
        written.append(snap)
        return snap

    w = TraceWriter(path, eng.hello(), chunk_steps=64, snapshot_provider=provide, background=False)
    first = eng.snapshot()
    written.append(first)
    w.publish(first)
    for _ in range(steps):
        for ev in eng.step():
            written.append(ev)
            w.publish(ev)
    w.close()
    return written


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "sim.kvtrace"
    events = write_trace(str(path))
    return str(path), events


def test_replay_from_file_equals_live_at_step(trace):
    from kvscope.tui.sources.replay import ReplayController, open_trace

    path, events = trace
    rc = ReplayController(open_trace(path), playing=False, clock=lambda: 0.0)
    live = new_state()
    targets = {5, 64, 65, 130, 200, 299}
    seen = set()
    for ev in events:
        live = reduce(live, ev)
        if type(ev) is StepEvent and ev.step in targets and ev.step not in seen:
            seen.add(ev.step)
            # backwards and forwards: both must land on the live picture
            for start in (ev.step + 50, 1):
                rc.seek(start)
                replay = reduce_all(new_state(), rc.poll())
                rc.seek(ev.step)
                replay = reduce_all(replay, rc.poll())
                assert replay.step == ev.step
                assert picture(replay) == picture(live), (start, ev.step)
    assert seen == targets


def test_screenshots_are_deterministic(trace, tmp_path):
    from kvscope.tui.screenshots import make_screenshots

    path, _ = trace
    a = make_screenshots(path, str(tmp_path / "a"))
    b = make_screenshots(path, str(tmp_path / "b"))
    assert [os.path.basename(p) for p in a] == ["dashboard.svg", "request-detail.svg", "replay.svg"]
    for pa, pb in zip(a, b):
        with open(pa, encoding="utf-8") as fa, open(pb, encoding="utf-8") as fb:
            sa, sb = fa.read(), fb.read()
        assert sa.startswith("<svg") and sa == sb
    with open(a[0], encoding="utf-8") as f:
        svg = f.read()
    assert "RUNNING" in svg and "KV" in svg and "TTFT" in svg


def test_screenshots_cli(trace, tmp_path):
    path, _ = trace
    out = subprocess.run([sys.executable, "-m", "kvscope.tui.screenshots", path, str(tmp_path), "--step", "120"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert sorted(os.listdir(tmp_path)) == ["dashboard.svg", "replay.svg", "request-detail.svg"]


def test_engine_child_is_stopped_without_orphans(tmp_path):
    from kvscope.tui.launch.supervise import start_engine, stop_engine

    # A stand-in engine that ignores SIGTERM for a moment, then dies on SIGKILL at worst.
    code = "import signal, time; signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(SystemExit(0)));" \
           "time.sleep(60)"
    proc, log = start_engine([sys.executable, "-c", code], str(tmp_path / "engine.log"))
    assert proc.poll() is None
    rc = stop_engine(proc, None)
    assert rc is not None and proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)


def test_demo_command_line():
    from kvscope.tui.launch.demo import demo_command

    cmd = demo_command("tcp://127.0.0.1:6001", "tcp://127.0.0.1:6002", device="cpu")
    assert cmd[:4] == [sys.executable, "-m", "kvscope.cli", "serve"]
    assert "--forever" in cmd and cmd[cmd.index("--workload") + 1] == "demo"
    assert cmd[cmd.index("--events") + 1] == "tcp://127.0.0.1:6001"
    assert cmd[cmd.index("--control") + 1] == "tcp://127.0.0.1:6002"


def test_sim_demo_command_is_a_valid_sim_serve():
    from kvscope.cli import build_parser
    from kvscope.cli.common import engine_config as _engine_config
    from kvscope.tui.launch.demo import SIM_DEMO_MODEL, demo_command, sim_demo_args

    cmd = demo_command("tcp://127.0.0.1:6001", "tcp://127.0.0.1:6002", model=SIM_DEMO_MODEL, workload="mixed",
                       engine_args=sim_demo_args("h200"))
    args = build_parser().parse_args(cmd[3:])
    config = _engine_config(args)
    config.validate()
    assert (config.backend, config.model, args.forever) == ("sim", SIM_DEMO_MODEL, True)
    assert args.gpu == "h200" and args.sim_pace == 1.0 and args.num_blocks is None
