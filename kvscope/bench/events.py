"""What watching costs: engine throughput with events and recording on against off, and event sizes."""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time

from kvscope.bench.harness import run_config
from kvscope.engine.config import EngineConfig
from kvscope.protocol.codec import encode
from kvscope.protocol.events import (
    DECODE,
    Admission,
    BatchEntry,
    BlockAlloc,
    ItlSample,
    KvCounters,
    StepEvent,
)


def _free_tcp_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _tok_per_s(config: EngineConfig, items, watched: bool, trace_path: str) -> tuple[float, int]:
    sinks: list = []

    def watch(engine):
        """What `kvscope serve --events ... --record ...` attaches: a publisher and a trace writer."""
        from kvscope.protocol.sinks import FanOut
        from kvscope.protocol.transport import ZmqPublisher
        from kvscope.traces.writer import TraceWriter

        sinks.append(FanOut([ZmqPublisher(_free_tcp_addr()),
                             TraceWriter(trace_path, engine.hello(), snapshot_provider=engine.snapshot)]))
        return sinks[0]

    engine, server = run_config(config, items, make_sink=watch if watched else None)
    for sink in sinks:
        sink.close()
    return server.summary().output_tok_per_s, engine.scheduler.step_count


def synthetic_step(num_running: int) -> StepEvent:
    """A decode step of num_running requests, shaped like the engine's own."""
    ids = list(range(num_running))
    return StepEvent(
        step=12345, t=812.25, dur=0.0123, budget=512,
        batch=[BatchEntry(i, DECODE, 1, 300 + i) for i in ids],
        running=ids, waiting=list(range(num_running, num_running + 32)),
        admission=Admission("blocked", "kv_blocks", num_running),
        alloc=[BlockAlloc(1000 + i, i) for i in range(num_running // 16)],
        sampled=ids, itl=[ItlSample(i, 0.0123) for i in ids],
        kv=KvCounters(4096, 3000, 1096, 0, 0, 40000, 700, 0),
    )


def encode_us(event, repeats: int = 300) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        encode(event)
    return (time.perf_counter() - start) / repeats * 1e6


def measure_event_overhead(config: EngineConfig, items, rounds: int = 2) -> dict:
    """Interleaved off/on runs of the same workload; the ratio of medians is the figure."""
    off: list[float] = []
    on: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.kvtrace")
        steps = 0
        for _ in range(rounds):
            off.append(_tok_per_s(config, items, False, path)[0])
            rate, steps = _tok_per_s(config, items, True, path)
            on.append(rate)
        trace_bytes = os.path.getsize(path)
        from kvscope.traces.reader import TraceReader

        step_sizes = [len(encode(e)) for e in TraceReader(path) if getattr(e, "type", "") == "step"]
    big = synthetic_step(256)
    return {
        "tok_per_s_off": statistics.median(off),
        "tok_per_s_on": statistics.median(on),
        "kept_fraction": statistics.median(on) / statistics.median(off),
        "runs_off": off,
        "runs_on": on,
        "bytes_per_step": statistics.mean(step_sizes) if step_sizes else 0.0,
        "encode_us_per_step_256": encode_us(big),
        "bytes_per_step_256": len(encode(big)),
        "trace_bytes_per_1000_steps": trace_bytes / max(steps, 1) * 1000,
    }


def summary_line(e: dict) -> str:
    return (f"events: kept {e['kept_fraction'] * 100:.1f}% of tok/s with events+recording on; "
            f"{e['bytes_per_step']:.0f} B/step; encode {e['encode_us_per_step_256']:.0f} us/step at 256 running; "
            f"{e['trace_bytes_per_1000_steps'] / 1024:.1f} KiB trace per 1000 steps")
