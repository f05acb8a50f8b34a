"""TraceReader: reads .kvtrace files (docs/TRACE_FORMAT.md). Needs neither torch nor zmq.

On corrupt input the reader raises ProtocolError and nothing else. A trace cut short
or damaged after its header still opens: the stream ends at the last good chunk and
``warnings`` names the byte offset where the good data ends.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from typing import Iterator

from ..protocol.codec import ProtocolError, decode, unpack_limited
from ..protocol.events import HelloEvent, SnapshotEvent, StepEvent
from . import format as F
from .summary import Tally, TraceSummary

__all__ = ["TraceReader", "TraceSummary", "ChunkInfo"]


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    offset: int  # byte offset of the chunk record
    first_step: int  # step of its opening snapshot
    last_step: int  # highest step in it
    events: int


class _ChunkError(Exception):
    pass


class _FileSource:
    def __init__(self, path: str):
        self.path = path
        self.size = os.path.getsize(path)

    def open(self):
        return open(self.path, "rb")


class _BytesHandle:
    def __init__(self, data: bytes):
        self._data = data
        self._pos = 0

    def seek(self, pos: int) -> None:
        self._pos = pos

    def read(self, n: int) -> bytes:
        b = self._data[self._pos : self._pos + n]
        self._pos += len(b)
        return b

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class _BytesSource:
    def __init__(self, data: bytes):
        self.data = bytes(data)
        self.size = len(self.data)

    def open(self):
        return _BytesHandle(self.data)


def _read_at(f, off: int, n: int) -> bytes:
    f.seek(off)
    return f.read(n)


class TraceReader:
    """Read a trace: ``hello``, ``warnings``, iterate events, ``seek(step)``, ``summary()``."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._init(_FileSource(self.path))

    @classmethod
    def from_bytes(cls, data: bytes) -> "TraceReader":
        self = cls.__new__(cls)
        self.path = "<bytes>"
        self._init(_BytesSource(data))
        return self

    # ------------------------------------------------------------------ opening

    def _init(self, src) -> None:
        self._src = src
        self.size = src.size
        self.warnings: list[str] = []
        self.complete = False
        self._stats: dict | None = None
        self._cache: tuple[int, list] | None = None
        with src.open() as f:
            self.hello, self._data_start = self._read_header(f)
            chunks = self._read_index(f)
            if chunks is None:
                chunks = self._scan(f)
        self._chunks: list[ChunkInfo] = chunks

    def _read_header(self, f) -> tuple[HelloEvent, int]:
        head = _read_at(f, 0, F.HEADER.size)
        if len(head) == 0:
            raise ProtocolError("not a kvscope trace: empty file")
        n = min(len(head), len(F.MAGIC))
        if head[:n] != F.MAGIC[:n]:
            raise ProtocolError("not a kvscope trace: bad magic")
        if len(head) < F.HEADER.size:
            raise ProtocolError(f"truncated kvscope trace: header cut short at byte {len(head)}")
        magic, version, _flags, hello_len, crc = F.HEADER.unpack(head)
        if version != F.FORMAT_VERSION:
            raise ProtocolError(f"unsupported trace format version {version} (this build reads {F.FORMAT_VERSION})")
        if hello_len > F.MAX_HELLO_BYTES:
            raise ProtocolError(f"corrupt kvscope trace: hello length {hello_len} too large")
        data = _read_at(f, F.HEADER.size, hello_len)
        if len(data) < hello_len:
            raise ProtocolError(
                f"truncated kvscope trace: header cut short at byte {F.HEADER.size + len(data)}"
            )
        if zlib.crc32(data) != crc:
            raise ProtocolError("corrupt kvscope trace: header checksum mismatch")
        hello = decode(data)  # ProtocolError on bad hello (wrong protocol version included)
        if not isinstance(hello, HelloEvent):
            raise ProtocolError(f"corrupt kvscope trace: header holds a {hello.type} event, not hello")
        return hello, F.HEADER.size + hello_len

    def _read_index(self, f) -> list[ChunkInfo] | None:
        """Chunks from the index, or None (with a warning if it is there but bad)."""
        size = self.size
        if size < self._data_start + F.FOOTER.size:
            return None
        magic, index_at = F.FOOTER.unpack(_read_at(f, size - F.FOOTER.size, F.FOOTER.size))
        if magic != F.FOOTER_MAGIC:
            return None
        try:
            return self._load_index(f, index_at)
        except (ProtocolError, _ChunkError) as e:
            self.warnings.append(f"index unreadable ({e}); rebuilt it by scanning the chunks")
            return None

    def _load_index(self, f, index_at: int) -> list[ChunkInfo]:
        size = self.size
        end = size - F.FOOTER.size
        if not (self._data_start <= index_at <= end - F.RECORD.size):
            raise _ChunkError(f"index offset {index_at} out of range")
        tag, length, crc = F.RECORD.unpack(_read_at(f, index_at, F.RECORD.size))
        if tag != F.INDEX_TAG or index_at + F.RECORD.size + length != end or length > F.MAX_INDEX_BYTES:
            raise _ChunkError(f"no index record at byte {index_at}")
        body = _read_at(f, index_at + F.RECORD.size, length)
        if zlib.crc32(body) != crc:
            raise _ChunkError("index checksum mismatch")
        idx = unpack_limited(body, F.MAX_INDEX_BYTES, max_map_len=64)
        if type(idx) is not dict or type(idx.get("chunks")) is not list:
            raise _ChunkError("index is not a map with 'chunks'")
        chunks: list[ChunkInfo] = []
        expect = self._data_start
        for entry in idx["chunks"]:
            if (
                type(entry) is not list
                or len(entry) != 4
                or any(type(x) is not int for x in entry)
            ):
                raise _ChunkError("bad index entry")
            off, first, last, n = entry
            if off != expect:
                raise _ChunkError(f"index entry points at byte {off}, expected {expect}")
            info, nxt = self._chunk_header(f, off, end)
            if (info.first_step, info.last_step, info.events) != (first, last, n):
                raise _ChunkError(f"index entry for byte {off} does not match the chunk")
            chunks.append(info)
            expect = nxt
        if expect != index_at:
            raise _ChunkError(f"chunks end at byte {expect}, index starts at {index_at}")
        stats = idx.get("stats")
        if type(stats) is dict:
            self._stats = stats
        self.complete = True
        return chunks

    def _chunk_header(self, f, off: int, limit: int) -> tuple[ChunkInfo, int]:
        """Parse a chunk record header at ``off``; returns its info and the next offset."""
        head = _read_at(f, off, F.RECORD.size + F.CHUNK_META.size)
        if len(head) < F.RECORD.size + F.CHUNK_META.size:
            raise _ChunkError("incomplete chunk header")
        tag, length, _crc = F.RECORD.unpack_from(head)
        if tag != F.CHUNK_TAG:
            raise _ChunkError(f"no chunk at byte {off}")
        if length < F.CHUNK_META.size or length > F.MAX_CHUNK_BYTES:
            raise _ChunkError(f"bad chunk length {length}")
        nxt = off + F.RECORD.size + length
        if nxt > limit:
            raise _ChunkError("incomplete chunk")
        first, last, n, raw_len = F.CHUNK_META.unpack_from(head, F.RECORD.size)
        if n < 1 or n > F.MAX_CHUNK_EVENTS or raw_len > F.MAX_CHUNK_RAW_BYTES or last < first:
            raise _ChunkError("bad chunk metadata")
        return ChunkInfo(off, first, last, n), nxt

    def _scan(self, f) -> list[ChunkInfo]:
        """Rebuild the chunk list by walking the file; stops at the first bad byte."""
        size = self.size
        pos = self._data_start
        chunks: list[ChunkInfo] = []
        while True:
            head = _read_at(f, pos, F.RECORD.size)
            if head[:4] == F.INDEX_TAG or F.INDEX_TAG.startswith(head[:4]):
                # end of the chunks: the file ends here, or the index/footer is bad
                if not self.warnings:
                    self.warnings.append(
                        f"trace has no valid index (recording did not finish, or the file was cut "
                        f"short at byte {size}); good data ends at byte {pos}"
                    )
                break
            try:
                info, nxt = self._chunk_header(f, pos, size)
                body = _read_at(f, pos + F.RECORD.size, nxt - pos - F.RECORD.size)
                if zlib.crc32(body) != F.RECORD.unpack_from(head)[2]:
                    raise _ChunkError("checksum mismatch")
            except _ChunkError as e:
                if pos + F.RECORD.size + F.CHUNK_META.size > size or "incomplete" in str(e):
                    what = f"trace cut short at byte {size} (incomplete chunk at byte {pos})"
                else:
                    what = f"corrupt chunk at byte {pos} ({e})"
                self.warnings.append(f"{what}; good data ends at byte {pos}")
                break
            chunks.append(info)
            pos = nxt
        return chunks

    # ------------------------------------------------------------------ chunks

    def _decode_chunk(self, f, info: ChunkInfo) -> list:
        head = _read_at(f, info.offset, F.RECORD.size)
        if len(head) < F.RECORD.size:
            raise _ChunkError("incomplete chunk header")
        tag, length, crc = F.RECORD.unpack(head)
        if tag != F.CHUNK_TAG or length < F.CHUNK_META.size or length > F.MAX_CHUNK_BYTES:
            raise _ChunkError("bad chunk header")
        body = _read_at(f, info.offset + F.RECORD.size, length)
        if len(body) < length:
            raise _ChunkError("incomplete chunk")
        if zlib.crc32(body) != crc:
            raise _ChunkError("checksum mismatch")
        first, last, n, raw_len = F.CHUNK_META.unpack_from(body)
        if raw_len > F.MAX_CHUNK_RAW_BYTES or n < 1 or n > F.MAX_CHUNK_EVENTS:
            raise _ChunkError("bad chunk metadata")
        try:
            d = zlib.decompressobj()
            raw = d.decompress(body[F.CHUNK_META.size :], raw_len + 1)
            if len(raw) != raw_len or not d.eof or d.unused_data or d.unconsumed_tail:
                raise _ChunkError("compressed data does not match its stated length")
        except zlib.error as e:
            raise _ChunkError(f"bad compressed data: {e}") from None
        events = []
        pos = 0
        mv = memoryview(raw)
        while pos < raw_len:
            if pos + 4 > raw_len:
                raise _ChunkError("event length cut short")
            (ln,) = F.EVENT_LEN.unpack_from(raw, pos)
            pos += 4
            if ln == 0 or pos + ln > raw_len:
                raise _ChunkError("bad event length")
            try:
                ev = decode(mv[pos : pos + ln])
            except ProtocolError as e:
                raise _ChunkError(f"bad event: {e}") from None
            if isinstance(ev, HelloEvent):
                raise _ChunkError("hello event inside a chunk")
            events.append(ev)
            pos += ln
        if len(events) != n:
            raise _ChunkError(f"holds {len(events)} events, header says {n}")
        snap = events[0]
        if not isinstance(snap, SnapshotEvent) or snap.step != first:
            raise _ChunkError("does not open with its snapshot")
        return events

    def _load(self, f, i: int) -> list | None:
        """Events of chunk i, or None if it is bad (the trace then ends before it)."""
        if self._cache is not None and self._cache[0] == i:
            return list(self._cache[1])
        info = self._chunks[i]
        try:
            events = self._decode_chunk(f, info)
        except _ChunkError as e:
            self.warnings.append(f"corrupt chunk at byte {info.offset} ({e}); good data ends at byte {info.offset}")
            del self._chunks[i:]
            self.complete = False
            self._stats = None
            return None
        self._cache = (i, events)
        return list(events)

    # ------------------------------------------------------------------ public API

    @property
    def chunks(self) -> list[ChunkInfo]:
        return list(self._chunks)

    def __iter__(self) -> Iterator:
        yield self.hello
        with self._src.open() as f:
            i = 0
            while i < len(self._chunks):
                events = self._load(f, i)
                if events is None:
                    return
                yield from events
                i += 1

    def events(self) -> Iterator:
        """Same as iterating the reader: hello first, then every event in order."""
        return iter(self)

    def seek(self, step: int) -> list:
        """Events to rebuild the state at ``step``: the nearest snapshot at or before it,
        then every event up to and including the step event for ``step``.

        ``step`` is clamped to the trace: before the first snapshot gives that
        snapshot alone; past the end gives the last chunk up to its last step.
        Returns [] for a trace with no readable chunk.
        """
        with self._src.open() as f:
            while self._chunks:
                i = 0
                for j, c in enumerate(self._chunks):
                    if c.first_step <= step:
                        i = j
                    else:
                        break
                events = self._load(f, i)
                if events is None:
                    continue  # chunk list was cut; try again with what is left
                end = 0
                for k, ev in enumerate(events):
                    if type(ev) is StepEvent and ev.step <= step:
                        end = k
                start = 0
                for k in range(end, -1, -1):
                    ev = events[k]
                    if type(ev) is SnapshotEvent and ev.step <= step:
                        start = k
                        break
                return events[start : end + 1]
        return []

    def summary(self) -> TraceSummary:
        """Counts from the index when the trace is complete, else from a full scan."""
        stats = self._stats if self.complete else None
        counts = _stats_ok(stats)
        if counts is None:
            tally = Tally()
            it = iter(self)
            next(it)  # hello
            for ev in it:
                tally.add(ev)
            counts = tally.to_wire()
        return TraceSummary(
            format_version=F.FORMAT_VERSION,
            protocol_version=self.hello.version,
            wall_start=self.hello.wall_start,
            chunks=len(self._chunks),
            bytes=self.size,
            complete=self.complete,
            warnings=list(self.warnings),
            **counts,
        )


_STAT_KEYS = {
    "events": (int,),
    "steps": (int,),
    "first_step": (int, type(None)),
    "last_step": (int, type(None)),
    "t_first": (float, int, type(None)),
    "t_last": (float, int, type(None)),
    "requests": (int,),
    "rejects": (int,),
    "preemptions": (int,),
    "finished": (int,),
    "dropped": (int,),
}


def _stats_ok(stats) -> dict | None:
    if type(stats) is not dict:
        return None
    out = {}
    for k, types in _STAT_KEYS.items():
        v = stats.get(k)
        if type(v) not in types:
            return None
        out[k] = v
    return out

