"""`kvscope demo`: an engine child sized for a live show, and the dashboard watching it."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

from kvscope.engine.config import usable_cores
from kvscope.engine.loader.named_models import NAMED_MODELS, fetch
from kvscope.engine.loader.shapes import BUILTIN_SHAPES
from kvscope.errors import KvscopeError
from kvscope.protocol.transport import DEFAULT_CONTROL_ADDR, DEFAULT_EVENTS_ADDR
from kvscope.tui.launch import run_live
from kvscope.tui.launch.supervise import error_line, start_engine, stop_engine, wait_until_serving

# Sized so that the first seconds show queueing at every burst, prompts prefilled in 128-token
# chunks beside decodes, preemptions when a long prompt or a burst fills the 256 blocks, and the
# demo workload's shared prefix served from the prefix cache. The workload's clock runs on engine
# steps (--step-clock: 10 ms of traffic per step, about the tiny model's step on an idle 2-core
# CPU), so a slow or loaded machine sees the same lesson, only slower, never a runaway backlog.
# Measured with benchmarks/demo_lesson.py (docs/DEMO.md): WAITING > 0 in 63-73% of frames, a
# preemption on screen in 44-57%, a prefix hit in 80-87%, each first within 2.1 s.
DEMO_ENGINE_ARGS = ("--num-blocks", "256", "--max-num-seqs", "16", "--max-num-batched-tokens", "128",
                    "--prefix-caching", "--step-clock", "0.01")

# `kvscope demo --sim`: an H100 serving Llama 3.3 70B FP8 on the sim backend, paced to real
# time. Mixed traffic with a burst every 10 s: over 28 s it measured ~550 tok/s, queueing
# at the bursts, chunked prefills beside decodes and a few preemptions from a full cache.
SIM_DEMO_MODEL = "llama-3.3-70b-fp8"
SIM_DEMO_WORKLOAD = "mixed"

START_TIMEOUT_S = 60.0  # model load on a slow CPU; a child that fails is reported as soon as it exits
# a real checkpoint: transformers parses and dequantizes a GGUF in about a minute on 2 busy cores
REAL_MODEL_START_TIMEOUT_S = 600.0


# `kvscope demo --engine vllm`: a real vLLM (its CPU build) on SmolLM2 with the demo's traffic over its API.
# 16 sequences at once over 48 of vLLM's 128-token CPU blocks (6,144 tokens), so bursts queue and a full
# pool preempts; every request still fits (2,048 tokens at most).
VLLM_DEMO_MODEL = "smollm2-135m"
VLLM_DEMO_ARGS = ("--engine", "vllm", "--max-num-seqs", "16", "--num-blocks", "48", "--", "--max-model-len", "2048")
VLLM_START_TIMEOUT_S = 1800.0  # a first start compiles the model: minutes on a small CPU
VLLM_STOP_S = 45.0  # serve stops vLLM in order (its drain, its workers) before it exits


def vllm_demo_command(events_addr: str, control_addr: str, model: str = VLLM_DEMO_MODEL,
                      workload: str = "demo") -> list[str]:
    """`kvscope serve --engine vllm --forever`: vLLM's flags last (after --), so nothing may follow them."""
    return [sys.executable, "-m", "kvscope.cli", "serve", "--forever", "--workload", workload, "--events", events_addr,
            "--control", control_addr, "--model", model, "--no-progress", *VLLM_DEMO_ARGS]


def sim_demo_args(gpu: str = "h100-sxm5") -> tuple[str, ...]:
    return ("--backend", "sim", "--gpu", gpu, "--kv-cache-dtype", "fp8", "--sim-pace", "1",
            "--burst-every", "10")


def demo_threads(cores: int | None = None) -> int:
    """The demo engine's torch threads: every core but one, for the dashboard beside it.

    Measured on 2 cores (benchmarks/thread_sweep.py, benchmarks/results/threads-cpu.json): the tiny
    model's demo ran 4% faster on one thread than on two (14% in a first sweep), because
    its steps are short and the dashboard's Python wants a core of its own. This holds for
    small models only: qwen3-0.6b-shape beside the same dashboard ran 2.3x faster on two
    threads, so everything else keeps the engine default of every core."""
    return max(1, (cores or usable_cores()) - 1)


def demo_command(events_addr: str, control_addr: str, *, device: str = "auto", model: str = "tiny",
                 workload: str = "demo", extra_args: tuple[str, ...] = (),
                 engine_args: tuple[str, ...] = DEMO_ENGINE_ARGS) -> list[str]:
    """Later arguments win in argparse, so extra_args can override the demo's engine sizing and threads."""
    return [sys.executable, "-m", "kvscope.cli", "serve", "--forever", "--workload", workload,
            "--events", events_addr, "--control", control_addr, "--device", device, "--model", model,
            "--no-progress", "--cpu-threads", str(demo_threads()), *engine_args, *extra_args]


