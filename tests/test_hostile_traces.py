"""Crafted and damaged traces: what `kvscope trace-info` and `kvscope replay` users get.

The good trace comes from the real scheduler (sim backend); the bad ones are made from it
byte by byte: CRC-valid garbage, zlib bombs, huge declared lengths, truncations, lying
index stats, and events the writer must not record.
"""

from __future__ import annotations

import struct
import time
import tracemalloc
import zlib

import msgpack
import pytest

from kvscope.cli import main
from kvscope.protocol import SnapshotEvent, StepEvent, encode
from kvscope.traces import format as F
from kvscope.traces import writer as writer_mod
from kvscope.traces.info import trace_info
from kvscope.traces.reader import TraceReader
from kvscope.traces.writer import TraceWriter


def _sim_trace(path, *, chunk_steps: int = 8, n: int = 12, snapshot_every: int = 1000):
    """Record a short sim run (real scheduler, virtual clock): returns the events as written."""
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(backend="sim", model="llama-3.3-70b-fp8", max_num_seqs=4, seed=1),
                       snapshot_every=snapshot_every)
    writer = TraceWriter(path, engine.hello(), chunk_steps=chunk_steps, snapshot_provider=engine.snapshot,
                         background=False)
    engine.attach(writer)
    for i in range(n):
        engine.add_request([1 + (i * 7 + k) % 500 for k in range(20 + 5 * i)],
                           SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.close()
    writer.close()
    return writer


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / "good.kvtrace"
    _sim_trace(path)
    reader = TraceReader(path)
    assert reader.complete and not reader.warnings and len(reader.chunks) >= 3
    return path, path.read_bytes(), list(reader)


def _chunk_record(events: list[bytes], first: int, last: int, *, raw: bytes | None = None,
                  comp: bytes | None = None, raw_len: int | None = None, n: int | None = None) -> bytes:
    """A chunk with a valid CRC over whatever body it is given."""
    raw = b"".join(struct.pack("<I", len(e)) + e for e in events) if raw is None else raw
    body = zlib.compress(raw) if comp is None else comp
    meta = F.CHUNK_META.pack(first, last, len(events) if n is None else n, len(raw) if raw_len is None else raw_len)
    return F.RECORD.pack(F.CHUNK_TAG, len(meta) + len(body), zlib.crc32(body, zlib.crc32(meta))) + meta + body


def _insert_after_first_chunk(data: bytes, reader: TraceReader, record: bytes) -> tuple[bytes, int]:
    """The file with ``record`` in place of every chunk after the first (no index: it would not match)."""
    at = reader.chunks[1].offset
    return data[:at] + record, at


# ---- trace-info checks every chunk -----------------------------------------------------------


def test_bit_flip_mid_file_is_reported_with_its_offset(good, tmp_path):
    path, data, events = good
    reader = TraceReader(path)
    victim = reader.chunks[1]
    flipped = bytearray(data)
    flipped[victim.offset + F.RECORD.size + F.CHUNK_META.size + 3] ^= 0x40  # inside the compressed body
    bad = tmp_path / "flipped.kvtrace"
    bad.write_bytes(bytes(flipped))
    text = trace_info(bad)
    assert "warnings:   none" not in text
    assert f"corrupt chunk at byte {victim.offset} (checksum mismatch)" in text
    # --fast trusts the index: it says so, and reads no chunk
    fast = trace_info(bad, verify=False)
    assert "index trusted" in fast
    # replay gets every event before the damaged chunk, and nothing after it
    got = list(TraceReader(bad))
    before = sum(c.events for c in reader.chunks[:1])
    assert got == events[: 1 + before]


def test_crc_valid_garbage_chunk(good, tmp_path):
    path, data, events = good
    reader = TraceReader(path)
    record = _chunk_record([], 0, 0, raw=b"\x05\x00\x00\x00garbage", n=1)
    blob, at = _insert_after_first_chunk(data, reader, record)
    bad = tmp_path / "garbage.kvtrace"
    bad.write_bytes(blob)
    text = trace_info(bad)
    assert f"corrupt chunk at byte {at}" in text and "warnings:   none" not in text
    assert list(TraceReader(bad)) == events[: 1 + reader.chunks[0].events]


@pytest.mark.parametrize("declared", [F.MAX_CHUNK_RAW_BYTES, F.MAX_CHUNK_RAW_BYTES + 1, 2**32 - 1])
def test_zlib_bomb_fails_fast_and_small(good, tmp_path, declared):
    path, data, events = good
    reader = TraceReader(path)
    bomb = zlib.compress(bytes(F.MAX_CHUNK_RAW_BYTES), 9)  # 64 MiB of zeros in ~64 KiB
    snap = encode(events[1])
    record = _chunk_record([snap], events[1].step, events[1].step, comp=bomb, raw_len=declared, n=1)
    blob, at = _insert_after_first_chunk(data, reader, record)
    bad = tmp_path / "bomb.kvtrace"
    bad.write_bytes(blob)
    tracemalloc.start()
    t0 = time.perf_counter()
    text = trace_info(bad)
    elapsed = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert f"corrupt chunk at byte {at}" in text
    assert elapsed < 5.0
    assert peak < 8 << 20  # it never inflated the bomb


def test_huge_declared_lengths(good, tmp_path):
    path, data, events = good
    reader = TraceReader(path)
    snap = encode(events[1])
    cases = {
        "chunk length": F.RECORD.pack(F.CHUNK_TAG, 2**32 - 1, 0) + F.CHUNK_META.pack(0, 0, 1, 10),
        "event count": _chunk_record([snap], events[1].step, events[1].step, n=2**32 - 1),
        "event length": _chunk_record([], events[1].step, events[1].step,
                                      raw=struct.pack("<I", 2**32 - 1) + snap, n=1),
    }
    for name, record in cases.items():
        blob, at = _insert_after_first_chunk(data, reader, record)
        bad = tmp_path / f"{name.replace(' ', '-')}.kvtrace"
        bad.write_bytes(blob)
        text = trace_info(bad)
        assert f"byte {at}" in text and "warnings:   none" not in text, name
        assert list(TraceReader(bad)) == events[: 1 + reader.chunks[0].events], name
    # a header that claims a 4 GiB hello is one line, exit status 2, in the CLI
    hello_len_bomb = F.HEADER.pack(F.MAGIC, F.FORMAT_VERSION, 0, 2**32 - 1, 0)
    bad = tmp_path / "hello.kvtrace"
    bad.write_bytes(hello_len_bomb)
    assert main(["trace-info", str(bad)]) == 2


def test_truncated_trace_replays_up_to_the_cut(good, tmp_path):
    path, data, events = good
    reader = TraceReader(path)
    index_at = struct.unpack_from("<Q", data, len(data) - 8)[0]
    ends = [c.offset for c in reader.chunks[1:]] + [index_at]
    for cut in (ends[1] + 5, ends[1], len(data) - 3):
        bad = tmp_path / f"cut{cut}.kvtrace"
        bad.write_bytes(data[:cut])
        r = TraceReader(bad)
        whole = sum(c.events for c, end in zip(reader.chunks, ends) if end <= cut)  # chunks the cut spared
        assert list(r) == events[: 1 + whole]  # everything before the cut, nothing invented
        assert r.warnings and "good data ends at byte" in r.warnings[0]
        assert "warnings:   none" not in trace_info(bad)


def test_index_stats_are_checked(good, tmp_path):
    path, data, events = good
    reader = TraceReader(path)
    index_at = struct.unpack_from("<Q", data, len(data) - 8)[0]
    tag, length, _ = F.RECORD.unpack_from(data, index_at)
    index = msgpack.unpackb(data[index_at + F.RECORD.size: index_at + F.RECORD.size + length])
    index["stats"]["steps"] = -5
    forged = msgpack.packb(index, use_bin_type=True)
    blob = (data[:index_at] + F.RECORD.pack(F.INDEX_TAG, len(forged), zlib.crc32(forged)) + forged
            + F.FOOTER.pack(F.FOOTER_MAGIC, index_at))
    bad = tmp_path / "negative.kvtrace"
    bad.write_bytes(blob)
    true_steps = sum(1 for e in events if isinstance(e, StepEvent))
    for verify in (True, False):
        text = trace_info(bad, verify=verify)
        assert "index stats are wrong (steps -5)" in text
        assert f"steps:      {true_steps} " in text  # the counted value, never the forged one
    # consistent-looking but false stats: only the full check can tell
    index["stats"]["steps"] = true_steps + 1
    index["stats"]["events"] = sum(c.events for c in reader.chunks)
    forged = msgpack.packb(index, use_bin_type=True)
    blob = (data[:index_at] + F.RECORD.pack(F.INDEX_TAG, len(forged), zlib.crc32(forged)) + forged
            + F.FOOTER.pack(F.FOOTER_MAGIC, index_at))
    bad.write_bytes(blob)
    text = trace_info(bad)
    assert "index stats do not match the chunks (steps" in text and f"steps:      {true_steps} " in text


# ---- the writer never records what its reader refuses ------------------------------------------


def test_oversize_event_is_not_recorded_and_the_trace_stays_readable(tmp_path, monkeypatch, capsys):
    path = tmp_path / "oversize.kvtrace"
    sizes = []
    real_encode = writer_mod.encode

    def spy(ev):
        data = real_encode(ev)
        sizes.append((type(ev), len(data)))
        return data

    monkeypatch.setattr(writer_mod, "encode", spy)
    # The decode limit, as the writer sees it, below what a mid-run snapshot takes: those are refused.
    monkeypatch.setattr(writer_mod, "MAX_EVENT_BYTES", 500)
    w = _sim_trace(path, chunk_steps=4)
    assert w.lost > 0
    big = [n for t, n in sizes if t is SnapshotEvent and n > 500]
    assert big, "the run must have produced snapshots over the limit"
    assert "trace writer: not recording" in capsys.readouterr().err
    reader = TraceReader(path)
    events = list(reader)
    assert reader.complete and sum(c.events for c in reader.chunks) == len(events) - 1
    assert all(len(encode(e)) <= 500 for e in events[1:] if isinstance(e, SnapshotEvent))
    text = trace_info(path)
    assert f"could not record {w.lost} events" in text
    assert "warnings:   none" not in text


def test_a_chunk_over_the_raw_bound_is_split_at_its_snapshots(tmp_path, monkeypatch):
    path = tmp_path / "split.kvtrace"
    monkeypatch.setattr(F, "MAX_CHUNK_RAW_BYTES", 8192)
    w = _sim_trace(path, chunk_steps=10_000, snapshot_every=3)  # one logical chunk, a snapshot every 3 steps
    reader = TraceReader(path)
    assert reader.complete and not reader.warnings
    assert len(reader.chunks) > 1 and w.chunks_written == len(reader.chunks)
    with open(path, "rb") as f:
        for c in reader.chunks:
            f.seek(c.offset + F.RECORD.size)
            raw_len = F.CHUNK_META.unpack(f.read(F.CHUNK_META.size))[3]
            assert raw_len <= 8192
    assert w.lost == 0


# ---- sizes read from a trace are bounded before anything is built from them ------------------
def _crafted_trace(path, rewrite):
    """A real sim run whose events pass through ``rewrite(event) -> event or None`` on the way to the file."""
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(backend="sim", model="llama-3.3-70b-fp8", max_num_seqs=4, seed=1))
    writer = TraceWriter(path, engine.hello(), chunk_steps=8, snapshot_provider=engine.snapshot, background=False)

    class Rewriting:
        def publish(self, event):
            event = rewrite(event)
            if event is not None:
                writer.publish(event)

        def close(self):
            pass

    engine.attach(Rewriting())
    for i in range(24):
        engine.add_request([1 + (i * 7 + k) % 500 for k in range(20 + 5 * i)],
                           SamplingParams(max_tokens=6, ignore_eos=True), arrival=0.01 * i)
    while engine.has_unfinished():
        engine.step()
    engine.close()
    writer.close()


