"""TraceWriter: records events into a .kvtrace file (docs/TRACE_FORMAT.md).

It is an event sink (``publish``/``close``) the engine feeds next to the zmq
publisher. ``publish`` only appends the event object to the open chunk; encoding,
compression and the file write happen on a background thread, one chunk at a time,
so the engine loop is never held up by zlib or the disk. Every chunk is flushed as
soon as it is written: a killed process loses at most the chunk it was filling.

Every chunk opens with a snapshot (an engine's ``snapshot``, or a recorded vLLM's
``vllm_snapshot``); "steps" below are its ticks (``step`` events, or a vLLM's
scrapes and KV batches). A full chunk (``chunk_steps`` steps, or
``max_chunk_s`` seconds, or ``max_chunk_events`` events) is closed at the next
snapshot: either one the engine publishes, or - right after the step that filled
it - one asked from ``snapshot_provider()``, which is called synchronously inside
``publish(step)`` and must return the state after that step. Until the first
snapshot arrives (from the engine or the provider) events cannot be recorded: they
are counted in ``skipped`` (the snapshot covers their effect). Hello events passed
to ``publish`` are ignored: the header holds the hello.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import zlib
from typing import Callable

import msgpack

from ..protocol.codec import MAX_EVENT_BYTES, ProtocolError, encode
from ..protocol.events import SNAPSHOT_TYPES, TICK_TYPES, HelloEvent, SnapshotEvent
from . import format as F
from .summary import Tally

__all__ = ["TraceWriter"]

_STOP = object()


class TraceWriter:
    def __init__(
        self,
        path: str | os.PathLike,
        hello: HelloEvent,
        *,
        chunk_steps: int = 256,
        snapshot_provider: Callable[[], SnapshotEvent | None] | None = None,
        max_chunk_s: float | None = 10.0,
        max_chunk_events: int = 1 << 16,
        level: int = 6,
        background: bool = True,
    ):
        if not isinstance(hello, HelloEvent):
            raise TypeError("hello must be a HelloEvent")
        self.path = os.fspath(path)
        self.hello = hello
        self.chunk_steps = max(1, int(chunk_steps))
        self.snapshot_provider = snapshot_provider
        self.max_chunk_s = max_chunk_s
        self.max_chunk_events = max(2, min(int(max_chunk_events), F.MAX_CHUNK_EVENTS))
        self.level = level
        self.skipped = 0  # events published before any snapshot
        self.encode_errors = 0  # events that could not be encoded (lost)
        self.lost = 0  # events not recorded: too large to decode, or no snapshot to open their chunk
        self._lost_reasons: set[str] = set()
        self._accepted = 0
        self.chunks_written = 0
        self.error: BaseException | None = None
        self._tally = Tally()
        self._index: list[list[int]] = []  # [offset, first_step, last_step, n_events]
        self._cur: list | None = None
        self._cur_steps = 0
        self._cur_started = 0.0
        self._closed = False

        hello_bytes = encode(hello)
        if len(hello_bytes) > F.MAX_HELLO_BYTES:
            raise ProtocolError("hello event too large for a trace header")
        self._f = open(self.path, "wb")
        try:
            self._f.write(
                F.HEADER.pack(F.MAGIC, F.FORMAT_VERSION, 0, len(hello_bytes), zlib.crc32(hello_bytes))
            )
            self._f.write(hello_bytes)
            self._f.flush()
        except BaseException:
            self._f.close()
            raise
        self._pos = F.HEADER.size + len(hello_bytes)

        self._q: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._q = queue.Queue()
            self._thread = threading.Thread(target=self._run, name="kvscope-trace-writer", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ engine side

    def publish(self, event) -> None:
        if self._closed:
            raise ValueError("trace writer is closed")
        t = type(event)
        if t is HelloEvent:
            return  # the header holds it; engines repeat hello next to snapshots
        cur = self._cur
        if cur is None:
            if t in SNAPSHOT_TYPES:
                self._open(event)
                return
            snap = self._provide()
            if snap is None:
                self.skipped += 1
                return
            self._open(snap)
            cur = self._cur
        elif t in SNAPSHOT_TYPES and self._full():
            self._roll(event)
            return
        cur.append(event)
        self._accepted += 1
        if t in TICK_TYPES:
            self._cur_steps += 1
            if self._full():
                snap = self._provide()
                if snap is not None:
                    self._roll(snap)

    def _provide(self) -> SnapshotEvent | None:
        if self.snapshot_provider is None:
            return None
        snap = self.snapshot_provider()
        if snap is not None and type(snap) not in SNAPSHOT_TYPES:
            raise TypeError("snapshot_provider must return a snapshot event or None")
        return snap

    def _full(self) -> bool:
        if self._cur_steps >= self.chunk_steps or len(self._cur) >= self.max_chunk_events:
            return True
        return self.max_chunk_s is not None and time.monotonic() - self._cur_started >= self.max_chunk_s

    def _open(self, snap: SnapshotEvent) -> None:
        self._cur = [snap]
        self._accepted += 1
        self._cur_steps = 0
        self._cur_started = time.monotonic()

    def _roll(self, snap: SnapshotEvent) -> None:
        self._submit(self._cur)
        self._open(snap)

    def _submit(self, item) -> None:
        if self._q is not None:
            self._q.put(item)
        else:
            self._write_chunk(item)

    # ------------------------------------------------------------------ file side

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            if self.error is not None:
                continue  # the file is broken; drain
            try:
                self._write_chunk(item)
            except BaseException as e:  # disk full, ...
                self.error = e
                print(f"kvscope: trace writer failed, recording stopped: {e}", file=sys.stderr)

    def _write_chunk(self, events: list) -> None:
        """Encode, split and write the events of one closed chunk.

        Only what the reader accepts is written: an event over the decode limit is not recorded,
        and a chunk that would outgrow the format's bounds is split at one of its snapshots (a
        chunk must open with one). Events with no snapshot to start a chunk from are lost; both
        are counted in ``lost``, stored in the index and shown by ``kvscope trace-info``."""
        seg: list[tuple[bytes, object]] = []  # (encoded, event) of the chunk being built
        seg_raw = 0
        last_snap = 0  # index in seg of its latest snapshot: where it can be split
        for ev in events:
            try:
                data = encode(ev)
            except ProtocolError:
                data = None
            size = F.EVENT_LEN.size + len(data) if data is not None else 0
            if data is None or len(data) > MAX_EVENT_BYTES or size > F.MAX_CHUNK_RAW_BYTES:
                self._lose(1, "an event that cannot be encoded within the decode limit")
                continue
            is_snap = type(ev) in SNAPSHOT_TYPES
            if seg and (seg_raw + size > F.MAX_CHUNK_RAW_BYTES or len(seg) >= F.MAX_CHUNK_EVENTS):
                cut = len(seg) if is_snap else last_snap
                if cut == 0:  # one snapshot and what follows it already fill a chunk
                    self._lose(1, "a chunk over the format's bounds with no snapshot to split it at")
                    continue
                self._write_segment(seg[:cut])
                seg = seg[cut:]
                seg_raw = sum(F.EVENT_LEN.size + len(d) for d, _ in seg)
                last_snap = 0
            if not seg and not is_snap:  # no snapshot to open a chunk with: it could not be replayed
                self._lose(1, "events whose chunk lost its opening snapshot")
                continue
            if is_snap:
                last_snap = len(seg)
            seg.append((data, ev))
            seg_raw += size
        if seg:
            self._write_segment(seg)

    def _lose(self, n: int, why: str) -> None:
        self.lost += n
        self.encode_errors += n
        if why not in self._lost_reasons:
            self._lost_reasons.add(why)
            print(f"kvscope: trace writer: not recording {why} ({self.path})", file=sys.stderr)

    def _write_segment(self, seg: list[tuple[bytes, object]]) -> None:
        """One chunk record: seg opens with a snapshot; the index gets its first and last step."""
        first = last = seg[0][1].step
        for _, ev in seg:
            self._tally.add(ev)
            if (type(ev) in TICK_TYPES or type(ev) in SNAPSHOT_TYPES) and ev.step > last:
                last = ev.step
        raw = b"".join(F.EVENT_LEN.pack(len(d)) + d for d, _ in seg)
        body = zlib.compress(raw, self.level)
        meta = F.CHUNK_META.pack(first, last, len(seg), len(raw))
        crc = zlib.crc32(body, zlib.crc32(meta))
        rec = F.RECORD.pack(F.CHUNK_TAG, len(meta) + len(body), crc)
        offset = self._pos
        self._f.write(rec + meta)
        self._f.write(body)
        self._f.flush()
        self._pos += len(rec) + len(meta) + len(body)
        self._index.append([offset, first, last, len(seg)])
        self.chunks_written += 1

    def close(self) -> None:
        """Write the open chunk, the index and the footer; close the file."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._cur is not None and len(self._cur) > 0:
                self._submit(self._cur)
                self._cur = None
            if self._thread is not None:
                self._q.put(_STOP)
                self._thread.join()
            if self.error is None:
                index_map = {"chunks": self._index, "stats": self._tally.to_wire()}
                if self.lost:
                    index_map["lost"] = self.lost
                index = msgpack.packb(index_map, use_bin_type=True)
                rec = F.RECORD.pack(F.INDEX_TAG, len(index), zlib.crc32(index))
                index_at = self._pos
                self._f.write(rec)
                self._f.write(index)
                self._f.write(F.FOOTER.pack(F.FOOTER_MAGIC, index_at))
                self._pos += len(rec) + len(index) + F.FOOTER.size
                self._f.flush()
        finally:
            self._f.close()
        if self.error is not None:
            raise self.error

    @property
    def events(self) -> int:
        """Events accepted so far (snapshots included, hello not)."""
        return self._accepted

    @property
    def wants_snapshot(self) -> bool:
        """True while the writer needs a snapshot: none yet, or the open chunk is full."""
        return self._cur is None or self._full()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
