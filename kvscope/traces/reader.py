"""TraceReader: reads .kvtrace files (docs/TRACE_FORMAT.md). Needs neither torch nor zmq.

On corrupt input the reader raises ProtocolError and nothing else. A trace cut short
or damaged after its header still opens: the stream ends at the last good chunk and
``warnings`` names the byte offset where the good data ends.
"""

from __future__ import annotations

import copy
import math
import os
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator

from ..protocol.codec import ProtocolError, UnknownEventType, decode, unpack_limited
from ..protocol.events import BACKEND_VLLM, SNAPSHOT_TYPES, TICK_TYPES, HelloEvent
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


def _inflate(data: bytes, raw_len: int) -> bytes:
    """Decompress a chunk to exactly its declared raw length, never more. The first piece is
    checked before the rest is inflated, so a zlib bomb of garbage fails after 64 KiB, not 64 MiB."""
    try:
        d = zlib.decompressobj()
        raw = d.decompress(data, min(raw_len + 1, F.FIRST_PIECE_BYTES))
        if len(raw) >= F.EVENT_LEN.size:
            (ln,) = F.EVENT_LEN.unpack_from(raw)
            if ln == 0 or F.EVENT_LEN.size + ln > raw_len:
                raise _ChunkError("bad event length")
        if len(raw) <= raw_len and not d.eof:
            raw += d.decompress(d.unconsumed_tail, raw_len + 1 - len(raw))
        if len(raw) != raw_len or not d.eof or d.unused_data or d.unconsumed_tail:
            raise _ChunkError("compressed data does not match its stated length")
    except zlib.error as e:
        raise _ChunkError(f"bad compressed data: {e}") from None
    return raw


class TraceKindError(ProtocolError):
    """A readable trace of the wrong kind for the command (a recorded vLLM where an engine's is needed)."""


def engine_trace(path: str | os.PathLike, command: str) -> "TraceReader":
    """Open a trace of a kvscope engine run; a recorded vLLM is a one-line TraceKindError naming ``command``."""
    reader = TraceReader(path)
    if reader.vllm_recording:
        raise TraceKindError(f"{os.fspath(path)} is a recorded vLLM (kvscope record --vllm): {command} reads kvscope "
                             "engine traces; kvscope replay shows this one")
    return reader


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
        self._unknown_at: dict[int, int] = {}  # chunk offset -> events of unknown type skipped there
        self.complete = False
        self._stats: dict | None = None
        self._counted: dict | None = None  # counts from decoding every chunk (verify)
        self._warned_stats = False
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
        lost = idx.get("lost")
        if type(lost) is int and lost > 0:
            self.warnings.append(f"the writer could not record {lost} events (over the decode limit, or a "
                                 "chunk too large to split); the trace skips them")
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
        raw = _inflate(body[F.CHUNK_META.size :], raw_len)
        events = []
        seen = 0  # events in the chunk, skipped ones included
        skipped = 0
        pos = 0
        mv = memoryview(raw)
        while pos < raw_len:
            if pos + 4 > raw_len:
                raise _ChunkError("event length cut short")
            (ln,) = F.EVENT_LEN.unpack_from(raw, pos)
            pos += 4
            if ln == 0 or pos + ln > raw_len:
                raise _ChunkError("bad event length")
            if seen == n:
                raise _ChunkError(f"holds more events than the {n} its header says")
            seen += 1
            try:
                ev = decode(mv[pos : pos + ln])
            except UnknownEventType:
                if events:  # a later v1 writer's event type: skipped (docs/PROTOCOL.md, Versioning)
                    skipped += 1
                    pos += ln
                    continue
                raise _ChunkError("does not open with its snapshot") from None
            except ProtocolError as e:
                raise _ChunkError(f"bad event: {e}") from None
            except RecursionError:  # the codec bounds nesting; this is a second line of defence
                raise _ChunkError("bad event: nested too deeply") from None
            if isinstance(ev, HelloEvent):
                raise _ChunkError("hello event inside a chunk")
            if not events and (type(ev) not in SNAPSHOT_TYPES or ev.step != first):
                raise _ChunkError("does not open with its snapshot")  # checked first: garbage fails fast
            events.append(ev)
            pos += ln
        if seen != n:
            raise _ChunkError(f"holds {seen} events, header says {n}")
        if skipped:
            self._note_unknown(info.offset, skipped)
        return events

    def _note_unknown(self, offset: int, n: int) -> None:
        if offset not in self._unknown_at:
            self._unknown_at[offset] = n
            self.warnings.append(f"chunk at byte {offset} holds {n} events of a type this build does not know "
                                 "(a later kvscope wrote them); skipped them")

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
    def vllm_recording(self) -> bool:
        """A watched vLLM's trace (`kvscope record --vllm`), not a kvscope engine's."""
        return self.hello.config.backend == BACKEND_VLLM

    @property
    def chunks(self) -> list[ChunkInfo]:
        return list(self._chunks)

    def fork(self) -> "TraceReader":
        """A second reader of the same trace for another thread: its own chunk list, cache and
        warnings, and a file handle per pass as always; the header and index are not read again."""
        other = copy.copy(self)
        other._chunks = list(self._chunks)
        other.warnings = list(self.warnings)
        other._unknown_at = dict(self._unknown_at)
        other._cache = None
        return other

    def indexed_span(self) -> tuple[int, int, float, float] | None:
        """(first step, last step, first step's start, last step's end) from the trace's index,
        without reading a chunk; None when the index is missing or its stats do not hold up."""
        if not self.complete or self._stats is None:
            return None
        counts, problem = _check_stats(self._stats, self._chunks)
        if problem is not None or counts is None or counts["first_step"] is None:
            return None
        if counts["t_first"] is None or counts["t_last"] is None:
            return None
        return counts["first_step"], counts["last_step"], counts["t_first"], counts["t_last"]

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

    def iter_from(self, step: int) -> Iterator:
        """Every event from the nearest snapshot at or before ``step`` to the end of the trace
        (no hello): what a player needs to jump to ``step`` and go on from there."""
        with self._src.open() as f:
            events = None
            while self._chunks and events is None:  # a bad chunk cuts the list: try what is left
                i = self._chunk_for(step)
                events = self._load(f, i)
            if events is None:
                return
            yield from events[_last_snapshot(events, step, len(events) - 1):]
            for i in range(i + 1, len(self._chunks)):
                events = self._load(f, i)
                if events is None:
                    return
                yield from events

    def seek(self, step: int) -> list:
        """Events to rebuild the state at ``step``: the nearest snapshot at or before it,
        then every event up to and including the step event for ``step``.

        ``step`` is clamped to the trace: before the first snapshot gives that
        snapshot alone; past the end gives the last chunk up to its last step.
        Returns [] for a trace with no readable chunk.
        """
        with self._src.open() as f:
            while self._chunks:
                events = self._load(f, self._chunk_for(step))
                if events is None:
                    continue  # chunk list was cut; try again with what is left
                end = 0
                for k, ev in enumerate(events):
                    if type(ev) in TICK_TYPES and ev.step <= step:
                        end = k
                return events[_last_snapshot(events, step, end) : end + 1]
        return []

    def _chunk_for(self, step: int) -> int:
        """The last chunk opening at or before ``step`` (the first when ``step`` precedes them all)."""
        i = 0
        for j, c in enumerate(self._chunks):
            if c.first_step > step:
                break
            i = j
        return i

    def verify(self, on_event: Callable[[object], None] | None = None) -> None:
        """Read and decode every chunk (checksums, lengths, events), as `kvscope trace-info` does.
        Damage ends the trace at the bad chunk, with a warning naming its byte offset; the counts
        of what is readable replace the index's in ``summary()``. ``on_event`` sees every event
        of the pass (a caller's own counts, without reading the trace twice)."""
        tally = Tally()
        it = iter(self)
        next(it)  # hello
        for ev in it:
            tally.add(ev)
            if on_event is not None:
                on_event(ev)
        counted = tally.to_wire()
        counted["events"] += sum(self._unknown_at.values())  # the index counts what was written
        stats = self._stats if self.complete else None
        if stats is not None:
            index_counts, problem = _check_stats(stats, self._chunks)
            if problem is not None:
                self._warn_stats(problem)
            elif index_counts != counted:
                differ = next(k for k in counted if counted[k] != index_counts[k])
                self.warnings.append(f"index stats do not match the chunks ({differ}: index says "
                                     f"{index_counts[differ]}, chunks hold {counted[differ]}); "
                                     "showing the chunks' counts")
        self._counted = counted

    def _warn_stats(self, problem: str) -> None:
        if not self._warned_stats:
            self._warned_stats = True
            self.warnings.append(f"index stats are wrong ({problem}); counted the chunks instead")

    def summary(self) -> TraceSummary:
        """Counts from the chunks after ``verify()``; else from the index when it is valid and its
        stats are consistent; else from a full scan."""
        counts = self._counted
        if counts is None and self.complete and self._stats is not None:
            counts, problem = _check_stats(self._stats, self._chunks)
            if problem is not None:
                self._warn_stats(problem)
        if counts is None:
            self.verify()
            counts = self._counted
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


