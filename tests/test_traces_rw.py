"""Trace files: write/read round trip, seek, summary, truncation, corruption, fuzzing."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import zlib

import msgpack
import pytest
from fakes.streams import make_events, record_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.protocol import ByeEvent, ProtocolError, SnapshotEvent, StepEvent, encode
from kvscope.protocol.blockmap import BlockMap
from kvscope.traces import TraceReader, TraceWriter
from kvscope.traces import format as F
from kvscope.traces.info import trace_info


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A small complete trace: 3+ chunks."""
    path = tmp_path_factory.mktemp("tr") / "small.kvtrace"
    w, hello, written, truth = record_run(path, n_steps=14, seed=2, chunk_steps=5)
    data = path.read_bytes()
    return path, data, hello, written, truth


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    path = tmp_path_factory.mktemp("tr") / "medium.kvtrace"
    w, hello, written, truth = record_run(path, n_steps=300, seed=7, chunk_steps=16)
    return path, hello, written, truth


def _replay_owners(events):
    owners = None
    for ev in events:
        if isinstance(ev, SnapshotEvent):
            owners = BlockMap.from_snapshot(ev)
        elif isinstance(ev, StepEvent):
            owners.apply_step(ev)
    return owners.owners()


# ----------------------------------------------------------------------------- round trip


def test_round_trip_and_layout(medium):
    path, hello, written, truth = medium
    r = TraceReader(path)
    assert r.hello == hello
    assert r.warnings == [] and r.complete
    events = list(r)
    assert events[0] == hello
    assert events[1:] == written
    assert len(r.chunks) > 10
    with open(path, "rb") as f:
        assert f.read(8) == b"KVTRACE\0"
    for c in r.chunks:  # every chunk opens with a snapshot of its first step
        first = r.seek(c.first_step)[0]
        assert isinstance(first, SnapshotEvent) and first.step == c.first_step
    assert _replay_owners(events) == truth[max(truth)]


def test_background_and_inline_writers_write_the_same_bytes(tmp_path):
    record_run(tmp_path / "a", n_steps=60, seed=1, chunk_steps=7, background=True)
    record_run(tmp_path / "b", n_steps=60, seed=1, chunk_steps=7, background=False)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()


def test_seek_equals_iterating_from_the_start(medium):
    path, hello, written, truth = medium
    r = TraceReader(path)
    for step in list(range(0, 301, 7)) + [1, 15, 16, 17, 299, 300]:
        evs = r.seek(step)
        assert isinstance(evs[0], SnapshotEvent) and evs[0].step <= step
        steps = [e for e in evs if isinstance(e, StepEvent)]
        assert all(e.step <= step for e in steps)
        if step > 0:
            assert evs[-1].step == step  # ends with the step event asked for
        assert _replay_owners(evs) == truth[step], step
    # clamped at both ends
    assert r.seek(-5) == [written[0]]
    assert _replay_owners(r.seek(10_000)) == truth[300]


def test_seek_uses_the_nearest_snapshot_inside_a_chunk(tmp_path):
    hello, events, truth = make_events(40, seed=3, snapshot_every=3)
    with TraceWriter(tmp_path / "t", hello, chunk_steps=1000, max_chunk_s=None) as w:
        for ev in events:
            w.publish(ev)
    r = TraceReader(tmp_path / "t")
    assert len(r.chunks) == 1
    evs = r.seek(20)
    assert evs[0].step == 18 and [e.step for e in evs if isinstance(e, StepEvent)] == [19, 20]
    assert _replay_owners(evs) == truth[20]


def test_summary_from_index_equals_scan(medium, tmp_path):
    path, hello, written, truth = medium
    s = TraceReader(path).summary()
    data = path.read_bytes()
    cut = tmp_path / "noindex"
    cut.write_bytes(data[: TraceReader(path).chunks[-1].offset])  # drop last chunk + index
    full_scan = tmp_path / "scan"
    # same file with a broken footer: the summary comes from a scan
    full_scan.write_bytes(data[:-16] + b"XXXXXXXX" + data[-8:])
    s2 = TraceReader(full_scan).summary()
    assert not s2.complete and s2.warnings
    for k in ("events", "steps", "first_step", "last_step", "t_first", "t_last", "requests", "rejects",
              "preemptions", "finished", "dropped", "chunks", "bytes"):
        assert getattr(s, k) == getattr(s2, k), k
    steps = [e for e in written if isinstance(e, StepEvent)]
    assert s.steps == 300 and s.first_step == 1 and s.last_step == 300
    assert s.finished == sum(len(e.finished) for e in steps) > 0
    assert s.preemptions == sum(len(e.preemptions) for e in steps) > 0
    assert s.events == len(written) and s.complete and s.warnings == []
    assert s.span == pytest.approx(steps[-1].t + steps[-1].dur - steps[0].t)
    s3 = TraceReader(cut).summary()
    assert s3.steps < s.steps and s3.warnings


