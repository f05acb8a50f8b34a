"""How fast the TUI folds events into its state, and whether its memory stays flat.

    python bench/tui_throughput.py [--steps 20000] [--blocks 2048] [--seqs 64] [--app 5]

1. Reducer: feeds N synthetic step events (plus their request/snapshot events)
   through ``kvscope.tui.state.reduce`` and prints steps/s; then, in a second pass
   under tracemalloc, the peak memory after N/4 and after N steps (flat = bounded).
2. With ``--app S``: runs the Textual app headless for S seconds while a thread
   feeds it events at ``--rate`` steps/s, and prints the steps applied per second,
   repaints per second (must stay <= 30) and the backlog left at the end.

The events come from ``kvscope.tui.synthetic`` (a toy scheduler, not the engine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
import tracemalloc

from kvscope.tui.state import new_state, reduce
from kvscope.tui.synthetic import SyntheticEngine


def make_events(steps: int, blocks: int, seqs: int, budget: int, seed: int = 0) -> list:
    eng = SyntheticEngine(seed=seed, num_blocks=blocks, max_seqs=seqs, budget=budget, arrival_p=0.9,
                          snapshot_every=256, bursts=tuple(range(100, steps, 500)), burst_size=seqs // 2)
    events = [eng.hello(), eng.snapshot()]
    for _ in range(steps):
        events.extend(eng.step())
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


def bench_app(events: list, seconds: float, rate: float) -> dict:
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.sources import ListSource

    head = [e for e in events[:2]]
    rest = events[2:]
    source = ListSource(head, connection="live")
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
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    events = make_events(args.steps, args.blocks, args.seqs, args.budget)
    print(f"generated {len(events)} events in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    out = {"reducer": bench_reducer(events)}
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
