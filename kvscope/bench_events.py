"""What watching costs: engine throughput with events and recording on against off, and event sizes."""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time

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
    from kvscope.bench import run_mode

    sink = None
    if watched:
        from kvscope.engine.llm_engine import LLMEngine  # noqa: F401  (engine import cost stays outside the timing)
        from kvscope.protocol.sinks import FanOut
        from kvscope.protocol.transport import ZmqPublisher
        from kvscope.traces.writer import TraceWriter

        sink = _LateWriter(FanOut([ZmqPublisher(_free_tcp_addr())]), trace_path)
    engine, server = run_mode(config, items, sink=sink)
    if sink is not None:
        sink.close()
    return server.summary().output_tok_per_s, engine.scheduler.step_count


class _LateWriter:
    """Adds the trace writer once the engine's hello goes by (the writer wants hello up front)."""

    def __init__(self, fanout, path: str) -> None:
        self.fanout = fanout
        self.path = path
        self.writer = None

    def publish(self, event) -> None:
        if self.writer is None and getattr(event, "type", None) == "hello":
            from kvscope.traces.writer import TraceWriter

            self.writer = TraceWriter(self.path, event)
            self.fanout.add(self.writer)
            return
        self.fanout.publish(event)

    def take_dropped(self) -> int:
        return sum(getattr(s, "take_dropped", lambda: 0)() for s in self.fanout.sinks)

    def close(self) -> None:
        self.fanout.close()


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
