"""`kvscope record --vllm URL [--kv-events ADDR] [--kv-replay ADDR] FILE`: a watched vLLM into a trace.

The same VllmSource the live view uses does the watching; this module listens to it and
writes what it applied, as protocol events (adapters.vllm_trace), into a TraceWriter.
The trace's hello says backend "vllm" and what was watched; every scrape and every KV
batch is one tick of its `step` counter; a ``vllm_snapshot`` of the recorder's own cache
view opens each chunk. `kvscope replay FILE` shows it in the vLLM view.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from kvscope.vllm.watch.source import NullListener, VllmSource
from kvscope.vllm.watch.trace import failed_scrape_event, kv_event, metrics_event, snapshot_event
from kvscope.protocol.codec import ProtocolError, decode, encode
from kvscope.protocol.events import BACKEND_VLLM, PROTOCOL_VERSION, HelloEvent, engine_info
from kvscope.traces.writer import TraceWriter

CHUNK_TICKS = 256
MAX_CHUNK_S = 10.0


class VllmRecorder(NullListener):
    """Turns what a VllmSource applied into trace events. Runs under the source's lock."""

    def __init__(self, path: str | os.PathLike, source: VllmSource) -> None:
        self.path = path
        self.source = source
        self.wall_start = time.time()
        self.t0 = time.monotonic()
        self.writer: TraceWriter | None = None
        self.step = 0
        self.scrapes = 0
        self.failed = 0
        self.batches = 0
        self.replayed = 0
        self.unrecordable = 0  # events the reader would refuse (never written)
        self.closed = False
        self.last_error: str | None = None
        self.vllm_version: str | None = None  # what the server's GET /version said, for the hello

    def _t(self) -> float:
        return time.monotonic() - self.t0

    def _writer(self, model: str | None) -> TraceWriter:
        if self.writer is None:  # opened at the first sample, so the hello can name the model
            src = self.source
            info = {"model": model or "", "engine": "vllm", "backend": BACKEND_VLLM}
            if self.vllm_version:
                info["vllm_version"] = self.vllm_version
            if src.url:
                info["vllm_url"] = src.url
                info["vllm_interval"] = src.interval
            if src.state.kv_addr:
                info["vllm_kv_events"] = src.state.kv_addr
            if src.state.replay_addr:
                info["vllm_kv_replay"] = src.state.replay_addr
            hello = HelloEvent(PROTOCOL_VERSION, engine_info(info), self.wall_start)
            # No snapshot_provider: the writer would call it after a tick is handed over, and a
            # tick moves the state only after this listener returns. _tick snapshots before.
            self.writer = TraceWriter(self.path, hello, chunk_steps=CHUNK_TICKS, max_chunk_s=MAX_CHUNK_S)
        return self.writer

    def _snapshot(self):
        # The caller holds the source's lock, and the tick about to be recorded has not moved the
        # state yet: this is the state after tick `step`, the one the next tick applies to.
        st = self.source.state
        return snapshot_event(self.step, self._t(), st.cache, st.kv, st.metrics, self.wall_start)

    def _tick(self, event, model: str | None = None) -> None:
        if self.closed:  # a source thread that outlived close()'s join (a scrape past its timeout)
            return
        writer = self._writer(model)
        if writer.wants_snapshot:
            snap = self._snapshot()
            if self._readable(snap):
                writer.publish(snap)
        if self._readable(event):
            writer.publish(event)
            self.step += 1

    def _readable(self, event) -> bool:
        """The trace must never hold what its reader refuses: check each event as the reader will."""
        try:
            decode(encode(event))
        except ProtocolError as e:
            self.unrecordable += 1
            self.last_error = str(e)
            return False
        return True

    # -- NullListener ---------------------------------------------------------------
    def scraped(self, scrape) -> None:
        self.scrapes += 1
        self._tick(metrics_event(self.step + 1, scrape.t - self.wall_start, scrape), scrape.model)

    def scrape_failed(self, message: str) -> None:
        self.scrapes += 1  # a failed scrape is still a scrape, as trace-info counts it
        self.failed += 1
        self._tick(failed_scrape_event(self.step + 1, self._t(), message))

    def applied(self, seq: int, batch, replayed: bool) -> None:
        self.batches += 1
        self.replayed += replayed
        self._tick(kv_event(self.step + 1, self._t(), seq, batch, replayed=replayed, kv=self.source.state.kv))

    def close(self) -> int:
        self.closed = True
        if self.writer is None:
            return 0
        self.writer.close()
        return self.writer.events

    def progress(self) -> str:
        st = self.source.state
        lost = f", {self.unrecordable} not recordable ({self.last_error})" if self.unrecordable else ""
        return (f"{self.scrapes} scrapes ({self.failed} failed), {self.batches} KV batches "
                f"({self.replayed} replayed), {st.cache.cached_blocks} blocks cached{lost}")


def record_vllm(path: str | os.PathLike, url: str | None, kv_events: str | None, kv_replay: str | None, *,
                interval: float = 1.0, duration: float | None = None, stop: threading.Event | None = None,
                progress: bool = True) -> VllmRecorder:
    """Watch until ``duration`` seconds pass, ``stop`` is set or Ctrl-C; the trace is always closed."""
    source = VllmSource(url, kv_events, kv_replay, interval=interval)
    recorder = VllmRecorder(path, source)
    source.listener = recorder
    stop = stop or threading.Event()
    tty = progress and sys.stderr.isatty()
    last_line = 0.0
    if url:  # vLLM's version and one scrape first, so the trace's hello can name them (within --duration too)
        from kvscope.vllm.watch.endpoints import server_version
        from kvscope.vllm.watch.source import SCRAPE_TIMEOUT_S, scrape_client

        budget = SCRAPE_TIMEOUT_S if duration is None else min(SCRAPE_TIMEOUT_S, duration)
        with scrape_client(interval) as client:
            recorder.vllm_version = server_version(source.url, client, budget_s=min(1.0, budget))
            source.scrape_once(client, budget_s=budget)
    source.start()
    try:
        while not stop.wait(0.2):
            if duration is not None and time.monotonic() - recorder.t0 >= duration:
                break
            if tty and time.monotonic() - last_line >= 1.0:
                last_line = time.monotonic()
                with source.lock:
                    line = recorder.progress()
                print(f"\r[record] {line}", end="", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        source.close()  # the threads are joined: nothing publishes after this
        with source.lock:
            recorder.close()
    if progress:
        print(("\r" if tty else "") + f"[record] {recorder.progress()} -> {path}", file=sys.stderr)
    return recorder