def _huge_prompt(ev):
    import msgspec

    if ev.type == "request" and ev.req == 3:
        return msgspec.structs.replace(ev, prompt_len=10**12, max_tokens=2**63 - 1)
    return ev


@pytest.mark.parametrize("argv", [["diagnose", "T"], ["diagnose", "T", "--json", "out.json"],
                                  ["export", "T", "--perfetto", "p.json", "--requests", "r.csv", "--steps", "s.csv"],
                                  ["trace-info", "T"]])
def test_a_request_of_a_trillion_tokens_builds_nothing_that_large(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _crafted_trace(tmp_path / "t.kvtrace", _huge_prompt)
    tracemalloc.start()
    try:
        code = main([a if a != "T" else "t.kvtrace" for a in argv])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "Traceback" not in out.err and peak < 200 << 20, peak


def test_calibrate_on_a_trace_without_requests_is_one_line(tmp_path, capsys):
    _crafted_trace(tmp_path / "t.kvtrace", lambda ev: None if ev.type == "request" else ev)
    assert main(["calibrate", str(tmp_path / "t.kvtrace")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no request events" in err[0], err


def test_calibrate_on_a_trace_of_a_trillion_token_request_is_bounded(tmp_path, capsys):
    _crafted_trace(tmp_path / "t.kvtrace", _huge_prompt)
    tracemalloc.start()
    try:
        code = main(["calibrate", str(tmp_path / "t.kvtrace")])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    err = capsys.readouterr().err
    assert "Traceback" not in err and peak < 200 << 20
    assert code == 0 or (code == 2 and len(err.strip().splitlines()) == 1), err


@pytest.mark.parametrize("change", [dict(priority=-2**63), dict(prompt_len=0), dict(arrival=1e308)],
                         ids=["priority-int64-min", "prompt_len-0", "arrival-1e308"])
def test_calibrate_when_the_sim_can_serve_none_of_the_requests_says_so(change, tmp_path, capsys):
    import msgspec

    _crafted_trace(tmp_path / "t.kvtrace",
                   lambda ev: msgspec.structs.replace(ev, **change) if ev.type == "request" else ev)
    assert main(["calibrate", str(tmp_path / "t.kvtrace")]) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    assert "the sim ran no step in the trace's span" in out.out


@pytest.mark.anyio
async def test_a_replay_draws_latencies_up_to_the_largest_float(tmp_path):
    """TTFT and ITL are any finite float in a trace: the histogram's axis must not reach 10 ** 309."""
    import msgspec

    from kvscope.tui.launch import make_replay_app

    def huge(ev):
        if ev.type != "step":
            return ev
        return msgspec.structs.replace(
            ev, first_tokens=[msgspec.structs.replace(f, ttft=1e308) for f in ev.first_tokens],
            itl=[msgspec.structs.replace(s, gap=1.7976931348623157e308) for s in ev.itl])

    _crafted_trace(tmp_path / "t.kvtrace", huge)
    app = make_replay_app(str(tmp_path / "t.kvtrace"), playing=False, auto_tick=False, index_in_background=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("shift+end")
        await pilot.pause()
        text = app.screen.query_one("#latency").render().plain
    assert "TTFT" in text and "ITL" in text and ">1e6h" in text


def _first_steps(n, **change):
    import msgspec

    seen = [0]

    def rewrite(ev):
        if ev.type == "step" and seen[0] < n:
            seen[0] += 1
            return msgspec.structs.replace(ev, **change)
        return ev
    return rewrite


@pytest.mark.parametrize("rewrite", [_first_steps(3, t=-1e308), _first_steps(3, t=1e307, dur=1e307),
                                     lambda ev: __import__("msgspec").structs.replace(ev, arrival=-1e308)
                                     if ev.type == "request" else ev],
                         ids=["step-t-1e308", "step-t-and-dur-1e307", "arrival-1e308"])
def test_report_leaves_out_times_no_axis_can_hold_with_a_notice(rewrite, tmp_path, capsys):
    _crafted_trace(tmp_path / "t.kvtrace", rewrite)
    assert main(["report", "--html", str(tmp_path / "r.html"), str(tmp_path / "t.kvtrace")]) == 0
    assert "Traceback" not in capsys.readouterr().err
    page = (tmp_path / "r.html").read_text()
    assert "left out of the plots" in page and "<svg" in page


def test_report_leaves_out_latencies_past_any_axis(tmp_path, capsys):
    import msgspec

    def huge(ev):
        if ev.type != "step":
            return ev
        return msgspec.structs.replace(ev, first_tokens=[msgspec.structs.replace(f, ttft=1e308)
                                                         for f in ev.first_tokens])

    _crafted_trace(tmp_path / "t.kvtrace", huge)
    assert main(["report", "--html", str(tmp_path / "r.html"), str(tmp_path / "t.kvtrace")]) == 0
    assert capsys.readouterr().err.count("error") == 0
    assert "left out of the plots" in (tmp_path / "r.html").read_text()


def test_calibrate_on_step_times_near_the_largest_float_is_one_line_and_no_warning(tmp_path, capsys):
    import warnings

    _crafted_trace(tmp_path / "t.kvtrace", _first_steps(3, t=1e308))
    with warnings.catch_warnings(record=True) as caught:  # a user sees a warning as lines on stderr
        warnings.simplefilter("always")
        code = main(["calibrate", str(tmp_path / "t.kvtrace")])
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]  # squaring 1e308 overflowed the fit
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert code == 0 or (code == 2 and len(err.strip().splitlines()) == 1), err