def run_demo(palette: str = "default", device: str = "auto", *, events_addr: str = DEFAULT_EVENTS_ADDR,
             control_addr: str = DEFAULT_CONTROL_ADDR, model: str = "tiny", workload: str = "demo",
             extra_args: tuple[str, ...] = (), log_path: str | None = None, sim_gpu: str | None = None,
             start_timeout_s: float = START_TIMEOUT_S, engine: str = "kvscope") -> None:
    """Start ``kvscope serve --forever --workload demo`` as a child, watch it, stop it on quit.

    With sim_gpu, the child is the sim backend: Llama 3.3 70B FP8 on that GPU, in real time. With engine "vllm",
    the child is `kvscope serve --engine vllm --forever`: a real vLLM, the demo's traffic sent over its API.
    An engine that fails to start is a KvscopeError carrying its own error line.
    """
    if sim_gpu is None and model not in BUILTIN_SHAPES:
        start_timeout_s = max(start_timeout_s, REAL_MODEL_START_TIMEOUT_S)
        if model in NAMED_MODELS:
            fetch(model)  # here, before the dashboard takes the terminal: pip's progress bar shows
    events_addr, control_addr = free_if_taken(events_addr), free_if_taken(control_addr)
    asked_log = log_path
    stop_s = 3.0
    if engine == "vllm":
        start_timeout_s = max(start_timeout_s, VLLM_START_TIMEOUT_S)
        cmd = vllm_demo_command(events_addr, control_addr, model=model, workload=workload)
        stop_s = VLLM_STOP_S
    elif sim_gpu is not None:
        cmd = demo_command(events_addr, control_addr, device=device, model=SIM_DEMO_MODEL,
                           workload=SIM_DEMO_WORKLOAD, extra_args=extra_args, engine_args=sim_demo_args(sim_gpu))
    else:
        cmd = demo_command(events_addr, control_addr, device=device, model=model, workload=workload,
                           extra_args=extra_args)
    proc, log_path = start_engine(cmd, log_path)
    own_log = log_path != asked_log
    code = None
    failed = False
    try:
        if sys.stdout.isatty():
            # The dashboard draws at once; the engine loads torch and the model in parallel, and the
            # header shows that as a progress line until its first step.
            run_live(events_addr, control_addr, palette=palette,
                     starting=EngineStart(proc, log_path, model=cmd[cmd.index("--model") + 1]))
        else:  # no terminal to draw on: say whether the engine came up, then run (scripts, tests)
            print("kvscope demo: starting the engine ...", file=sys.stderr, flush=True)
            if not wait_until_serving(proc, events_addr, start_timeout_s):
                raise KvscopeError(_engine_failed(proc.poll(), log_path))
            run_live(events_addr, control_addr, palette=palette)
    except KvscopeError:
        failed = True
        raise
    finally:
        code = stop_engine(proc, control_addr, term_s=stop_s)
    if not failed and code not in (0, None, -signal.SIGTERM):
        print(f"kvscope demo: warning: {_engine_failed(code, log_path)}", file=sys.stderr)
    elif not failed and own_log:
        with contextlib.suppress(OSError):  # a clean run leaves no log behind; a failed one names it
            os.remove(log_path)


def free_if_taken(addr: str) -> str:
    """A tcp:// address whose port is taken (another demo or engine) becomes one on a free port, said in a
    line; other addresses are left as they are (the engine then reports its own error)."""
    import socket

    host, sep, port = addr.removeprefix("tcp://").rpartition(":")
    if not addr.startswith("tcp://") or not sep or not port.isdigit():
        return addr
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as zmq binds: a TIME_WAIT port is free
        try:
            s.bind((host.strip("[]"), int(port)))
            return addr
        except OSError:
            pass
        s.bind((host.strip("[]"), 0))
        free = f"tcp://{host}:{s.getsockname()[1]}"
    print(f"kvscope demo: {addr} is taken (another engine or demo?); using {free}", file=sys.stderr)
    return free


class EngineStart:
    """The demo's engine child while it starts: the header's progress line, or its error if it exits."""

    def __init__(self, proc, log_path: str, *, model: str) -> None:
        self.proc = proc
        self.log_path = log_path
        self.model = model
        self.t0 = time.monotonic()

    def line(self) -> str:
        said = _last_line(self.log_path)
        what = f" · {said[:60]}" if said else ""
        return (f"starting the engine: importing torch, loading {self.model} … "
                f"{time.monotonic() - self.t0:.1f} s{what}")

    def error(self) -> str | None:
        code = self.proc.poll()
        return None if code is None else _engine_failed(code, self.log_path)


def _last_line(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 400))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _engine_failed(code, log_path: str) -> str:
    line = error_line(log_path).removeprefix("kvscope: error: ")
    return f"the engine exited with code {code}: {line or 'no output'} (log: {log_path})"
