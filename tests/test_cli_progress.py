"""Open-ended commands run as a user types them: with the progress bar (no --no-progress), with and
without a terminal. `kvscope serve --http` once crashed at start-up on tqdm's bool() of a bar with no total."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time

import httpx
import pytest
from _helpers import DEADLINE_S, free_port

from kvscope.cli.common import NoProgress, progress_bar

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Proc:
    """A `kvscope` child whose stderr is a pipe or a terminal; its output is drained as it comes."""

    def __init__(self, args: list[str], *, terminal: bool, cwd: str) -> None:
        env = {**os.environ, "PYTHONPATH": ROOT}
        if terminal:
            self.master, slave = pty.openpty()
            out = slave
        else:
            self.master, out = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-m", "kvscope", *args], stdin=subprocess.DEVNULL,
                                     stdout=out, stderr=out, cwd=cwd, env=env)
        os.close(out)
        self.output = b""

    def drain(self) -> None:
        while select.select([self.master], [], [], 0)[0]:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # a pty reads EIO once the child has gone
                return
            if not chunk:
                return
            self.output += chunk

    def wait_http(self, port: int, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.drain()
            assert self.proc.poll() is None, f"exited {self.proc.returncode}: {self.text()[-2000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"no /health within {timeout}s: {self.text()[-2000:]}")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.drain()
            time.sleep(0.05)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=DEADLINE_S)
        self.drain()
        os.close(self.master)
        return self.proc.returncode

    def text(self) -> str:
        return self.output.decode(errors="replace")


def _indexed(path) -> bool:
    """The trace was closed properly: it ends in the index's footer."""
    from kvscope.traces import format as F

    data = path.read_bytes()
    return F.FOOTER.unpack(data[-F.FOOTER.size:])[0] == F.FOOTER_MAGIC


@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "terminal"])
def test_serve_http_as_the_readme_writes_it_answers_and_stops_cleanly(tmp_path, terminal):
    """`kvscope serve --http 127.0.0.1:PORT` (default model, progress bar on), then the README's request."""
    port = free_port()
    p = Proc(["serve", "--http", f"127.0.0.1:{port}", "--device", "cpu", "--record", "http.kvtrace"],
             terminal=terminal, cwd=str(tmp_path))
    try:
        p.wait_http(port)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=DEADLINE_S).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=DEADLINE_S,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        code = p.stop()
    assert code == 0, p.text()[-2000:]
    assert "Traceback" not in p.text()
    from kvscope.traces.reader import TraceReader

    assert _indexed(tmp_path / "http.kvtrace")
    assert [e.type for e in TraceReader(tmp_path / "http.kvtrace") if e.type == "request"] == ["request"]


@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "terminal"])
def test_serve_forever_with_the_bar_records_a_readable_trace(tmp_path, terminal):
    p = Proc(["serve", "--backend", "sim", "--model", "qwen3-0.6b", "--gpu", "l4", "--workload", "demo", "--forever",
              "--record", "forever.kvtrace"], terminal=terminal, cwd=str(tmp_path))
    trace = tmp_path / "forever.kvtrace"
    deadline = time.monotonic() + 120
    try:
        while not (trace.exists() and trace.stat().st_size > 4096):  # steps are being written
            p.drain()
            assert p.proc.poll() is None, p.text()[-2000:]
            assert time.monotonic() < deadline, "no steps written"
            time.sleep(0.2)
    finally:
        code = p.stop()
    assert code == 0, p.text()[-2000:]
    assert "Traceback" not in p.text()
    from kvscope.traces.reader import TraceReader

    assert _indexed(trace)
    assert sum(1 for e in TraceReader(trace) if e.type == "step") > 0
    if terminal:
        assert "req" in p.text()  # the bar was drawn on the terminal


def test_a_bar_with_no_total_is_never_tested_for_truth():
    bar = progress_bar(True, total=None, desc="x")
    with pytest.raises(TypeError):
        bool(bar)  # tqdm's own rule; callers must not ask
    bar.update()
    bar.close()
    off = progress_bar(False, total=None, desc="x")
    assert isinstance(off, NoProgress)
    off.update()
    off.close()
