"""The engine as a child process of the TUI: start it with its output in a log, see whether it came
up, stop it without leaving orphans (Linux: prctl makes it die with its parent)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time

from kvscope.child import die_with_parent


def start_engine(cmd: list[str], log_path: str | None = None) -> tuple[subprocess.Popen, str]:
    """Start the engine child with its output in a log file (the TUI owns the terminal)."""
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="kvscope-demo-", suffix=".log")
        os.close(fd)
    log = open(log_path, "ab")
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent if os.name == "posix" else None, close_fds=True)
    finally:
        log.close()
    return proc, log_path


def wait_until_serving(proc: subprocess.Popen, events_addr: str, timeout_s: float) -> bool:
    """Wait for the engine's first event on events_addr. False if the child exited first; True once
    an event arrives, or after timeout_s (a slow model load: the dashboard then waits for it)."""
    from kvscope.protocol.transport import Subscriber

    sub = Subscriber(events_addr)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            ev = sub.recv(100)
            if ev is not None:  # hello, or a later event if we joined after it (hello repeats anyway)
                return True
        return proc.poll() is None
    finally:
        sub.close()


def stop_engine(proc: subprocess.Popen, control_addr: str | None = None, *, grace_s: float = 5.0,
                term_s: float = 3.0) -> int | None:
    """Ask the engine to stop over control, then SIGTERM (term_s to finish), then SIGKILL. Returns its exit code."""
    asked = False
    if proc.poll() is None and control_addr:
        try:
            from kvscope.protocol.transport import ControlClient

            ctl = ControlClient(control_addr, timeout_ms=1000)
            try:
                asked = bool(ctl.request("stop").get("ok"))
            finally:
                ctl.close()
        except Exception:  # noqa: BLE001 - best effort: the signals below stop it anyway
            pass
    steps = ((None, grace_s),) if asked else ()
    for sig, wait in steps + ((signal.SIGTERM, term_s), (signal.SIGKILL, 3.0)):
        if sig is not None and proc.poll() is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass
        try:
            return proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return proc.poll()


def error_line(log_path: str) -> str:
    """The child's own one-line error from its log (``kvscope: error: ...``), else its last line."""
    try:
        with open(log_path, "rb") as f:
            tail = f.read()[-8000:].decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("kvscope: error:")]
    return (errors or lines or [""])[-1]
