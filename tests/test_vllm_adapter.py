"""Watching vLLM: its /metrics and KV-event wire formats, against a stand-in that speaks them exactly."""

from __future__ import annotations

import time

import httpx
import msgspec
import pytest

from kvscope.vllm.watch.cache import CacheView
from kvscope.vllm.watch.metrics import parse, quantile
from kvscope.vllm.watch.source import VllmSource
from kvscope.vllm.watch.wire import WireError, decode_batch
from tests.fakes.vllm import FakeKvPublisher, FakeMetricsServer
from tests._helpers import wait_for


def live_connected(pub, source, timeout: float = 30.0) -> None:
    """Wait until the SUB connection carries live batches (PUB drops what it sends to a joining
    subscriber): empty batches until one arrives live, a condition rather than a sleep."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = source.state.kv.received
        pub.publish([])
        if wait_for(lambda: source.state.kv.received > before, 0.5):
            return
    raise AssertionError("no live batch arrived")


@pytest.fixture
def metrics_server():
    server = FakeMetricsServer()
    yield server
    server.close()


# ---- metrics ----------------------------------------------------------------------------------
def test_metrics_view_shows_published_counts_rates_and_percentiles(metrics_server):
    m = metrics_server
    m.running.set(7)
    m.waiting.set(3)
    m.waiting_by_reason.labels("Qwen/Qwen3-0.6B", "0", "capacity").set(2)
    m.waiting_by_reason.labels("Qwen/Qwen3-0.6B", "0", "deferred").set(1)
    m.kv.set(0.42)
    source = VllmSource(m.url, interval=0.1)
    with httpx.Client() as client:
        source.scrape_once(client)
        for _ in range(100):
            m.ttft.observe(0.07)  # in the (0.06, 0.08] bucket
        m.itl.observe(0.02)
        m.generation.inc(500)
        m.prompt.inc(2000)
        m.preemptions.inc(4)
        m.queries.inc(1000)
        m.hits.inc(250)
        time.sleep(0.05)
        source.scrape_once(client)
    view = source.state.metrics
    assert view.last_error is None
    assert view.gauge("num_requests_running") == 7
    assert view.gauge("num_requests_waiting") == 3
    assert view.last.by_label["num_requests_waiting_by_reason"] == {"capacity": 2, "deferred": 1}
    assert view.gauge("kv_cache_usage_perc") == pytest.approx(0.42)
    span = view.scrapes[-1].t - view.scrapes[0].t
    assert view.rate("generation_tokens") == pytest.approx(500 / span)
    assert view.rate("num_preemptions") == pytest.approx(4 / span)
    assert view.hit_rate() == pytest.approx(0.25)
    p50, p90, p99 = view.percentiles("time_to_first_token_seconds")
    assert 0.06 <= p50 <= p99 <= 0.08  # interpolated inside the bucket that holds the rank


def test_histogram_quantile_matches_prometheus_interpolation():
    buckets = [(0.1, 10.0), (0.2, 30.0), (0.4, 40.0), (float("inf"), 40.0)]
    assert quantile(buckets, 0.5) == pytest.approx(0.1 + 0.1 * (20 - 10) / 20)
    assert quantile(buckets, 0.25) == pytest.approx(0.1 * 10 / 10 * 1.0)
    assert quantile([(1.0, 0.0), (float("inf"), 0.0)], 0.5) is None
    assert quantile([(1.0, 1.0), (float("inf"), 5.0)], 0.99) == 1.0  # rank in +Inf: the last finite bound


def test_bad_metric_text_is_one_error_and_the_view_keeps_going(metrics_server):
    source = VllmSource(metrics_server.url)
    with httpx.Client() as client:
        source.scrape_once(client)
        metrics_server.body_override = b"vllm:num_requests_running{engine=\"0\" 3\n\x00garbage {{{"
        source.scrape_once(client)
        assert source.state.metrics.errors == 1 and "\n" not in source.state.metrics.last_error
        metrics_server.body_override = None
        source.scrape_once(client)
    assert source.state.metrics.last_error is None and len(source.state.metrics.scrapes) == 2
    bad = VllmSource("http://127.0.0.1:9")  # nothing listens there
    with httpx.Client(timeout=1.0) as client:
        bad.scrape_once(client)
    assert bad.state.metrics.errors == 1


def test_parse_keeps_only_vllm_families_and_sums_engines():
    text = ('# TYPE vllm:num_requests_running gauge\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 2\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 5\n'
            '# TYPE other_metric gauge\nother_metric 9\n')
    s = parse(text, 0.0)
    assert s.gauges == {"num_requests_running": 7}


# ---- KV events: the wire --------------------------------------------------------------------
@pytest.mark.parametrize("legacy", [True, False])
def test_both_encodings_decode_to_the_same_events(legacy):
    pub = FakeKvPublisher(legacy=legacy)
    try:
        events = [pub.stored([1, 2, 3], None), pub.stored([b"\x01" * 32], 3, medium="CPU"), pub.removed([2]),
                  pub.cleared()]
        payload = msgspec.msgpack.encode(_batch(pub, events))
        batch = decode_batch(payload)
    finally:
        pub.close()
    kinds = [type(e).__name__ for e in batch.events]
    assert kinds == ["Stored", "Stored", "Removed", "Cleared"]
    assert batch.events[0].block_hashes == [1, 2, 3] and batch.events[0].num_tokens == 48
    assert batch.events[1].parent == 3 and batch.events[1].medium == "CPU"
    assert batch.dp_rank == 0


def _batch(pub, events):
    from tests.fakes.vllm import Batch, LegacyBatch

    return (LegacyBatch if pub.legacy else Batch)(1.0, events, 0)


def test_unknown_event_types_and_fields_are_skipped_not_fatal():
    payload = msgspec.msgpack.encode({"ts": 1.0, "events": [
        {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": None, "token_ids": [1] * 16,
         "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "a_future_field": [1, 2]},
        {"type": "SomethingNew", "x": 1}], "data_parallel_rank": 2, "also_new": True})
    batch = decode_batch(payload)
    assert len(batch.events) == 1 and batch.unknown == 1 and batch.dp_rank == 2


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"\x91" * 5000 + b"\x00", b"\xdd\xff\xff\xff\xff",
                                     msgspec.msgpack.encode("not a batch"), msgspec.msgpack.encode([1.0, 5]),
                                     b"\x92\xcb" + b"\x00" * 3])
def test_garbage_payloads_are_wire_errors(payload):
    with pytest.raises(WireError):
        decode_batch(payload)


# ---- KV events: the live view, gaps and replay -----------------------------------------------
@pytest.mark.parametrize("legacy,replay_topic", [(True, False), (False, False), (False, True)],
                         ids=["array", "map", "map-replay-topic"])
def test_view_recovers_batches_published_before_it_started_and_after_a_gap(legacy, replay_topic):
    """Replay answers are `b"" | seq | payload`, or (vLLM 0.32 on) `b"" | topic | seq | payload`."""
    pub = FakeKvPublisher(legacy=legacy, replay_topic=replay_topic)
    source = None
    try:
        # Before the view exists: a prefix 1 -> 2 -> 3, and two more continuations of 2.
        pub.publish([pub.stored([1, 2, 3], None)], ts=1.0)
        pub.publish([pub.stored([4], 2), pub.stored([8], 2)], ts=1.5)
        source = VllmSource(kv_events=pub.addr, kv_replay=pub.replay_addr).start()
        assert wait_for(lambda: source.state.kv.last_seq == 1), "replayed the batches it missed at start"
        assert source.state.cache.cached_blocks == 5 and source.state.kv.malformed == 0
        live_connected(pub, source)  # PUB drops messages to a joining subscriber: wait for live ones
        seq = pub.publish([pub.stored([5, 6], 4, medium="CPU")], ts=2.0)
        assert wait_for(lambda: source.state.kv.last_seq == seq)
        pub.publish([pub.removed([3])], ts=2.5, drop=True)  # lost on the PUB socket: only replay has it
        seq = pub.publish([pub.stored([7], 6)], ts=3.0)
        assert wait_for(lambda: source.state.kv.last_seq == seq)
        with source.lock:
            cache = source.state.cache
            kv = source.state.kv
            assert cache.cached_blocks == 7  # 1 2 4 8 5 6 7: 3 was removed by the batch only replay had
            assert kv.gaps >= 1 and kv.replayed >= 3 and kv.missed == 0
            assert cache.per_medium["GPU"] == 5 and cache.per_medium["CPU"] == 2
            assert cache.roots == 1 and cache.max_depth == 6
            assert cache.top_prefixes() == [(2, 2, 2)]  # block 2, depth 2, continued by 4 and 8
    finally:
        if source is not None:
            source.close()
        pub.close()


def test_view_survives_garbage_on_the_socket():
    pub = FakeKvPublisher(legacy=False)
    source = VllmSource(kv_events=pub.addr).start()
    try:
        live_connected(pub, source)
        n = pub.seq  # the next two seqs carry garbage payloads
        for frames in ([b"only one frame"], [b"", b"short", b"x"], [b"", n.to_bytes(8, "big"), b"\xc1"],
                       [b"", (n + 1).to_bytes(8, "big"), b"\x91" * 10_000]):
            pub.send_raw(frames)
        pub.seq = n + 2
        pub.publish([pub.stored([1], None)])
        assert wait_for(lambda: source.state.cache.cached_blocks == 1)
        assert source.state.kv.malformed == 4
        assert source.state.kv.last_error and "\n" not in source.state.kv.last_error
    finally:
        source.close()
        pub.close()


def test_one_oversized_kv_message_does_not_leave_the_view_deaf(monkeypatch):
    """zmq drops a publisher that sent a message over MAXMSGSIZE as a protocol error and never
    reconnects after one: every later batch was lost for good."""
    from kvscope.vllm.watch import source as vllm_source

    monkeypatch.setattr(vllm_source, "MAX_MESSAGE_BYTES", 4096)
    pub = FakeKvPublisher(legacy=False)
    source = VllmSource(kv_events=pub.addr).start()
    try:
        live_connected(pub, source)
        pub.send_raw([b"", pub.seq.to_bytes(8, "big"), b"x" * 8192])
        cached = source.state.cache.cached_blocks

        def one_more_arrives():
            pub.publish([pub.stored([1000 + pub.seq], None)])
            return source.state.cache.cached_blocks > cached

        assert wait_for(one_more_arrives, every=0.2)
        assert source.state.kv.reconnects >= 1
    finally:
        source.close()
        pub.close()


def test_cache_view_is_bounded(monkeypatch):
    from kvscope.vllm.watch import cache as vllm_cache
    from kvscope.vllm.watch.wire import Batch, Stored

    monkeypatch.setattr(vllm_cache, "MAX_BLOCKS", 100)
    view = CacheView()
    view.apply(Batch(0.0, [Stored(list(range(1000)), None, 16000, 16, "GPU")], 0))
    assert view.cached_blocks == 100 and view.forgotten == 900 and view.per_medium["GPU"] == 100


# ---- the screen -----------------------------------------------------------------------------
@pytest.mark.anyio
async def test_vllm_screen_shows_queues_kv_and_cached_blocks(metrics_server):
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.feeds import VllmFeed

    metrics_server.running.set(12)
    metrics_server.waiting.set(5)
    metrics_server.kv.set(0.5)
    pub = FakeKvPublisher(legacy=True)
    pub.publish([pub.stored([1, 2, 3, 4], None)], ts=1.0)
    source = VllmSource(metrics_server.url, pub.addr, pub.replay_addr, interval=0.1).start()
    try:
        assert wait_for(lambda: source.state.metrics.last is not None and source.state.cache.cached_blocks == 4)
        app = KvscopeApp([VllmFeed(source)], first="vllm", auto_tick=False)
        async with app.run_test(size=(100, 30)) as pilot:
            app.pump()
            await pilot.pause()
            queues = app.screen.query_one("#vllm-queues").render().plain
            cache = app.screen.query_one("#vllm-cache").render().plain
            latency = app.screen.query_one("#vllm-latency").render().plain
        assert "running 12" in queues and "waiting 5" in queues and "50%" in queues
        assert "cached blocks 4" in cache and "by hash" in cache
        assert "interpolated within buckets" in latency
    finally:
        source.close()
        pub.close()


# ---- kvscope speaks it too ------------------------------------------------------------------
def _free_addr() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_kvscope_publishes_vllm_events_that_the_adapter_counts_exactly(encoding):
    """At every checked step the adapter's cached-block count equals kvscope's registered prefix blocks."""
    import random

    from kvscope.vllm.publish import VllmKvPublisher
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(backend="sim", model="qwen3-0.6b", gpu="h200", prefix_caching=True,
                                    num_blocks=48, max_num_seqs=8, max_num_batched_tokens=128, seed=0))
    pub = VllmKvPublisher(_free_addr(), _free_addr(), block_size=engine.config.block_size, encoding=encoding)
    engine.kv_event_consumers.append(pub.consume)
    engine.attach(pub)
    rng = random.Random(3)
    prefixes = [[rng.randrange(10, 1000) for _ in range(64)] for _ in range(3)]
    for i in range(30):
        prompt = prefixes[i % 3] + [rng.randrange(10, 1000) for _ in range(rng.randrange(8, 60))]
        engine.add_request(prompt, SamplingParams(max_tokens=rng.randrange(4, 24), ignore_eos=True))
    # Half the run happens before the adapter starts: it must recover those batches by replay.
    for _ in range(25):
        engine.step()
    source = VllmSource(kv_events=pub.address, kv_replay=pub.replay_address).start()
    checked = 0
    try:
        assert wait_for(lambda: source.state.kv.last_seq == pub.last_seq)
        while engine.has_unfinished() and not wait_for(lambda: source.state.kv.received > 0, 0.2):
            engine.step()  # until the SUB connection carries live batches (PUB drops to a joiner)
        while engine.has_unfinished():
            engine.step()
            if engine.scheduler.step_count % 5 == 0:
                assert wait_for(lambda: source.state.kv.last_seq == pub.last_seq)
                with source.lock:
                    assert source.state.cache.cached_blocks == engine.block_manager.num_prefix_keys
                checked += 1
        assert engine.block_manager.evictions > 0, "the pool is small enough that the cache turns over"
        assert source.state.kv.malformed == 0 and source.state.kv.missed == 0
        assert checked >= 3
    finally:
        source.close()
        pub.close()
        engine.close()


def test_a_replay_longer_than_zmqs_send_queue_arrives_whole():
    """3,000 batches before the view starts: more than a ROUTER queues by default (1,000 messages).
    The publisher must not drop any of them, and the view ends with every block."""
    from kvscope.vllm.publish import VllmKvPublisher
    from kvscope.engine.kv.events import BlockStored

    pub = VllmKvPublisher(_free_addr(), _free_addr(), block_size=16)
    source = None
    key = lambda k: k.to_bytes(16, "big")  # noqa: E731 (a 16-byte key, as the engine's)
    try:
        for k in range(3000):
            pub.consume([BlockStored(key(k + 1), key(k) if k else None, tuple(range(16)), k)])
            pub.flush()
        source = VllmSource(kv_events=pub.address, kv_replay=pub.replay_address).start()
        assert wait_for(lambda: source.state.kv.last_seq == pub.last_seq)
        with source.lock:
            assert source.state.kv.replayed == 3000 and source.state.kv.missed == 0
            assert source.state.cache.cached_blocks == 3000 and source.state.cache.max_depth == 3000
    finally:
        if source is not None:
            source.close()
        pub.close()


def test_a_replay_of_many_batches_under_load_gives_the_buffer_whole_and_counts_the_rest():
    """25,000 batches before the view starts (two and a half replay buffers), a busy process beside the replay
    (a loaded machine): the last 10,000 (the replay buffer, as vLLM's) all arrive, and the 15,000 older ones are
    counted as missed, exactly."""
    import subprocess
    import sys

    from kvscope.vllm.publish import BUFFER_BATCHES, VllmKvPublisher
    from kvscope.engine.kv.events import BlockRemoved

    TOTAL = 25_000
    assert TOTAL > 2 * BUFFER_BATCHES
    pub = VllmKvPublisher(_free_addr(), _free_addr(), block_size=16)
    source = None
    hog = None
    try:
        for k in range(TOTAL):
            pub.consume([BlockRemoved(k.to_bytes(16, "big"), k)])
            pub.flush()
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # competes for the cores, ends below
        source = VllmSource(kv_events=pub.address, kv_replay=pub.replay_address).start()
        assert wait_for(lambda: source.state.kv.last_seq == pub.last_seq, 120)
        with source.lock:
            kv = source.state.kv
            assert kv.replayed == BUFFER_BATCHES and kv.missed == TOTAL - BUFFER_BATCHES
        assert pub.replays_cut == 0
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        if source is not None:
            source.close()
        pub.close()


def test_batches_a_replay_skips_are_counted_as_missed():
    """A replay answer with a hole in its seqs (a ROUTER that dropped frames): the view says so."""
    pub = FakeKvPublisher(legacy=False)
    source = None
    try:
        for k in range(6):
            pub.publish([pub.stored([k + 1], k or None)], ts=float(k))
        pub.replay_skips = {2, 3}
        source = VllmSource(kv_events=pub.addr, kv_replay=pub.replay_addr).start()
        assert wait_for(lambda: source.state.kv.last_seq == 5)
        with source.lock:
            assert source.state.kv.replayed == 4 and source.state.kv.missed == 2
    finally:
        if source is not None:
            source.close()
        pub.close()


# ---- an untrusted server: endless bodies, trickles, NaN and ±Inf ---------------------------------
class EndlessMetrics:
    """A /metrics that never ends: fast (an endless body) or one byte at a time (a trickle)."""

    def __init__(self, trickle: bool = False, body: bytes | None = None) -> None:
        import http.server
        import threading

        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the stdlib's name
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                try:
                    if fake.body is not None:
                        self.wfile.write(fake.body)
                        return
                    line = b"vllm:num_requests_running 1\n" * (1 if trickle else 4096)
                    while not fake.closed:
                        self.wfile.write(line[:1] if trickle else line)
                        self.wfile.flush()
                        if trickle:
                            time.sleep(0.05)
                except OSError:
                    pass  # the client hung up, as it should

            def log_message(self, *args):
                pass

        self.body = body
        self.closed = False
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.closed = True
        self.server.shutdown()
        self.server.server_close()


def test_an_endless_metrics_body_is_cut_at_the_byte_limit_while_streaming():
    import tracemalloc

    from kvscope.vllm.watch.metrics import MAX_TEXT_BYTES

    server = EndlessMetrics()
    source = VllmSource(server.url)
    try:
        tracemalloc.start()
        with httpx.Client(timeout=10) as client:
            source.scrape_once(client, budget_s=60)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        server.close()
    assert source.state.metrics.errors == 1 and "byte limit" in source.state.metrics.last_error
    assert peak < 3 * MAX_TEXT_BYTES  # the limit plus a chunk, never the whole stream


def test_a_trickling_metrics_body_is_cut_at_the_scrape_budget():
    server = EndlessMetrics(trickle=True)
    source = VllmSource(server.url)
    try:
        with httpx.Client(timeout=10) as client:
            source.scrape_once(client, budget_s=0.5)
    finally:
        server.close()
    assert source.state.metrics.errors == 1 and "not complete within 0.5 s" in source.state.metrics.last_error


def test_record_of_an_endless_server_stops_at_its_duration(tmp_path):
    """`record --duration 1` of a server whose /metrics never ends: it returns, with a readable trace."""
    from kvscope.vllm.watch.record import record_vllm
    from kvscope.traces.info import trace_info

    server = EndlessMetrics(trickle=True)
    t0 = time.monotonic()
    try:
        rec = record_vllm(tmp_path / "v.kvtrace", server.url, None, None, interval=0.2, duration=1.0,
                          progress=False)
    finally:
        server.close()
    assert time.monotonic() - t0 < 30  # a hang check with room for a loaded machine, not a speed test
    assert rec.failed >= 1
    if rec.writer is not None:
        assert "trace:" in trace_info(tmp_path / "v.kvtrace")


NON_FINITE = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running +Inf\n'
              '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc NaN\n'
              '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting -Inf\n'
              '# TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total +Inf\n'
              '# TYPE vllm:time_to_first_token_seconds histogram\n'
              'vllm:time_to_first_token_seconds_bucket{le="0.1"} +Inf\n'
              'vllm:time_to_first_token_seconds_bucket{le="0.2"} NaN\n'
              'vllm:time_to_first_token_seconds_bucket{le="NaN"} 3\n'
              'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 4\n'
              'vllm:time_to_first_token_seconds_count 4\nvllm:time_to_first_token_seconds_sum 1\n')


def test_nan_and_inf_samples_are_counted_and_skipped():
    s = parse(NON_FINITE, 0.0)
    assert s.gauges == {} and "generation_tokens" not in s.counters
    assert s.buckets["time_to_first_token_seconds"] == [(float("inf"), 4.0)]
    assert s.skipped == 7


@pytest.mark.anyio
async def test_the_vllm_panels_draw_inf_and_nan_values_from_anywhere():
    """Values that reach a panel another way (an older recording, a crafted trace) never crash it."""
    from kvscope.vllm.watch.metrics import Scrape
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.feeds import VllmFeed

    inf, nan = float("inf"), float("nan")
    source = VllmSource("http://127.0.0.1:9")
    for t in (0.0, 1.0):
        source.state.metrics.add(Scrape(
            t, gauges={"num_requests_running": inf, "num_requests_waiting": nan, "kv_cache_usage_perc": inf},
            by_label={"num_requests_waiting_by_reason": {"capacity": nan}},
            counters={"generation_tokens": inf * t if t else 0.0, "prefix_cache_queries": inf},
            buckets={"time_to_first_token_seconds": [(0.1, inf), (0.2, nan), (inf, inf * t or 1.0)],
                     "inter_token_latency_seconds": [(inf, 5.0 + t)]}))
    app = KvscopeApp([VllmFeed(source)], first="vllm", auto_tick=False)
    async with app.run_test(size=(100, 30)) as pilot:
        app.pump()
        await pilot.pause()
        queues = app.screen.query_one("#vllm-queues").render().plain
        latency = app.screen.query_one("#vllm-latency").render().plain
    assert "running -" in queues and "KV cache -" in queues
    assert "TTFT" in latency and "+Inf" in latency



@pytest.mark.anyio
async def test_the_vllm_panels_draw_the_largest_finite_values():
    """Finite is not small: 1e308 passes every isfinite check, and 8 * 1e308 or 1e308 * 20 overflows."""
    from kvscope.vllm.watch.metrics import Scrape
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.feeds import VllmFeed

    big, top = 1e308, 1.7976931348623157e308
    source = VllmSource("http://127.0.0.1:9")
    for t in (0.0, 1.0):
        source.state.metrics.add(Scrape(
            t, gauges={"num_requests_running": big, "num_requests_waiting": -big, "kv_cache_usage_perc": big * t},
            counters={"generation_tokens": top * t, "prefix_cache_queries": big * t, "prefix_cache_hits": top * t},
            buckets={"time_to_first_token_seconds": [(0.1, big * t), (1.0, top * t), (float("inf"), top * t)],
                     "inter_token_latency_seconds": [(big, big * t), (float("inf"), top * t)]}))
    app = KvscopeApp([VllmFeed(source)], first="vllm", auto_tick=False)
    async with app.run_test(size=(100, 30)) as pilot:
        app.pump()
        await pilot.pause()
        queues = app.screen.query_one("#vllm-queues").render().plain
        latency = app.screen.query_one("#vllm-latency").render().plain
    assert "KV cache " + "█" * 20 in queues  # a usage past 1 fills the bar
    assert "TTFT" in latency and "ITL" in latency and ">1e6h" in latency

def test_a_seq_jump_to_near_2_63_is_a_visible_reset_and_the_view_follows():
    pub = FakeKvPublisher(legacy=False)
    source = VllmSource(kv_events=pub.addr, kv_replay=pub.replay_addr).start()
    try:
        pub.publish([pub.stored([1], None)])
        live_connected(pub, source)
        pub.seq = 2**63 - 20  # the publisher jumps; its replay buffer now answers nonsense too
        pub.buffer.append((2**63 - 1, pub.buffer[-1][1]))
        for k in range(5):
            pub.publish([pub.stored([10 + k], None)])
        assert wait_for(lambda: source.state.kv.last_seq == 2**63 - 16), source.state.kv
        with source.lock:
            kv = source.state.kv
            assert kv.resets == 1 and "jumped" in kv.last_error and "reset 1" in kv.last_error
            assert kv.missed == 0  # a jump no replay could fill is not 2^63 missed batches
            assert source.state.cache.cached_blocks == 6  # every batch after the jump applied
    finally:
        source.close()
        pub.close()


def test_a_replay_that_answers_2_63_minus_1_for_a_gap_is_ignored_with_a_notice():
    pub = FakeKvPublisher(legacy=False)
    source = VllmSource(kv_events=pub.addr, kv_replay=pub.replay_addr).start()
    try:
        pub.publish([pub.stored([1], None)])
        live_connected(pub, source)
        pub.buffer.append((2**63 - 1, pub.buffer[-1][1]))  # the replay will also answer this
        pub.publish([pub.stored([2], 1)], drop=True)  # a gap: only the replay has it
        pub.publish([pub.stored([3], 2)])
        last = pub.seq - 1
        assert wait_for(lambda: source.state.kv.last_seq == last), source.state.kv
        pub.publish([pub.stored([4], 3)])  # and later batches still arrive (no stall at 2^63-1)
        assert wait_for(lambda: source.state.kv.last_seq == last + 1), source.state.kv
        with source.lock:
            kv = source.state.kv
            assert kv.missed == 0 and kv.malformed >= 1 and source.state.cache.cached_blocks == 4
    finally:
        source.close()
        pub.close()


def test_a_restarted_publisher_far_below_the_last_seq_is_followed():
    pub = FakeKvPublisher(legacy=False)
    source = VllmSource(kv_events=pub.addr).start()
    try:
        pub.seq = 5 * 2**20
        pub.publish([pub.stored([1], None)])
        live_connected(pub, source)
        pub.seq = 0  # a new vLLM on the same address starts at 0
        pub.publish([pub.stored([2], None)])
        assert wait_for(lambda: source.state.kv.last_seq == 0), source.state.kv
        with source.lock:
            assert source.state.kv.resets == 1 and source.state.kv.missed == 0
            assert 2 in source.state.cache.blocks
    finally:
        source.close()
        pub.close()


def _kv_port() -> str:
    from tests._helpers import free_port

    return f"tcp://127.0.0.1:{free_port()}"


def test_a_vllm_that_connects_its_kv_events_is_bound_to_with_bind_addr():
    """vLLM connects its PUB when its endpoint names a host (tcp://127.0.0.1:5701): the view binds there."""
    addr = _kv_port()
    source = VllmSource(kv_events=f"bind:{addr}").start()
    pub = FakeKvPublisher(legacy=False, connect_to=addr)
    try:
        live_connected(pub, source)
        pub.publish([pub.stored([1, 2], None)])
        assert wait_for(lambda: source.state.cache.cached_blocks == 2)
        assert source.state.kv_bound and source.state.kv.last_error is None
    finally:
        source.close()
        pub.close()


@pytest.mark.parametrize("vllm_endpoint", ["same", "wildcard", "absent"])
def test_with_vllm_url_the_server_says_who_binds(vllm_endpoint):
    """--vllm URL --kv-events ADDR: vLLM's /kv_event_sources names the endpoint it was given; when that is
    ADDR and vLLM connects to it, the view binds ADDR; when vLLM binds (tcp://*:PORT) or does not say, the
    view connects, as always."""
    server = FakeMetricsServer()
    if vllm_endpoint == "same":
        addr = _kv_port()
        server.kv_event_sources = {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": addr}}
        pub = FakeKvPublisher(legacy=False, connect_to=addr)
    else:
        pub = FakeKvPublisher(legacy=False)
        addr = pub.addr
        if vllm_endpoint == "wildcard":
            port = addr.rsplit(":", 1)[1]
            server.kv_event_sources = {"0": {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}}
    source = VllmSource(server.url, kv_events=addr, interval=0.2).start()
    try:
        live_connected(pub, source)
        pub.publish([pub.stored([7], None)])
        assert wait_for(lambda: source.state.cache.cached_blocks == 1)
        assert source.state.kv_bound == (vllm_endpoint == "same")
    finally:
        source.close()
        pub.close()
        server.close()


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"0": {"endpoint": 5}}', b'{"0": "x"}', b"{" * 5000])
def test_a_kv_event_sources_answer_that_makes_no_sense_leaves_the_view_connecting(body):
    from kvscope.vllm.watch.endpoints import vllm_connects_to
    from kvscope.vllm.watch.source import scrape_client

    server = FakeMetricsServer()
    server.kv_event_sources = body
    try:
        with scrape_client(1.0) as client:
            assert vllm_connects_to(server.url, client, "tcp://127.0.0.1:5701") is False
    finally:
        server.close()


def test_binding_a_non_loopback_address_is_refused_in_one_line():
    source = VllmSource(kv_events="bind:tcp://10.1.2.3:5701").start()
    try:
        assert wait_for(lambda: source.state.kv.last_error is not None)
        assert source.state.kv.last_error.startswith("cannot bind bind:tcp://10.1.2.3:5701")
        assert "\n" not in source.state.kv.last_error
    finally:
        source.close()


def test_a_trickling_server_gets_a_bounded_time_to_say_its_version_and_kv_sources():
    """GET /version and /kv_event_sources of a server that trickles forever give up within their budget."""
    from kvscope.vllm.watch.endpoints import server_version, vllm_connects_to

    server = EndlessMetrics(trickle=True)
    try:
        with httpx.Client(timeout=10) as client:
            t0 = time.monotonic()
            assert server_version(server.url, client, budget_s=0.5) is None
            assert vllm_connects_to(server.url, client, "tcp://127.0.0.1:5557") is False
            took = time.monotonic() - t0
    finally:
        server.close()
    assert took < 20  # a hang check with room for a loaded machine (budgets 0.5 s + 3 s), not a speed test


@pytest.mark.parametrize("version", ["0.32.0", "x" * 65, "0.32\x1b[31m", 32, None])
def test_a_servers_version_is_taken_only_as_a_short_printable_string(version):
    """GET /version answers {"version": ...}: a long, non-printable or non-string value is not a version."""
    from tests.fakes.vllm import FakeMetricsServer

    from kvscope.vllm.watch.endpoints import server_version

    server = FakeMetricsServer()
    server.version = version  # None: the server has no /version (404)
    try:
        with httpx.Client(timeout=10) as client:
            got = server_version(server.url, client)
    finally:
        server.close()
    assert got == ("0.32.0" if version == "0.32.0" else None)
