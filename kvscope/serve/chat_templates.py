"""Chat templates rendered with bounds: a small pool of worker processes (template_worker.py).

Every render, the model's own template included (a GGUF file carries its template as data, so
it is no more trusted than a client's), runs in transformers' sandboxed renderer inside a worker
process. The server waits at most RENDER_TIMEOUT_S for a render, then kills that worker (a
thread cannot be stopped, a process can) and starts another; a worker's data segment is capped
at RENDER_MEMORY_BYTES and its text at RENDER_MAX_CHARS. At most POOL_SIZE renders run at once,
so a slow one holds one worker for at most the time limit while the others go on.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time

import msgspec

from kvscope.serve.template_worker import FRAME

POOL_SIZE = 4  # renders at once (each in its own process)
RENDER_TIMEOUT_S = 5.0  # one render's wall time; a checkpoint's template takes milliseconds
RENDER_MEMORY_BYTES = 512 << 20  # a worker's data segment beyond what it needed to start
RENDER_MAX_CHARS = 8 << 20  # the longest rendered prompt (the request body is at most 4 MiB)
START_TIMEOUT_S = 120.0  # importing transformers in a fresh worker, on a loaded machine
MAX_REPLY_BYTES = 4 * RENDER_MAX_CHARS + 4096


class RenderError(Exception):
    """A render that failed: the template refused, ran out of time or memory, or wrote too much."""


class RenderStopped(RenderError):
    """The pool was closed (the server is stopping)."""


class _Worker:
    def __init__(self, timeout_s: float, memory_bytes: int, max_chars: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvscope.serve.template_worker", str(memory_bytes), str(max_chars)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True)  # a Ctrl-C at the terminal reaches the server, which ends the workers
        self.ready = False

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def _read_exact(self, n: int, deadline: float) -> bytes:
        fd, chunks, got = self.proc.stdout.fileno(), [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, min(n - got, 1 << 20))
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def read_frame(self, deadline: float) -> dict:
        size = FRAME.unpack(self._read_exact(FRAME.size, deadline))[0]
        if size > MAX_REPLY_BYTES:
            raise EOFError
        return msgspec.msgpack.decode(self._read_exact(size, deadline))

    def send(self, job: dict) -> None:
        body = msgspec.msgpack.encode(job)
        self.proc.stdin.write(FRAME.pack(len(body)) + body)
        self.proc.stdin.flush()


class RenderPool:
    """Renders chat templates in worker processes, each render bounded in time, memory and output."""

    def __init__(self, size: int = POOL_SIZE, timeout_s: float = RENDER_TIMEOUT_S,
                 memory_bytes: int = RENDER_MEMORY_BYTES, max_chars: int = RENDER_MAX_CHARS) -> None:
        self.timeout_s, self.memory_bytes, self.max_chars = timeout_s, memory_bytes, max_chars
        self.size = size
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._live: set[_Worker] = set()
        self._closed = False

    def _spawn_locked(self, idle: bool) -> _Worker:
        """A new worker (its Popen takes milliseconds; its imports run in the child), counted at once, so the
        pool never holds more than `size`. Called with the lock held."""
        if self._closed:
            raise RenderStopped("the server is stopping")
        w = _Worker(self.timeout_s, self.memory_bytes, self.max_chars)
        self._live.add(w)
        if idle:
            self._idle.insert(0, w)  # taken last: the warm ones go first
        return w

    def start(self) -> None:
        """Start one worker now, so that the first chat request does not wait for its imports."""
        with self._lock:
            if not self._idle:
                self._spawn_locked(idle=True)

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RenderStopped("the server is stopping")
            # holding a slot, at most size - 1 others render: with none idle there is room for one more
            w = self._idle.pop() if self._idle else self._spawn_locked(idle=False)
        self._keep_spare()
        return w

    def _keep_spare(self) -> None:
        """One worker idle and warm (its imports take seconds) while the pool has room: the next render does not
        wait for a start behind a slow one."""
        with self._lock:
            if not self._idle and len(self._live) < self.size and not self._closed:
                self._spawn_locked(idle=True)

    def _drop(self, w: _Worker) -> None:
        with self._lock:
            self._live.discard(w)
        w.kill()
        self._keep_spare()

    def render(self, template: str, messages: list[dict], add_generation_prompt: bool,
               continue_final_message: bool, kwargs: dict) -> str:
        """The rendered prompt, or RenderError with one line saying why not."""
        try:
            job = {"template": template, "messages": messages, "add_generation_prompt": add_generation_prompt,
                   "continue_final_message": continue_final_message, "kwargs": kwargs}
            msgspec.msgpack.encode(job)  # fails here, not in a worker, on what msgpack cannot carry
        except (TypeError, ValueError, RecursionError, msgspec.EncodeError) as e:
            raise RenderError(f"the template's inputs cannot be passed on: {e}") from None
        with self._slots:
            w = self._take()
            try:
                if not w.ready:
                    if w.read_frame(time.monotonic() + START_TIMEOUT_S).get("ready") is not True:
                        raise EOFError
                    w.ready = True
                w.send(job)
                reply = w.read_frame(time.monotonic() + self.timeout_s)
            except TimeoutError:
                self._drop(w)
                raise RenderError(f"the chat template took over {self.timeout_s:g} s to render") from None
            except (EOFError, OSError, ValueError, msgspec.DecodeError):
                self._drop(w)
                if self._closed:
                    raise RenderStopped("the server is stopping") from None
                raise RenderError("the chat template's render process ended (out of memory?)") from None
            if reply.get("restart"):
                self._drop(w)
            else:
                with self._lock:
                    (self._idle if not self._closed else []).append(w)
            if "error" in reply:
                raise RenderError(str(reply["error"]))
            return str(reply["text"])

    def close(self) -> None:
        """Kill every worker, busy ones too; a render in flight ends with RenderStopped."""
        with self._lock:
            self._closed = True
            workers, self._live, self._idle = list(self._live), set(), []
        for w in workers:
            w.kill()


class ChatTemplates:
    """The model's own template (and, when the operator trusts them, a request's), rendered in the pool with
    the tokenizer's special tokens as variables, as transformers' apply_chat_template passes them."""

    def __init__(self, pool: RenderPool, model_template: str | None, special_tokens: dict) -> None:
        self.pool, self.model_template, self.special_tokens = pool, model_template, special_tokens

    def render(self, messages: list[dict], add_generation_prompt: bool = True, *, template: str | None = None,
               continue_final_message: bool = False, **kwargs) -> str:
        chosen = template if template is not None else self.model_template
        if chosen is None:
            raise RenderError("no chat template to render")
        return self.pool.render(chosen, messages, add_generation_prompt, continue_final_message,
                                {**self.special_tokens, **kwargs})


def model_template_of(tokenizer) -> tuple[str | None, dict]:
    """(the tokenizer's default chat template as text or None, its special tokens as template variables)."""
    hf = getattr(tokenizer, "_tok", None)
    if hf is None or not getattr(tokenizer, "has_chat_template", False):
        return None, {}
    try:
        template = hf.get_chat_template()
    except Exception:  # a named-template dict without a default, or a malformed one: no template
        template = None
    special = {k: v for k, v in getattr(hf, "special_tokens_map", {}).items() if isinstance(v, (str, list))}
    return (template if isinstance(template, str) else None), special
