"""Does `kvscope demo` show its lesson? The share of dashboard frames that show each idea.

    python benchmarks/demo_lesson.py [--seconds 40] [--fps 10] [--busy 1] [--burst-at 15] [--model tiny]
                                [--engine-args "--num-blocks 256 ..."] [--workload demo]

Starts the demo's own engine child (``kvscope.tui.launch.demo.demo_command``: the same workload, pool and
threads as ``kvscope demo``) on free ports, folds its events with the dashboard's reducer
(``LiveFeed``), and samples the reduced state at the redraw rate. A frame "shows":

* queue:    WAITING > 0;
* chunked:  the last step's batch holds a prefill chunk beside decodes (the BATCH panel);
* preempt:  PREEMPTED > 0, or a listed request carries ↺ (preempted before, back in a queue);
* prefix:   a shared block in the map, or a live request that was admitted with a prefix hit.

It prints, per idea, the share of frames and the first time (s after the first step) it showed.
``--busy N`` runs N busy-looping processes beside it (a loaded machine); ``--burst-at T`` presses
``b`` at T s and reports how long WAITING stayed above 0 afterwards.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shlex
import socket
import subprocess
import time

IDEAS = ("queue", "chunked", "preempt", "prefix")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shows(st) -> dict[str, bool]:
    """What one frame of the dashboard shows, from the reduced state."""
    b = st.last_batch
    listed = (*st.running, *st.waiting)
    live = [st.requests.get(r) for r in listed]
    return {
        "queue": bool(st.waiting),
        "chunked": b is not None and b.prefill > 0 and b.decode > 0,
        "preempt": bool(st.preempted) or any(r is not None and r.preemptions for r in live),
        "prefix": st.kv.shared > 0 or any(r is not None and r.cached_tokens for r in live),
    }


def _spin() -> None:
    while True:
        pass


def measure(seconds: float, fps: float, *, busy: int = 0, burst_at: float | None = None, model: str = "tiny",
            workload: str = "demo", engine_args: tuple[str, ...] | None = None) -> dict:
    from kvscope.tui.launch.demo import DEMO_ENGINE_ARGS, demo_command
    from kvscope.tui.feeds.live import LiveFeed
    from kvscope.tui.sources.live import LiveSource

    ev, ctl = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cmd = demo_command(ev, ctl, model=model, workload=workload,
                       engine_args=DEMO_ENGINE_ARGS if engine_args is None else engine_args)
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(busy)]
    for s in spinners:
        s.start()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    feed = LiveFeed(LiveSource(ev, ctl))
    frames = {k: 0 for k in IDEAS}
    first: dict[str, float | None] = {k: None for k in IDEAS}
    n = 0
    waiting_sum = waiting_max = 0
    t0 = None
    burst_sent = burst_queue_s = None
    queue_since_burst = 0.0
    try:
        deadline = time.monotonic() + 600.0  # engine start-up (torch import) on a loaded machine
        while True:
            now = time.monotonic()
            feed.pump(now)
            st = feed.state
            if t0 is None:
                if st.steps_seen:
                    t0 = now
                    deadline = now + seconds
                elif now > deadline or proc.poll() is not None:
                    raise SystemExit(f"the engine did not start (exit code {proc.poll()})")
            if t0 is not None:
                if now >= deadline:
                    break
                n += 1
                seen = shows(st)
                waiting_sum += len(st.waiting)
                waiting_max = max(waiting_max, len(st.waiting))
                for k, v in seen.items():
                    if v:
                        frames[k] += 1
                        if first[k] is None:
                            first[k] = now - t0
                if burst_at is not None and burst_sent is None and now - t0 >= burst_at:
                    feed.request("burst")
                    burst_sent = now
                elif burst_sent is not None and burst_queue_s is None:
                    if seen["queue"]:
                        queue_since_burst = now - burst_sent
                    elif now - burst_sent > 1.0:
                        burst_queue_s = queue_since_burst
            time.sleep(max(0.0, 1.0 / fps - (time.monotonic() - now)))
        steps, preemptions, hits = st.steps_seen, st.preemption_count, st.hit_count
    finally:
        feed.request("stop")
        time.sleep(0.3)
        feed.close()
        proc.terminate()
        proc.wait(10)
        for s in spinners:
            s.terminate()
    return {"frames": n, "share": {k: frames[k] / max(1, n) for k in IDEAS}, "first_s": first,
            "waiting_mean": waiting_sum / max(1, n), "waiting_max": waiting_max, "steps": steps, "preemptions": preemptions, "prefix_hits": hits,
            "burst_queue_s": burst_queue_s if burst_sent is not None else None}


def table(rows: list[tuple[str, dict]]) -> str:
    out = ["| run | frames | " + " | ".join(f"{k} share (first s)" for k in IDEAS)
           + " | WAITING mean/max | steps | preemptions | b: queued for |", "|---" * (len(IDEAS) + 6) + "|"]
    for name, r in rows:
        cells = [f"{r['share'][k]:.0%} ({'-' if r['first_s'][k] is None else format(r['first_s'][k], '.1f')})"
                 for k in IDEAS]
        burst = "-" if r["burst_queue_s"] is None else f"{r['burst_queue_s']:.1f} s"
        out.append(f"| {name} | {r['frames']} | " + " | ".join(cells)
                   + f" | {r['waiting_mean']:.1f}/{r['waiting_max']} | {r['steps']} | {r['preemptions']} | {burst} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="seconds measured after the first step")
    ap.add_argument("--fps", type=float, default=10.0, help="frames sampled per second (the dashboard draws <= 30)")
    ap.add_argument("--busy", type=int, default=0, help="busy-looping processes beside the demo")
    ap.add_argument("--burst-at", type=float, default=None, help="press b this many seconds in")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--workload", default="demo")
    ap.add_argument("--engine-args", default=None, help="replace the demo's engine sizing (one quoted string)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON too")
    args = ap.parse_args()
    r = measure(args.seconds, args.fps, busy=args.busy, burst_at=args.burst_at, model=args.model,
                workload=args.workload,
                engine_args=None if args.engine_args is None else tuple(shlex.split(args.engine_args)))
    print(table([(f"{args.model}, busy {args.busy}", r)]))
    if args.json:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
