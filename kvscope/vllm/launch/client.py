"""Requests to an OpenAI-compatible server (a vLLM that kvscope started): the bench's and the workload's client.

Each request is a streamed `/v1/completions` with the prompt as token ids, greedy, EOS ignored and
`return_token_ids` (vLLM's field), so every chunk carries the ids it adds: the client sees each token's
arrival time and the exact greedy tokens, to set beside kvscope's. Plain http.client on one connection
per request (threads): no dependency vLLM's venv or kvscope's might lack.

The server is not trusted: a line is read up to MAX_LINE bytes, a count of ids up to the asked max_tokens,
and anything else that is not the OpenAI stream is a KvscopeError naming what came.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable

from kvscope.errors import KvscopeError

MAX_LINE = 1 << 20
REQUEST_TIMEOUT_S = 3600.0  # per socket read: a request may wait behind every other request's prompt


@dataclass
class Completion:
    """One request as the client saw it: when it was sent, when each token came, and which tokens."""

    sent: float
    times: list[float] = field(default_factory=list)  # perf_counter of each token's arrival
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.times[0] - self.sent if self.times else None

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


class CompletionsClient:
    def __init__(self, host: str, port: int, model: str, *, api_key: str | None = None,
                 timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.host, self.port, self.model = host, port, model
        self.api_key = api_key
        self.timeout_s = timeout_s

    def complete(self, prompt: list[int], max_tokens: int, *, ignore_eos: bool = True) -> Completion:
        body = json.dumps({"model": self.model, "prompt": list(prompt), "max_tokens": max_tokens,
                           "temperature": 0.0, "ignore_eos": ignore_eos, "stream": True,
                           "return_token_ids": True})
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        out = Completion(time.perf_counter())
        try:
            conn.request("POST", "/v1/completions", body=body, headers=headers)
            response = conn.getresponse()
            if response.status != 200:
                raise KvscopeError(f"vLLM answered {response.status}: "
                                   f"{response.read(300).decode('utf-8', 'replace').strip()}")
            _read_stream(response, out, max_tokens)
            return out
        except OSError as e:
            raise KvscopeError(f"a request to vLLM at {self.host}:{self.port} failed: {e}") from None
        finally:
            conn.close()


def _read_stream(response, out: Completion, max_tokens: int) -> None:
    """Server-sent events, `data: {json}` per chunk, then `data: [DONE]`; a chunk's `token_ids` are the ids it
    adds (vLLM sends none for a token that ends inside a UTF-8 character and adds it to the next chunk), so
    the ids, not the chunks, are what was generated; ids that come together share the chunk's time."""
    while True:
        line = response.readline(MAX_LINE)
        if not line:
            raise KvscopeError("vLLM's stream ended before [DONE]")
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            return
        now = time.perf_counter()
        try:
            chunk = json.loads(data)
            choice = chunk["choices"][0] if chunk.get("choices") else {}
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise KvscopeError(f"vLLM streamed something that is not a completion chunk: {line[:80]!r}") from None
        ids = choice.get("token_ids") or []
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise KvscopeError(f"vLLM streamed token_ids that are not ids: {line[:80]!r}")
        if len(out.token_ids) + len(ids) > max_tokens:
            raise KvscopeError(f"vLLM streamed more than the {max_tokens} tokens asked for")
        out.token_ids.extend(ids)
        out.times.extend([now] * len(ids))
        if choice.get("finish_reason"):
            out.finish_reason = str(choice["finish_reason"])[:40]


def complete_all(client: CompletionsClient, items: Iterable, max_workers: int = 256) -> list[Completion]:
    """Every item (prompt, max_tokens) at once, each on its own connection, in the items' order."""
    items = list(items)
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(items)))) as pool:
        return list(pool.map(lambda it: client.complete(it.prompt, it.max_tokens, ignore_eos=it.ignore_eos), items))


class WorkloadDriver:
    """A timed workload (kvscope.workload's requests, arrival in seconds from the start) sent to the server as
    its requests come due, each on a thread of its own; past ``max_in_flight`` unfinished requests a new one is
    refused and counted, as kvscope's engine refuses past --max-waiting, so a slow server never piles up an
    endless backlog. Finished requests are kept for the summary; errors are counted, the last one kept."""

    def __init__(self, client: CompletionsClient, max_in_flight: int, on_finished: Callable[[Completion], None]
                 | None = None) -> None:
        self.client = client
        self.max_in_flight = max_in_flight
        self.on_finished = on_finished
        self.done: list[Completion] = []
        self.refused = 0
        self.errors = 0
        self.last_error: str | None = None
        self._in_flight = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, max_in_flight), thread_name_prefix="kvscope-vllm-req")
        self.started = time.perf_counter()

    def run(self, items: Iterable, stop: threading.Event) -> None:
        """Send items on their schedule until they run out or stop is set; then wait for those in flight."""
        self.started = time.perf_counter()
        for it in items:
            due = self.started + it.arrival
            while not stop.is_set() and time.perf_counter() < due:
                stop.wait(min(0.05, max(0.0, due - time.perf_counter())))
            if stop.is_set():
                break
            with self._lock:
                if self._in_flight >= self.max_in_flight:
                    self.refused += 1
                    continue
                self._in_flight += 1
            self._pool.submit(self._one, it)
        self.close(wait=not stop.is_set())

    def _one(self, it) -> None:
        try:
            c = self.client.complete(it.prompt, it.max_tokens, ignore_eos=it.ignore_eos)
        except Exception as e:  # noqa: BLE001 - one request's failure is counted, the workload goes on
            with self._lock:
                self.errors += 1
                self.last_error = str(e)[:300]
                self._in_flight -= 1
            return
        with self._lock:
            self.done.append(c)
            self._in_flight -= 1
        if self.on_finished is not None:
            self.on_finished(c)

    def close(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
