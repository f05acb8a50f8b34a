"""A running engine under a control flood: it keeps serving, answers every message, refuses
requests past --max-waiting, and its memory stays bounded."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from _helpers import DEADLINE_S, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPLY_MS = int(DEADLINE_S * 1000)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def step_after(sub, step: int = -1) -> int | None:
    """The first published step past ``step``, within the deadline (None: the engine stopped stepping)."""
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        ev = sub.recv(50)
        if ev is not None and ev.type == "step" and ev.step > step:
            return ev.step
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the engine's memory")
def test_engine_survives_a_control_flood():
    import zmq

    from kvscope.protocol.transport import ControlClient, Subscriber

    ev_addr, ctl_addr = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "kvscope", "serve", "--backend", "sim", "--model", "llama-3.3-70b-fp8",
           "--forever", "--workload", "chat", "--sim-pace", "1", "--events", ev_addr, "--control", ctl_addr,
           "--no-progress", "--max-waiting", "256"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": ROOT})
    sub = Subscriber(ev_addr)
    client = ControlClient(ctl_addr, timeout_ms=REPLY_MS)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(ctl_addr)
    try:
        assert step_after(sub) is not None, "the engine never stepped"
        before = rss_mb(proc.pid)

        replies = [client.request("burst", n=4096) for _ in range(40)]
        first, rest = replies[0], replies[1:]
        assert first["ok"] is False and first["added"] == 256 and first["refused"] == 4096 - 256
        assert "refused" in first["error"] and "max_waiting 256" in first["error"]
        # the queue drains only as fast as requests are admitted to run: later bursts get a few in at most
        assert all(r["added"] + r["refused"] == 4096 and r["added"] <= 256 and r["ok"] is False for r in rest)
        assert sum(r["refused"] for r in replies) > 36 * 4096

        snaps = [client.request("snapshot") for _ in range(20)]
        assert all(s["ok"] for s in snaps)

        # malformed and hostile frames are answered, not fatal
        hostile = [b"\x91" * 2000 + b"\xc0", b"garbage", b"\xdd\xff\xff\xff\xff", b"\x81\xa3cmd\xa4burn", b""]
        for payload in hostile:
            raw.send_multipart([b"", payload])
        answers = []
        for _ in hostile:
            assert raw.poll(REPLY_MS), f"no answer after {len(answers)} hostile frames"
            answers.append(raw.recv_multipart()[-1])
        assert all(b"ok" in a and b"error" in a for a in answers)

        now = client.request("snapshot")["step"]  # where the engine is after the flood
        assert step_after(sub, now) is not None, "the engine stopped stepping"
        assert proc.poll() is None
        assert rss_mb(proc.pid) - before < 200  # 160k requests asked for; at most 256 queued
        assert client.request("stop")["ok"]
        assert proc.wait(timeout=DEADLINE_S) == 0
    finally:
        raw.close(0)
        client.close()
        sub.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read().decode()
    assert "Traceback" not in err
    assert err.count("refusing new ones") <= 3  # said, not once per request