_COUNT_KEYS = ("events", "steps", "requests", "rejects", "preemptions", "finished", "dropped")


def _last_snapshot(events: list, step: int, end: int) -> int:
    """Index of the last snapshot at or before ``step`` in ``events[: end + 1]`` (0: the chunk's own)."""
    for k in range(end, -1, -1):
        ev = events[k]
        if type(ev) in SNAPSHOT_TYPES and ev.step <= step:
            return k
    return 0


def _check_stats(stats, chunks: list[ChunkInfo]) -> tuple[dict | None, str | None]:
    """The index's counts, or None and what is wrong with them (they are printed, so never trusted)."""
    if type(stats) is not dict:
        return None, "not a map"
    out = {}
    for k in _COUNT_KEYS:
        v = stats.get(k)
        if type(v) is not int or v < 0:
            return None, f"{k} {_show(v)}"
        out[k] = v
    for k in ("first_step", "last_step"):
        v = stats.get(k)
        if v is not None and type(v) is not int:
            return None, f"{k} {_show(v)}"
        out[k] = v
    for k in ("t_first", "t_last"):
        v = stats.get(k)
        if v is not None and (type(v) not in (int, float) or not math.isfinite(v)):
            return None, f"{k} {_show(v)}"
        out[k] = None if v is None else float(v)
    held = sum(c.events for c in chunks)
    if out["events"] != held:
        return None, f"events {out['events']}, the chunks hold {held}"
    if out["steps"] > out["events"]:
        return None, f"steps {out['steps']} > events {out['events']}"
    if (out["first_step"] is None) != (out["steps"] == 0) or (out["last_step"] is None) != (out["steps"] == 0):
        return None, f"first/last step {out['first_step']}/{out['last_step']} with {out['steps']} steps"
    if out["first_step"] is not None and out["first_step"] > out["last_step"]:
        return None, f"first_step {out['first_step']} > last_step {out['last_step']}"
    if out["t_first"] is not None and out["t_last"] is not None and out["t_first"] > out["t_last"]:
        return None, f"t_first {out['t_first']} > t_last {out['t_last']}"
    return out, None


def _show(v) -> str:
    s = repr(v) if isinstance(v, (int, float, str, type(None), bool)) else f"<{type(v).__name__}>"
    return s if len(s) <= 40 else s[:37] + "..."
