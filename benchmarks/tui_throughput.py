"""How fast the TUI folds events into its state, and whether its memory stays flat.

    python benchmarks/tui_throughput.py [--steps 20000] [--blocks 2048] [--seqs 64] [--app 5] [--trace FILE]

1. Reducer: feeds N step events (plus their request/snapshot events)
   through ``kvscope.tui.model.state.reduce`` and prints steps/s; then, in a second pass
   under tracemalloc, the peak memory after N/4 and after N steps (flat = bounded).
2. With ``--app S``: runs the Textual app headless for S seconds while a thread
   feeds it events at ``--rate`` steps/s, and prints the steps applied per second,
   repaints per second (must stay <= 30) and the backlog left at the end.

The events come from the real scheduler on the sim backend (virtual clock, Llama 3.1
8B on an H100, random arrivals at 0.5 requests per step, a burst every 500 steps), or
from a recorded trace with ``--trace`` (its events, repeated up to ``--steps`` steps).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
import tracemalloc

from kvscope.tui.model.state import new_state, reduce


def make_events(steps: int, blocks: int, seqs: int, budget: int, seed: int = 0) -> list:
    """A sim-backend run: hello, snapshot, ``steps`` iterations (every event as a subscriber decodes it)."""
    import random

    from kvscope.engine.config import EngineConfig
    from kvscope.errors import KvscopeError
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.sampling_params import SamplingParams
    from kvscope.protocol import decode, encode

    events: list = []

    class Sink:
        def publish(self, ev) -> None:
            events.append(decode(encode(ev)))

        def close(self) -> None:
            pass

    cfg = EngineConfig(backend="sim", model="llama-3.1-8b", gpu="h100-sxm5", num_blocks=blocks, max_num_seqs=seqs,
                       max_num_batched_tokens=budget, max_model_len=4096, seed=seed)
    engine = LLMEngine(cfg, sink=Sink(), snapshot_every=256, snapshot_interval_s=1e12)
    rng = random.Random(seed)

    def add(n: int) -> None:
        for _ in range(n):
            prompt = [rng.randrange(3, 30000) for _ in range(rng.randint(20, 600))]
            try:
                engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(8, 200), ignore_eos=True))
            except KvscopeError:
                pass

    for i in range(steps):
        if rng.random() < 0.5:  # a little under what 64 sequences serve: queues stay short
            add(1)
        if i % 500 == 100:
            add(seqs // 2)
        engine.step()
    return events


def trace_events(path: str, steps: int) -> list:
    """A recorded trace's events, played again (steps renumbered) until ``steps`` steps."""
    import msgspec

    from kvscope.traces.reader import TraceReader

    reader = TraceReader(path)
    body = list(reader)[1:]
    events: list = [reader.hello]
    n = 0
    offset = 0
    while n < steps:
        last = offset
        for ev in body:
            if ev.type in ("step", "snapshot", "bye"):
                ev = msgspec.structs.replace(ev, step=ev.step + offset)
                last = ev.step
            if ev.type == "bye":
                continue
            events.append(ev)
            if ev.type == "step":
                n += 1
                if n >= steps:
                    break
        offset = last
    return events


def bench_reducer(events: list) -> dict:
    """Speed without tracing, then memory with tracemalloc in a second pass."""
    n_steps = sum(1 for e in events if e.type == "step")
    state = new_state()
    t0 = time.perf_counter()
    for e in events:
        state = reduce(state, e)
    dt = time.perf_counter() - t0
    quarter = len(events) // 4
    tracemalloc.start()
    traced = new_state()
    for e in events[:quarter]:
        traced = reduce(traced, e)
    cur_quarter, peak_quarter = tracemalloc.get_traced_memory()
    for e in events[quarter:]:
        traced = reduce(traced, e)
    cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "steps": n_steps,
        "events": len(events),
        "seconds": round(dt, 3),
        "steps_per_s": round(n_steps / dt),
        "events_per_s": round(len(events) / dt),
        "state_mib_after_quarter": round(cur_quarter / 2**20, 2),
        "state_mib_at_end": round(cur / 2**20, 2),
        "peak_traced_mib_after_quarter": round(peak_quarter / 2**20, 2),
        "peak_traced_mib_at_end": round(peak / 2**20, 2),
        "live_requests_at_end": len(state.requests),
        "history_len": len(state.history),
    }


class FeedSource:
    """What the app polls: events a feeder thread hands over (this bench's stand-in for a live socket)."""

    connection = "live"

    def __init__(self, events: list) -> None:
        self.events = list(events)
        self.pos = 0
        self._lock = threading.Lock()

    def feed(self, events: list) -> None:
        with self._lock:
            self.events.extend(events)

    def poll(self) -> list:
        with self._lock:
            out, self.pos = self.events[self.pos:], len(self.events)
        return out


def bench_app(events: list, seconds: float, rate: float) -> dict:
    from kvscope.tui.app import KvscopeApp

    head = [e for e in events[:2]]
    rest = events[2:]
    source = FeedSource(head)
    stop = threading.Event()
    fed = [0]

    def feed() -> None:
        i = 0
        t0 = time.perf_counter()
        while not stop.is_set() and i < len(rest):
            due = int((time.perf_counter() - t0) * rate)
            chunk = []
            while i < len(rest) and fed[0] < due:
                ev = rest[i]
                chunk.append(ev)
                i += 1
                if ev.type == "step":
                    fed[0] += 1
            if chunk:
                source.feed(chunk)
            time.sleep(0.002)

    result: dict = {}

    async def run() -> None:
        app = KvscopeApp(source)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            t = threading.Thread(target=feed, daemon=True)
            r0, s0 = app.repaints, app.state.steps_seen
            t0 = time.perf_counter()
            t.start()
            await asyncio.sleep(seconds)
            stop.set()
            t.join()
            dt = time.perf_counter() - t0
            result.update(
                seconds=round(dt, 2),
                target_steps_per_s=rate,
                steps_fed=fed[0],
                steps_applied_per_s=round((app.state.steps_seen - s0) / dt),
                repaints_per_s=round((app.repaints - r0) / dt, 1),
                backlog_events=len(source.events) - source.pos,
            )

    asyncio.run(run())
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--blocks", type=int, default=2048)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--app", type=float, default=0.0, metavar="S", help="also run the app headless for S seconds")
    p.add_argument("--rate", type=float, default=1000.0, help="steps/s fed to the app")
    p.add_argument("--trace", metavar="FILE", help="feed a recorded trace's events instead of a sim run")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.trace:
        events = trace_events(args.trace, args.steps)
    else:
        events = make_events(args.steps, args.blocks, args.seqs, args.budget)
    print(f"generated {len(events)} events in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    out = {"source": args.trace or "sim", "reducer": bench_reducer(events)}
    print("reducer:", json.dumps(out["reducer"]))
    if args.app:
        out["app"] = bench_app(events, args.app, args.rate)
        print("app:", json.dumps(out["app"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