def test_writer_without_snapshot_skips_until_one_arrives(tmp_path):
    hello, events, truth = make_events(10, seed=1)
    w = TraceWriter(tmp_path / "t", hello, max_chunk_s=None)
    w.publish(StepEvent(1, 0.0, 0.0, 1))  # no snapshot yet, no provider
    assert w.skipped == 1 and w.wants_snapshot
    for ev in events:
        w.publish(ev)
    w.close()
    assert list(TraceReader(tmp_path / "t"))[1:] == events
    with pytest.raises(ValueError):
        w.publish(events[1])


def test_writer_ignores_repeated_hello(tmp_path):
    hello, events, truth = make_events(10, seed=1)
    with TraceWriter(tmp_path / "t", hello) as w:
        w.publish(hello)  # engines publish hello next to snapshots
        for ev in events:
            w.publish(ev)
            w.publish(hello)
    assert list(TraceReader(tmp_path / "t")) == [hello] + events


def test_killed_writer_loses_at_most_the_open_chunk(tmp_path):
    path = tmp_path / "t"
    w, hello, written, truth = record_run(path, n_steps=50, seed=4, chunk_steps=10, close=False,
                                            background=False)
    r = TraceReader(path)  # the writer was never closed: no index
    assert not r.complete and r.warnings and "good data ends at byte" in r.warnings[0]
    got = list(r)[1:]
    assert got == written[: len(got)]
    assert len(written) - len(got) <= 40  # only the open chunk is missing
    assert _replay_owners(got) == truth[r.chunks[-1].last_step]
    w.close()
    assert TraceReader(path).complete


def test_empty_trace(tmp_path):
    hello, events, truth = make_events(1)
    TraceWriter(tmp_path / "t", hello).close()
    r = TraceReader(tmp_path / "t")
    assert list(r) == [hello] and r.seek(3) == [] and r.complete
    s = r.summary()
    assert s.steps == 0 and s.span == 0.0 and s.chunks == 0


# ----------------------------------------------------------------------------- info


def test_trace_info(medium):
    path, hello, written, truth = medium
    text = trace_info(path)
    assert "kvtrace v1, protocol v1" in text and "steps:      300 (1..300)" in text
    assert "warnings:   none" in text and "model=qwen3-0.6b" in text and "time span:" in text
    assert "requests:" in text


def test_trace_info_on_non_trace_is_one_line_protocol_error(tmp_path):
    p = tmp_path / "x.txt"
    p.write_text("hello world, not a trace\n")
    with pytest.raises(ProtocolError) as e:
        trace_info(p)
    assert str(e.value).startswith("not a kvscope trace") and "\n" not in str(e.value)


