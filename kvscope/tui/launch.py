"""Entry points used by ``kvscope tui``, ``kvscope replay`` and ``kvscope demo``.

Textual is imported only inside these functions, so importing this module is cheap.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

DEFAULT_EVENTS_ADDR = "tcp://127.0.0.1:5557"
DEFAULT_CONTROL_ADDR = "tcp://127.0.0.1:5558"


def run_live(events_addr: str = DEFAULT_EVENTS_ADDR, control_addr: str | None = DEFAULT_CONTROL_ADDR,
             palette: str = "default") -> None:
    """Watch a live engine. Survives the engine starting later, exiting and restarting."""
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.sources import LiveSource

    source = LiveSource(events_addr, control_addr)
    try:
        KvscopeApp(source, palette=palette, address=events_addr).run()
    finally:
        source.close()


def make_replay_app(path: str, *, palette: str = "default", speed: float = 1.0, playing: bool = True,
                    start_step: int | None = None, clock=None, auto_tick: bool = True):
    """The replay app for a trace file (also used by the screenshots script)."""
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.sources import ReplayController, open_trace

    trace = open_trace(path)
    kw = {"clock": clock} if clock is not None else {}
    controller = ReplayController(trace, speed=speed, playing=playing, **kw)
    if start_step is not None:
        controller.seek(start_step)
    return KvscopeApp(controller, palette=palette, auto_tick=auto_tick)


def run_replay(path: str, palette: str = "default", *, speed: float = 1.0, start_step: int | None = None,
               paused: bool = False) -> None:
    """Replay a .kvtrace file through the same screens as live."""
    from kvscope.protocol.codec import ProtocolError

    try:
        app = make_replay_app(path, palette=palette, speed=speed, playing=not paused, start_step=start_step)
    except (OSError, ProtocolError) as e:
        raise SystemExit(f"kvscope replay: cannot read {path}: {e}") from None
    for w in getattr(app.source.trace, "warnings", ()) or ():
        print(f"kvscope replay: warning: {w}", file=sys.stderr)
    app.run()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the engine gets SIGTERM if the TUI process dies without cleaning up."""
    os.setsid()
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except Exception:
        pass


# Sized so that, on a 2-core CPU with the tiny model, the first minute shows queueing at
# every burst, prompts prefilled in 128-token chunks beside decodes, and a few
# preemptions per second while a burst fills the 384 blocks (measured over 36 s: 80
# preemptions, the first at 0.6 s), with the demo workload's shared prefix served
# from the prefix cache (about 29% of prompt tokens hit).
DEMO_ENGINE_ARGS = ("--num-blocks", "384", "--max-num-seqs", "32", "--max-num-batched-tokens", "128",
                    "--prefix-caching")


# `kvscope demo --sim`: an H100 serving Llama 3.3 70B FP8 on the sim backend, paced to real
# time. Mixed traffic with a burst every 10 s: over 28 s it measured ~550 tok/s, queueing
# at the bursts, chunked prefills beside decodes and a few preemptions from a full cache.
SIM_DEMO_MODEL = "llama-3.3-70b-fp8"
SIM_DEMO_WORKLOAD = "mixed"


def sim_demo_args(gpu: str = "h100-sxm5") -> tuple[str, ...]:
    return ("--backend", "sim", "--gpu", gpu, "--kv-cache-dtype", "fp8", "--sim-pace", "1",
            "--burst-every", "10")


def demo_command(events_addr: str, control_addr: str, *, device: str = "auto", model: str = "tiny",
                 workload: str = "demo", extra_args: tuple[str, ...] = (),
                 engine_args: tuple[str, ...] = DEMO_ENGINE_ARGS) -> list[str]:
    """Later arguments win in argparse, so extra_args can override the demo's engine sizing."""
    return [sys.executable, "-m", "kvscope.cli", "serve", "--forever", "--workload", workload,
            "--events", events_addr, "--control", control_addr, "--device", device, "--model", model,
            "--no-progress", *engine_args, *extra_args]


def start_engine(cmd: list[str], log_path: str | None = None) -> tuple[subprocess.Popen, str]:
    """Start the engine child with its output in a log file (the TUI owns the terminal)."""
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="kvscope-demo-", suffix=".log")
        os.close(fd)
    log = open(log_path, "ab")
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent if os.name == "posix" else None, close_fds=True)
    finally:
        log.close()
    return proc, log_path


def stop_engine(proc: subprocess.Popen, control_addr: str | None = None, *, grace_s: float = 5.0) -> int | None:
    """Ask the engine to stop over control, then SIGTERM, then SIGKILL. Returns its exit code."""
    asked = False
    if proc.poll() is None and control_addr:
        try:
            from kvscope.protocol.transport import ControlClient

            ctl = ControlClient(control_addr, timeout_ms=1000)
            try:
                asked = bool(ctl.request("stop").get("ok"))
            finally:
                ctl.close()
        except Exception:
            pass
    steps = ((None, grace_s),) if asked else ()
    for sig, wait in steps + ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
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


def run_demo(palette: str = "default", device: str = "auto", *, events_addr: str = DEFAULT_EVENTS_ADDR,
             control_addr: str = DEFAULT_CONTROL_ADDR, model: str = "tiny", workload: str = "demo",
             extra_args: tuple[str, ...] = (), log_path: str | None = None, sim_gpu: str | None = None) -> None:
    """Start ``kvscope serve --forever --workload demo`` as a child, watch it, stop it on quit.

    With sim_gpu, the child is the sim backend: Llama 3.3 70B FP8 on that GPU, in real time.
    """
    if sim_gpu is not None:
        cmd = demo_command(events_addr, control_addr, device=device, model=SIM_DEMO_MODEL,
                           workload=SIM_DEMO_WORKLOAD, extra_args=extra_args, engine_args=sim_demo_args(sim_gpu))
    else:
        cmd = demo_command(events_addr, control_addr, device=device, model=model, workload=workload,
                           extra_args=extra_args)
    proc, log_path = start_engine(cmd, log_path)
    code = None
    try:
        time.sleep(0.05)
        if proc.poll() is not None:
            raise SystemExit(_engine_failed(proc.returncode, log_path))
        run_live(events_addr, control_addr, palette=palette)
    finally:
        code = stop_engine(proc, control_addr)
    if code not in (0, None, -signal.SIGTERM):
        print(_engine_failed(code, log_path), file=sys.stderr)


def _engine_failed(code, log_path: str) -> str:
    tail = ""
    try:
        with open(log_path, "rb") as f:
            tail = f.read()[-2000:].decode("utf-8", "replace")
    except OSError:
        pass
    return f"kvscope demo: the engine exited with code {code} (log: {log_path})\n{tail}"
