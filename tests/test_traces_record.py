"""record(): a late recorder asks for a snapshot and writes a trace that replays to
the engine's state."""

from __future__ import annotations

import threading
import time

import pytest
from _helpers import DEADLINE_S, wait_for
from fakes.streams import SimRun

pytest.importorskip("zmq")

from kvscope.protocol import ByeEvent, SnapshotEvent, StepEvent  # noqa: E402
from kvscope.protocol.transport import ControlServer, ZmqPublisher  # noqa: E402
from kvscope.protocol.blockmap import BlockMap  # noqa: E402
from kvscope.traces import TraceReader  # noqa: E402
from kvscope.traces.record import record  # noqa: E402


@pytest.mark.parametrize("hello_first", [True, False], ids=["hello-snapshot", "snapshot-hello"])
def test_late_recorder_writes_a_replayable_trace(tmp_path, hello_first):
    pub = ZmqPublisher("tcp://127.0.0.1:0")
    ctl = ControlServer("tcp://127.0.0.1:0")
    synth = SimRun(seed=9)
    synth.take()
    stop_engine = threading.Event()
    final: dict = {}
    asked = []

    def engine():
        pub.publish(synth.hello())
        pub.publish(synth.snapshot())
        while not stop_engine.is_set():
            for req in ctl.poll():
                if req.cmd == "snapshot":
                    asked.append(synth.done_step)
                    pair = [synth.hello(), synth.snapshot()]
                    for ev in pair if hello_first else pair[::-1]:
                        pub.publish(ev)
                req.reply()
            for ev in synth.step():
                pub.publish(ev)
            time.sleep(0.001)
            if len(asked) >= 3:
                break  # the recorder got a snapshot and asked for chunk-start ones
        final.update(synth.owners())
        pub.publish(ByeEvent(synth.done_step, synth.t))

    th = threading.Thread(target=engine, daemon=True)
    th.start()
    assert wait_for(lambda: synth.done_step >= 5), "the engine never got under way"  # recorder joins late: it missed the hello
    seen = []
    path = tmp_path / "rec.kvtrace"
    try:
        n = record(pub.addr, path, control_addr=ctl.addr, stop_after_s=DEADLINE_S, on_event=seen.append,
                   chunk_steps=10, ask_every_s=0.05)
    finally:
        stop_engine.set()
        th.join(DEADLINE_S)
        ctl.close()
        pub.close()
    assert n > 0 and len(asked) >= 2
    r = TraceReader(path)
    assert r.complete and r.warnings == []
    events = list(r)[1:]
    assert isinstance(events[0], SnapshotEvent) and isinstance(events[-1], ByeEvent)
    owners = None
    last = None
    for ev in events:
        if isinstance(ev, SnapshotEvent):
            owners = BlockMap.from_snapshot(ev)
        elif isinstance(ev, StepEvent):
            assert last is None or ev.step == last + 1
            last = ev.step
            owners.apply_step(ev)
    assert owners.owners() == final
    assert len(r.chunks) >= 2


def test_record_without_engine_writes_nothing(tmp_path):
    probe = ZmqPublisher("tcp://127.0.0.1:0")
    addr = probe.addr
    probe.close(0)
    stop = threading.Event()
    stop.set()
    assert record(addr, tmp_path / "x", stop=stop) == 0
    assert record(addr, tmp_path / "x", stop_after_s=0.1) == 0
    assert not (tmp_path / "x").exists()


def test_the_record_command_says_when_nothing_arrived(tmp_path, capsys):
    """As `record --vllm` does: one line and exit 1, rather than exit 0 and no file."""
    from kvscope.cli.main import main

    probe = ZmqPublisher("tcp://127.0.0.1:0")
    addr = probe.addr
    probe.close(0)
    out = tmp_path / "x.kvtrace"
    assert main(["record", str(out), "--connect", addr, "--control", "", "--duration", "0.3"]) == 1
    assert capsys.readouterr().err == f"kvscope record: nothing arrived from {addr}; no trace written\n"
    assert not out.exists()


def test_heartbeats_of_an_idle_engine_are_not_recorded(tmp_path):
    """docs/PROTOCOL.md: a heartbeat says the engine is up and is never part of a trace."""
    pub = ZmqPublisher("tcp://127.0.0.1:0", heartbeat_s=0.02)
    synth = SimRun(seed=4)
    synth.take()
    path = tmp_path / "idle.kvtrace"

    def engine():
        time.sleep(0.3)  # the recorder's subscription arrives
        pub.publish(synth.hello())
        pub.publish(synth.snapshot())
        for _ in range(3):
            for ev in synth.step():
                pub.publish(ev)
        time.sleep(0.5)  # idle: heartbeats only
        pub.publish(ByeEvent(synth.done_step, synth.t))

    th = threading.Thread(target=engine, daemon=True)
    th.start()
    try:
        n = record(pub.addr, path, stop_after_s=DEADLINE_S)
    finally:
        th.join()
        pub.close()
    kinds = [ev.type for ev in TraceReader(path)]
    assert n > 0 and kinds[-1] == "bye" and "step" in kinds
    assert "heartbeat" not in kinds
