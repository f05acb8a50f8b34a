"""`kvscope record --vllm`: a watched vLLM into a trace, and `kvscope replay` of it through the same view.

Against the stand-in vLLM (tests/fakes/vllm.py): what the recorder's live view held at
the end, the replay holds too: queue counts, KV use, latency buckets, cached blocks
(including the batches published before recording started, recovered by replay) and
the subscriber's tallies. Seeking rebuilds the view from the chunk's snapshot exactly.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from msgspec import UNSET

from kvscope.vllm.watch import record as vllm_record
from kvscope.vllm.watch.cache import CacheView
from kvscope.vllm.watch.metrics import MetricsView
from kvscope.vllm.watch.record import record_vllm
from kvscope.vllm.watch.replay import VllmTraceSource
from kvscope.vllm.watch.source import KvStats, VllmSource
from kvscope.vllm.watch.trace import cache_from, snapshot_event, wire_hash
from kvscope.vllm.watch.wire import Batch, Cleared, Removed, Stored
from kvscope.cli import main
from kvscope.protocol import encode
from kvscope.protocol.codec import ProtocolError, UnknownEventType, decode
from kvscope.protocol.events import INT64_MAX, VllmKvEvent, VllmMetricsEvent, VllmSnapshotEvent
from kvscope.traces.reader import TraceReader
from tests.fakes.vllm import MODEL, FakeKvPublisher, FakeMetricsServer
from tests._helpers import wait_for


def _cache_fields(c: CacheView) -> dict:
    return {
        "blocks": [(wire_hash(h), None if n.parent is None else wire_hash(n.parent), n.medium, n.depth, n.children)
                   for h, n in c.blocks.items()],
        "per_medium": {k: v for k, v in c.per_medium.items() if v},
        "roots": c.roots, "max_depth": c.max_depth, "stored": c.stored_total, "removed": c.removed_total,
        "cleared": c.cleared, "unknown_removed": c.unknown_removed, "batches": c.batches,
    }


def _kv_fields(kv: KvStats) -> tuple:
    return (kv.received, kv.replayed, kv.malformed, kv.gaps, kv.missed, kv.last_seq)


def _record_session(path, *, legacy: bool, ticks_per_chunk: int | None = None, monkeypatch=None):
    """Record the stand-in for a few seconds; returns (recorder, metrics server, publisher)."""
    if ticks_per_chunk is not None:
        monkeypatch.setattr(vllm_record, "CHUNK_TICKS", ticks_per_chunk)
    pub = FakeKvPublisher(legacy=legacy)
    m = FakeMetricsServer()
    m.version = None if legacy else "0.32.0"  # an older server has no GET /version
    m.running.set(3)
    m.waiting.set(5)
    m.kv.set(0.25)
    # Published before the recorder exists: only the replay buffer has these.
    pub.publish([pub.stored([1, 2, 3], None)], ts=1.0)
    pub.publish([pub.stored([4], 2), pub.stored([8], 2)], ts=1.5)
    stop = threading.Event()
    box: dict = {}
    sources: list[VllmSource] = []

    class Watched(VllmSource):  # the recorder's own source, so the test waits on what it has seen
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            sources.append(self)

    def watch():
        box["rec"] = record_vllm(path, m.url, pub.addr, pub.replay_addr, interval=0.05, stop=stop, progress=False)

    def until(cond, what: str) -> None:
        assert wait_for(lambda: sources and cond(sources[0].state)), f"timed out waiting for {what}"

    t = threading.Thread(target=watch)
    monkey = pytest.MonkeyPatch()
    monkey.setattr(vllm_record, "VllmSource", Watched)
    t.start()
    try:
        until(lambda st: st.kv.last_seq == 1, "the recorder to replay what it missed")
        while not wait_for(lambda: sources[0].state.kv.received > 0, 0.5):
            pub.publish([])  # its SUB socket is not carrying live batches yet (PUB drops to a joiner)
        pub.publish([pub.stored([5, 6], 4, medium="CPU")], ts=2.0)
        pub.publish([pub.removed([3])], ts=2.5, drop=True)  # lost on the PUB socket: a gap, recovered by replay
        pub.publish([pub.stored([b"\x07" * 32, (1 << 64) - 1], 6)], ts=3.0)  # a bytes hash, an int past int64
        for i in range(40):
            m.ttft.observe(0.05 + 0.01 * (i % 5))
            m.itl.observe(0.02)
            m.generation.inc(10)
            m.running.set(3 + i % 4)
            if i % 8 == 0:
                pub.publish([pub.stored([100 + i], 1)], ts=3.0 + i * 0.1)
            time.sleep(0.02)  # pacing, so scrapes fall between the changes (nothing waits on it)
        m.running.set(9)
        m.waiting.set(2)
        m.kv.set(0.75)
        last = pub.seq - 1
        until(lambda st: st.kv.last_seq == last and st.metrics.gauge("num_requests_running") == 9
              and st.metrics.gauge("num_requests_waiting") == 2 and st.metrics.gauge("kv_cache_usage_perc") == 0.75
              and sources[0].listener.step >= 48,  # ticks enough for several chunks of 8
              "the last batch, the last gauges and 48 ticks to be recorded")
    finally:
        stop.set()
        t.join(timeout=30)
        monkey.undo()
    return box["rec"], m, pub


@pytest.fixture(scope="module", params=[False, True], ids=["map", "array"])
def recorded(request, tmp_path_factory):
    """One recording per wire encoding, shared by the tests that read it (none writes to it)."""
    path = tmp_path_factory.mktemp("recorded") / "vllm.kvtrace"
    rec, m, pub = _record_session(path, legacy=request.param)
    yield path, rec
    m.close()
    pub.close()


def test_replay_ends_where_the_live_view_ended(recorded):
    path, rec = recorded
    live = rec.source.state
    assert live.kv.replayed >= 3 and live.kv.gaps >= 1, "the recorder recovered the early batches and the gap"
    # 1 2 3 4 8 (before), 5 6, 3 removed, the two odd hashes, then 100 108 116 124 132
    assert live.cache.cached_blocks == 13
    src = VllmTraceSource(path)
    src.play_to_end()
    st = src.state
    assert _cache_fields(st.cache) == _cache_fields(live.cache)
    assert _kv_fields(st.kv) == _kv_fields(live.kv)
    assert st.metrics.gauge("num_requests_running") == live.metrics.gauge("num_requests_running") == 9
    assert st.metrics.gauge("num_requests_waiting") == 2
    assert st.metrics.gauge("kv_cache_usage_perc") == pytest.approx(0.75)
    assert st.metrics.last.buckets == live.metrics.last.buckets
    assert st.metrics.percentiles("time_to_first_token_seconds") == pytest.approx(
        live.metrics.percentiles("time_to_first_token_seconds"))
    assert src.reader.hello.config.model == MODEL
    assert src.reader.hello.config.backend == "vllm"


def test_trace_info_names_what_was_watched(recorded, capsys):
    path, rec = recorded
    assert main(["trace-info", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"model={MODEL}" in out and "url=http://127.0.0.1:" in out
    assert f"{rec.scrapes} scrapes" in out and f"{rec.batches} KV batches ({rec.replayed} replayed)" in out
    assert "warnings:   none" in out


def test_trace_info_names_the_vllm_it_recorded(recorded):
    """The hello says the engine was a vLLM, and its version where the server tells it (GET /version)."""
    from kvscope.traces.info import trace_info

    path, rec = recorded
    cfg = TraceReader(path).hello.config
    version = rec.vllm_version
    assert cfg.engine == "vllm" and cfg.vllm_version == (version if version else UNSET)
    first = "engine:     vLLM 0.32.0 (watched from outside)" if version else "engine:     vLLM (watched from outside)"
    assert first in trace_info(path)


def test_diagnose_reads_a_vllm_recording(recorded, capsys):
    path, rec = recorded
    assert main(["diagnose", str(path), "--no-what-if"]) == 0
    out = capsys.readouterr().out
    assert f"{rec.scrapes} scrapes" in out and "bottleneck: " in out and "[vllm:" in out


def test_engine_commands_refuse_a_vllm_recording_in_one_line(recorded, capsys, tmp_path):
    path, _ = recorded
    for argv in (["calibrate", str(path)],
                 ["export", str(path), "--steps", str(tmp_path / "s.csv")]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "recorded vLLM" in err and "kvscope replay" in err


def test_seek_rebuilds_the_view_from_the_chunk_snapshot(tmp_path, monkeypatch):
    path = tmp_path / "chunks.kvtrace"
    rec, m, pub = _record_session(path, legacy=False, ticks_per_chunk=8, monkeypatch=monkeypatch)
    m.close()
    pub.close()
    reader = TraceReader(path)
    assert len(reader.chunks) >= 4, "small chunks, each opened by a vllm_snapshot"
    events = list(reader)[1:]
    assert type(events[0]) is VllmSnapshotEvent
    ticks = [e.step for e in events if type(e) in (VllmKvEvent, VllmMetricsEvent)]
    assert ticks == list(range(1, len(ticks) + 1))
    # Linear play to tick k vs. seeking to k from another position: the same view.
    for k in (ticks[len(ticks) // 3], ticks[len(ticks) // 2] + 1, ticks[-1]):
        linear = VllmTraceSource(path)
        with linear.lock:
            while linear.step < k:
                linear.apply(linear.clock.step(time.monotonic()))
        jumped = VllmTraceSource(path)
        jumped.seek(ticks[-1])
        jumped.seek(k)
        assert jumped.step == k
        assert _cache_fields(jumped.state.cache) == _cache_fields(linear.state.cache)
        assert _kv_fields(jumped.state.kv) == _kv_fields(linear.state.kv)
        assert jumped.state.metrics.last.gauges == linear.state.metrics.last.gauges
        assert jumped.state.metrics.rate("generation_tokens") is not None


def test_a_truncated_recording_replays_up_to_the_cut(recorded, tmp_path):
    path, _ = recorded
    data = path.read_bytes()
    cut = tmp_path / "cut.kvtrace"
    cut.write_bytes(data[: len(data) - 40])  # the footer and part of the index are gone
    src = VllmTraceSource(cut)
    src.play_to_end()
    assert src.state.cache.cached_blocks > 0 and src.state.metrics.last is not None


@pytest.mark.anyio
async def test_replay_app_shows_the_recorded_counts(recorded):
    from kvscope.tui.feeds import VllmFeed
    from kvscope.tui.launch import make_replay_app
    from kvscope.tui.screens.vllm import VllmReplayScreen

    path, rec = recorded
    app = make_replay_app(str(path), auto_tick=False, playing=False)
    assert isinstance(app.feeds[0], VllmFeed) and app.player is not None
    async with app.run_test(size=(100, 30)) as pilot:
        assert isinstance(app.screen, VllmReplayScreen)
        await pilot.press("end")
        await pilot.pause()
        header = app.screen.query_one("#vllm-header").render().plain
        queues = app.screen.query_one("#vllm-queues").render().plain
        cache = app.screen.query_one("#vllm-cache").render().plain
        assert "replay vllm.kvtrace" in header
        assert "running 9" in queues and "waiting 2" in queues and "75%" in queues
        assert f"cached blocks {rec.source.state.cache.cached_blocks}" in cache
        await pilot.press("home")
        await pilot.pause()
        cache = app.screen.query_one("#vllm-cache").render().plain
        assert "cached blocks 0" in cache
        await pilot.press("space")
        assert app.player.playing


# ---- the pieces ----------------------------------------------------------------------------
def test_wire_hash_keeps_every_hash_distinct_and_inside_the_protocol():
    assert wire_hash(12345) == 12345 and wire_hash(-5) == -5
    assert wire_hash(INT64_MAX + 1) == hex(INT64_MAX + 1)
    assert wire_hash(b"\x00\xff") == "00ff"
    long = wire_hash(b"\x01" * 4096)
    assert long.startswith("b2:") and len(long) < 100 and long != wire_hash(b"\x01" * 4095)


def test_a_cache_snapshot_restores_the_view_exactly():
    rng = random.Random(7)
    view = CacheView()
    live: list = []
    for i in range(400):
        r = rng.random()
        if r < 0.6 or not live:
            parent = rng.choice(live) if live and rng.random() < 0.7 else None
            hashes = [rng.getrandbits(70) if rng.random() < 0.2 else rng.getrandbits(40) for _ in range(rng.randint(1, 3))]
            if rng.random() < 0.1:
                hashes = [bytes(rng.getrandbits(8) for _ in range(32))]
            view.apply(Batch(float(i), [Stored(hashes, parent, 16 * len(hashes), 16, rng.choice(["GPU", "CPU"]))], 0))
            live.extend(hashes)
        elif r < 0.97:
            gone = rng.sample(live, min(len(live), rng.randint(1, 3)))
            view.apply(Batch(float(i), [Removed(gone, "GPU")], 0))
            live = [h for h in live if h not in gone]
        else:
            view.apply(Batch(float(i), [Cleared()], 0))
            live = []
    snap = snapshot_event(9, 1.0, view, KvStats(received=5, last_seq=4), MetricsView(), 0.0)
    back = cache_from(decode(encode(snap)))
    assert _cache_fields(back) == _cache_fields(view)
    assert back.top_prefixes() == [(wire_hash(h), d, c) for h, d, c in view.top_prefixes()]


def test_unknown_event_types_are_their_own_error_and_subscribers_skip_them():
    import msgpack

    data = msgpack.packb({"type": "from_the_future", "step": 1})
    with pytest.raises(UnknownEventType):
        decode(data)
    assert issubclass(UnknownEventType, ProtocolError)
    with pytest.raises(ProtocolError) as e:  # a missing or non-string type is damage, not the future
        decode(msgpack.packb({"step": 1}))
    assert not isinstance(e.value, UnknownEventType)


def test_trace_reader_skips_events_of_unknown_type(tmp_path):
    import msgpack

    from tests.test_hostile_traces import _chunk_record, _sim_trace

    path = tmp_path / "t.kvtrace"
    _sim_trace(path)
    reader = TraceReader(path)
    events = list(reader)[1:]
    first = reader.chunks[0]
    chunk_events = [e for e in events if first.first_step <= getattr(e, "step", -1) <= first.last_step][:3]
    wire = [encode(e) for e in chunk_events]
    future = msgpack.packb({"type": "from_the_future", "step": chunk_events[0].step})
    record = _chunk_record([wire[0], future, *wire[1:]], first.first_step, chunk_events[-1].step)
    data = path.read_bytes()
    crafted = tmp_path / "future.kvtrace"
    crafted.write_bytes(data[: first.offset] + record)
    got = list(TraceReader(crafted))[1:]
    assert [type(e) for e in got] == [type(e) for e in chunk_events]
    r = TraceReader(crafted)
    r.verify()
    assert any("does not know" in w for w in r.warnings)
    assert r.summary().events == len(chunk_events) + 1  # the skipped event is counted as written


def test_record_cli_mistakes_are_one_line(capsys, tmp_path):
    out = str(tmp_path / "x.kvtrace")
    for argv in (["record", out, "--vllm", "ftp://host"],
                 ["record", out, "--kv-replay", "tcp://127.0.0.1:1"],
                 ["record", out, "--vllm", "http://127.0.0.1:1", "--connect", "tcp://127.0.0.1:5557"],
                 ["record", out, "--kv-events", "localhost:5557"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("kvscope: error:") and "\n" not in err


def test_a_server_that_does_not_answer_is_recorded_as_failed_scrapes(tmp_path):
    out = tmp_path / "none.kvtrace"
    assert main(["record", str(out), "--vllm", "http://127.0.0.1:9", "--duration", "0.3"]) == 0
    assert out.exists()  # a failed scrape is itself recorded: the trace says the server did not answer
    src = VllmTraceSource(out)
    src.play_to_end()
    assert src.state.metrics.errors >= 1 and "127.0.0.1:9" in (src.state.metrics.last_error or "")


def test_hostile_values_never_make_an_unreadable_trace(tmp_path):
    """Prometheus text may carry +Inf gauges and a KV publisher any float or int: the trace stays readable."""
    from kvscope.vllm.watch.metrics import parse
    from kvscope.vllm.watch.record import VllmRecorder
    from kvscope.vllm.watch.source import apply_batch

    path = tmp_path / "hostile.kvtrace"
    source = VllmSource("http://127.0.0.1:9", "tcp://127.0.0.1:9")  # never started: the test feeds it
    rec = VllmRecorder(path, source)
    source.listener = rec
    text = ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running +Inf\n"
            "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 4\n"
            "# TYPE vllm:x histogram\nvllm:x_bucket{le=\"0.1\"} 1\nvllm:x_bucket{le=\"+Inf\"} +Inf\n"
            "vllm:x_count 1\nvllm:x_sum 0.1\n")
    scrape = parse(text, time.time())
    with source.lock:
        rec.scraped(scrape)
        source.state.metrics.add(scrape)
        batch = Batch(float("inf"), [Stored([1, b"x" * 5000], None, 16, -5, "G" * 5000)], 1 << 63)
        rec.applied(0, batch, False)
        apply_batch(source.state, 0, batch, False)
        rec.close()
    reader = TraceReader(path)
    reader.verify()
    assert reader.warnings == [] and reader.summary().steps == 2
    src = VllmTraceSource(path)
    src.play_to_end()
    st = src.state
    assert st.metrics.gauge("num_requests_waiting") == 4 and st.metrics.gauge("num_requests_running") is None
    assert st.metrics.last.skipped >= 2 and st.cache.cached_blocks == 2


def test_the_shipped_recording_replays_whole_and_consistent():
    """traces/vllm/kvscope-as-vllm.kvtrace: `kvscope serve --kv-events-vllm --http` (tiny, demo workload,
    --num-blocks 384) recorded through its vLLM-named /metrics and vLLM-format KV events."""
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "traces", "vllm", "kvscope-as-vllm.kvtrace")
    reader = TraceReader(path)
    reader.verify()
    assert reader.warnings == [] and reader.vllm_recording
    src = VllmTraceSource(path, playing=False)
    most = 0
    with src.lock:
        while not src.clock.done:
            src.apply(src.clock.step(time.monotonic()))
            most = max(most, src.state.cache.cached_blocks)
    st = src.state
    assert 0 < most <= 384, "never more cached blocks than the engine's pool"
    assert st.cache.unknown_removed == 0 and st.kv.missed == 0 and st.kv.replayed > 0
    assert st.metrics.gauge("num_requests_running") is not None
