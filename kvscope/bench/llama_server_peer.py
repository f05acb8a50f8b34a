"""llama.cpp's own server as a peer (`kvscope bench --peers llama-server`): the same requests, all at once,
to `llama-server` with one parallel slot per request kvscope may run together, on the same GGUF file and
thread count. This is how llama.cpp serves concurrent users (and how Ollama does, built on it): continuous
batching across slots. The `llama-cpp` peer (llama_peer.py) is its Python API, one request at a time.

The binary is not a Python package. Build it from llama.cpp's source (llama-cpp-python's sdist carries it
under vendor/llama.cpp) and put it on PATH or name it in KVSCOPE_LLAMA_SERVER; see INSTALL.

Each request goes to /completion as token ids, streamed, greedy, EOS ignored, with no prompt cache: every
request computes its whole prompt and runs to its max_tokens, as kvscope's rows and the other peers do.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from kvscope.bench.harness import Row
from kvscope.bench.llama_peer import gguf_path
from kvscope.engine.config import EngineConfig
from kvscope.errors import KvscopeError

NAME = "llama-server"
BINARY_ENV = "KVSCOPE_LLAMA_SERVER"
INSTALL = (f"build llama.cpp's llama-server (e.g. from llama-cpp-python's sdist, vendor/llama.cpp: cmake -B build "
           f"-DLLAMA_CURL=OFF -DLLAMA_BUILD_UI=OFF && cmake --build build --target llama-server) and put it on "
           f"PATH or set {BINARY_ENV}=/path/to/llama-server")
START_TIMEOUT_S = 300.0  # loading a GGUF on a busy 2-core machine
REQUEST_TIMEOUT_S = 3600.0  # per socket read: a slot may wait behind every other request's prompt
MAX_LINE = 1 << 20  # one streamed event; ours are a few hundred bytes
MAX_TOKENS = 1 << 24  # a count past any request's max_tokens is not a count


def server_binary() -> str:
    """The llama-server to run: KVSCOPE_LLAMA_SERVER, else llama-server on PATH."""
    named = os.environ.get(BINARY_ENV)
    if named:
        if not (os.path.isfile(named) and os.access(named, os.X_OK)):
            raise KvscopeError(f"peer {NAME}: {BINARY_ENV}={named} is not an executable file")
        return named
    found = shutil.which("llama-server")
    if found is None:
        raise KvscopeError(f"peer {NAME} needs llama.cpp's server binary: {INSTALL}")
    return found


def check_available(config: EngineConfig) -> None:
    """Before minutes are spent on the other rows."""
    server_binary()
    gguf_path(config)


def llama_server_row(config: EngineConfig, items, threads: int) -> Row:
    path = gguf_path(config)
    slots = max(1, min(config.max_num_seqs, len(items)))
    ctx_per_slot = max(len(it.prompt) + it.max_tokens for it in items) + 8
    # the server stops before the pool is joined: on Ctrl-C or an error, the open streams end at once
    with ThreadPoolExecutor(max_workers=len(items)) as pool, \
            _Server(server_binary(), path, threads, slots, ctx_per_slot) as server:
        server.complete([1, 2, 3], 2)  # warm-up, as kvscope's rows get one
        start = time.perf_counter()
        streams = list(pool.map(lambda it: server.complete(it.prompt, it.max_tokens), items))
    ttft = [times[0] - start for times in streams if times]
    itl = [b - a for times in streams for a, b in zip(times, times[1:])]
    tokens = sum(len(times) for times in streams)
    span = max((times[-1] for times in streams if times), default=start) - start
    return Row.from_samples(NAME, ttft, itl, tokens, span, threads=threads, slots=slots, gguf=os.path.basename(path))


class _Server:
    """One llama-server process on a free loopback port, stopped on exit whatever happened."""

    def __init__(self, binary: str, gguf: str, threads: int, slots: int, ctx_per_slot: int) -> None:
        self.port = _free_port()
        self.command = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port),
                        "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot),
                        "-cram", "0",  # no host-side prompt cache: every request computes its prompt
                        "--no-webui"]
        self.log = tempfile.TemporaryFile()
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "_Server":
        from kvscope.openmp_wait import user_environment

        try:  # under the user's own OpenMP settings, not the wait kvscope chose for itself
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=self.log,
                                         stderr=subprocess.STDOUT, env=user_environment())
        except OSError as e:
            raise KvscopeError(f"peer {NAME}: cannot run {self.command[0]}: {e.strerror}") from None
        self._wait_healthy()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if exc_type is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
            else:  # Ctrl-C or an error: a bench peer has nothing to save, and its open streams hold SIGTERM up
                self.proc.kill()
            self.proc.wait()
        self.log.close()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise KvscopeError(f"peer {NAME} exited with status {self.proc.returncode} at start: "
                                   f"{self._last_log_line()}")
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass  # not listening yet, or still loading
            finally:
                conn.close()
            time.sleep(0.2)
        raise KvscopeError(f"peer {NAME} was not ready within {START_TIMEOUT_S:.0f} s: {self._last_log_line()}")

    def _last_log_line(self) -> str:
        self.log.seek(0, os.SEEK_END)
        self.log.seek(max(0, self.log.tell() - 4096))  # the tail only: a server's log can be long
        lines = [ln.strip() for ln in self.log.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        return lines[-1] if lines else "(no output)"

    def complete(self, prompt: list[int], max_tokens: int) -> list[float]:
        """One request, streamed: the time each token arrived (tokens reported together share a time)."""
        body = json.dumps({"prompt": list(prompt), "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
                           "ignore_eos": True, "cache_prompt": False, "stream": True})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        try:
            conn.request("POST", "/completion", body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise KvscopeError(f"peer {NAME} answered {response.status}: "
                                   f"{response.read(300).decode('utf-8', 'replace').strip()}")
            return _token_times(response)
        except OSError as e:
            raise KvscopeError(f"peer {NAME}: request failed: {e}") from None
        finally:
            conn.close()


def _token_times(response) -> list[float]:
    """Server-sent events, `data: {...}` per line, the last one `stop`. Each carries `tokens_predicted`, the
    count so far: the server sends no event for a token that ends inside a UTF-8 character (common for
    the bench's random token ids) and reports it with the next one, so the count, not the events, is
    what was generated; tokens reported together share that event's arrival time, as a client sees them."""
    times: list[float] = []
    while True:
        line = response.readline(MAX_LINE)
        if not line:
            raise KvscopeError(f"peer {NAME}: the stream ended before its last event")
        if not line.startswith(b"data: "):
            continue
        now = time.perf_counter()
        try:
            event = json.loads(line[6:])
        except ValueError:
            raise KvscopeError(f"peer {NAME}: a streamed event was not JSON: {line[:80]!r}") from None
        predicted = event.get("tokens_predicted") if isinstance(event, dict) else None
        if not isinstance(predicted, int) or isinstance(predicted, bool) or not 0 <= predicted <= MAX_TOKENS:
            raise KvscopeError(f"peer {NAME}: a streamed event without a token count: {line[:80]!r}")
        times.extend([now] * max(0, predicted - len(times)))
        if event.get("stop"):
            return times


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