def test_reading_needs_neither_torch_nor_zmq(medium):
    path = medium[0]
    code = (
        "import sys\n"
        "for m in ('zmq', 'torch', 'textual'):\n"
        "    sys.modules[m] = None\n"
        "from kvscope.traces import TraceReader\n"
        "from kvscope.traces.info import trace_info\n"
        f"r = TraceReader({str(path)!r})\n"
        "assert len(list(r)) > 100 and r.seek(50)\n"
        f"trace_info({str(path)!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ----------------------------------------------------------------------------- damage


def test_truncation_at_every_byte_offset(small):
    """Every cut replays a prefix of the original events (whole chunks) plus a warning
    naming where the good data ends; a cut inside the header is a ProtocolError."""
    path, data, hello, written, truth = small
    full = [hello] + written
    header_len = F.HEADER.size + len(encode(hello))
    assert len(data) < 4000
    prefixes = set()
    for cut in range(len(data) + 1):
        blob = data[:cut]
        if cut < header_len:
            with pytest.raises(ProtocolError):
                TraceReader.from_bytes(blob)
            continue
        r = TraceReader.from_bytes(blob)
        got = list(r)
        assert got == full[: len(got)], cut
        assert r.hello == hello
        if cut == len(data):
            assert r.warnings == [] and got == full
            continue
        assert len(r.warnings) == 1, (cut, r.warnings)
        good_end = int(r.warnings[0].rsplit("good data ends at byte ", 1)[1])
        assert good_end <= cut
        # the prefix is exactly the chunks that fit before the cut
        assert (r.chunks[-1].offset if r.chunks else header_len) <= good_end
        prefixes.add(len(got))
        s = r.summary()
        assert s.warnings and s.events == len(got) - 1
        if r.chunks:
            assert _replay_owners(r.seek(10**9)) == truth[r.chunks[-1].last_step]
    assert len(prefixes) >= 3  # cuts land in several different chunks


def test_cut_inside_header_or_foreign_files(tmp_path):
    for blob, msg in [(b"", "empty"), (b"PK\x03\x04zipzipzip" * 3, "not a kvscope trace"),
                      (b"KVTR", "cut short"), (b"\x89PNG\r\n\x1a\n" + bytes(40), "not a kvscope trace")]:
        with pytest.raises(ProtocolError, match=msg):
            TraceReader.from_bytes(blob)
    p = tmp_path / "e"
    p.write_bytes(b"")
    with pytest.raises(ProtocolError, match="not a kvscope trace"):
        TraceReader(p)


def _header(hello_bytes, version=F.FORMAT_VERSION, crc=None):
    return F.HEADER.pack(F.MAGIC, version, 0, len(hello_bytes),
                         zlib.crc32(hello_bytes) if crc is None else crc) + hello_bytes


def _chunk(events_bytes: list[bytes], first=0, last=0, n=None, raw=None, comp=None, crc_ok=True):
    if raw is None:
        raw = b"".join(struct.pack("<I", len(b)) + b for b in events_bytes)
    body = zlib.compress(raw) if comp is None else comp
    meta = F.CHUNK_META.pack(first, last, len(events_bytes) if n is None else n, len(raw))
    crc = zlib.crc32(body, zlib.crc32(meta)) if crc_ok else 0
    return F.RECORD.pack(F.CHUNK_TAG, len(meta) + len(body), crc) + meta + body


def test_crafted_bad_files_with_valid_checksums():
    hello, events, truth = make_events(3)
    hb = encode(hello)
    snap = encode(events[0])
    step = next(encode(e) for e in events if isinstance(e, StepEvent))
    good = _chunk([snap, step], 0, 1)
    # header problems
    with pytest.raises(ProtocolError, match="version"):
        TraceReader.from_bytes(_header(hb, version=9))
    with pytest.raises(ProtocolError, match="checksum"):
        TraceReader.from_bytes(_header(hb, crc=1))
    with pytest.raises(ProtocolError, match="not hello"):
        TraceReader.from_bytes(_header(snap))
    with pytest.raises(ProtocolError):
        TraceReader.from_bytes(_header(b"\xc1\xc1"))
    bad_chunks = {
        "garbage compressed": _chunk([snap], comp=b"not zlib at all"),
        "raw length lies": _chunk([snap], raw=None, n=1, comp=zlib.compress(struct.pack("<I", len(snap)) + snap + b"x")),
        "event count lies": _chunk([snap, step], n=5),
        "no snapshot first": _chunk([step, snap], 1, 1),
        "snapshot step mismatch": _chunk([snap], first=3, last=3),
        "bad event bytes": _chunk([b"\xc1"]),
        "hello inside": _chunk([snap, hb]),
        "zero-length event": _chunk([snap, b""]),
        "bad crc": _chunk([snap], crc_ok=False),
        "bomb": _chunk([snap], raw=struct.pack("<I", len(snap)) + snap, comp=zlib.compress(bytes(50 << 20))),
    }
    for name, bad in bad_chunks.items():
        blob = _header(hb) + good + bad + good
        r = TraceReader.from_bytes(blob)
        got = list(r)
        assert got[0] == hello and len(got) == 3, name  # hello + the first good chunk only
        assert r.warnings and "good data ends at byte" in r.warnings[-1], name
        assert len(r.seek(5)) <= 2
        r.summary()
    # an index that lies is ignored (scan instead), with a warning
    body = _header(hb) + good
    idx = msgpack.packb({"chunks": [[999, 0, 1, 2]], "stats": {}})
    blob = body + F.RECORD.pack(F.INDEX_TAG, len(idx), zlib.crc32(idx)) + idx + F.FOOTER.pack(F.FOOTER_MAGIC, len(body))
    r = TraceReader.from_bytes(blob)
    assert len(list(r)) == 3 and any("index unreadable" in w for w in r.warnings)
    blob = body + F.FOOTER.pack(F.FOOTER_MAGIC, 2**63)
    r = TraceReader.from_bytes(blob)
    assert len(list(r)) == 3 and r.warnings


TRACE_FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                             HealthCheck.function_scoped_fixture])


@TRACE_FUZZ
@given(st.data())
def test_fuzz_reader_bit_flips_and_cuts(small, data):
    path, blob, hello, written, truth = small
    full = [hello] + written
    b = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 6))):
        pos = data.draw(st.integers(0, len(b) - 1))
        b[pos] ^= 1 << data.draw(st.integers(0, 7))
    if data.draw(st.booleans()):
        b = b[: data.draw(st.integers(0, len(b)))]
    try:
        r = TraceReader.from_bytes(bytes(b))
    except ProtocolError:
        return
    got = list(r)
    r.summary()
    r.seek(data.draw(st.integers(-2, 20)))
    if got != full:
        # a clean partial read: a prefix of the original stream, and a warning
        assert r.warnings
        assert got == full[: len(got)]


@TRACE_FUZZ
@given(st.binary(max_size=200))
def test_fuzz_reader_random_bytes_after_magic(tail):
    for blob in (tail, b"KVTRACE\0" + tail):
        try:
            r = TraceReader.from_bytes(blob)
        except ProtocolError:
            continue
        list(r)
        r.summary()


def test_missing_file_is_os_error(tmp_path):
    with pytest.raises(OSError):
        TraceReader(tmp_path / "nope.kvtrace")
    assert not os.path.exists(tmp_path / "nope.kvtrace")


def test_bye_recorded_last(medium):
    path = medium[0]
    assert isinstance(list(TraceReader(path))[-1], ByeEvent)
