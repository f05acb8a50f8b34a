"""Deterministic SVG screenshots of the dashboard, request detail, replay, compare and vLLM screens.

    python -m kvscope.tui.screenshots TRACE.kvtrace OUTDIR [--step N]
    python -m kvscope.tui.screenshots --compare OUT.svg TRACE TRACE [TRACE TRACE] [--at SECONDS]
    python -m kvscope.tui.screenshots --vllm OUT.svg TRACE [--step N]
    python -m kvscope.tui.screenshots --detail OUT.svg TRACE [--step N]

The replay is paused and driven by keys, on a clock that never moves, so the same
trace gives the same SVGs byte for byte. Without ``--step`` the script picks the
busiest step in the middle of the trace (most requests in flight, fullest KV cache).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from kvscope.protocol.events import StepEvent

SIZES = {"dashboard": (120, 36), "request-detail": (120, 36), "replay": (80, 24)}


def pick_step(trace) -> int:
    """The step with the most requests in flight and the fullest cache, from 25% to 90% in."""
    steps = [ev for ev in trace if type(ev) is StepEvent]
    if not steps:
        return 0
    lo, hi = len(steps) // 4, max(len(steps) // 4 + 1, (len(steps) * 9) // 10)
    best, best_score = steps[0].step, -1.0
    for ev in steps[lo:hi]:
        util = ev.kv.used / ev.kv.total if ev.kv.total else 0.0
        score = 2 * len(ev.running) + min(len(ev.waiting), 16) / 2 + 2 * len(ev.preempted) + 4 * util
        if score > best_score:
            best, best_score = ev.step, score
    return best


def pick_request(state) -> int | None:
    """A running request with the richest lifecycle (preempted ones first)."""
    best, key = None, None
    for rid in state.running:
        r = state.get(rid)
        if r is None:
            continue
        k = (r.preemptions, len(r.log), -rid)
        if key is None or k > key:
            best, key = rid, k
    return best


def pick_finished_with_text(state) -> int | None:
    """A finished request whose completion the trace carries as text (the latest with the richest log)."""
    done = [r for r in state.finished.values() if r.output_text]
    return max(done, key=lambda r: (r.preemptions, len(r.log), r.req)).req if done else None


async def _shoot(path: str, out_path: str, size: tuple[int, int], step: int | None, what: str,
                 with_text: bool = False) -> None:
    from kvscope.tui.launch import make_replay_app

    app = make_replay_app(path, playing=False, clock=lambda: 0.0, auto_tick=False, index_in_background=False)
    player = app.player
    feed = app.feeds[0]
    cursor = feed.cursor
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        if what == "replay":
            # Start of the trace, then jump to the first preemption (or a few steps in).
            await pilot.press("right", "right", "right")
            if cursor.preempt_steps:
                await pilot.press("p")
            await pilot.press("plus", "plus")
        else:
            player.seek(step if step is not None else pick_step(cursor.trace))
            app.pump()
            await pilot.pause()
            if what == "request-detail":
                req = pick_finished_with_text(app.state) if with_text else pick_request(app.state)
                if req is not None:
                    app.screen.selected = req
                    from kvscope.tui.screens import RequestDetailScreen

                    await app.push_screen(RequestDetailScreen(feed, req))
                    await pilot.pause()  # its footer too: a busy machine drew the shot before it
            else:
                await pilot.press("down")
        app.pump()
        app.redraw(force=True)
        await pilot.pause()
        svg = app.export_screenshot(title=f"kvscope {what}")
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(svg)


async def _shoot_compare(paths: list[str], out_path: str, size: tuple[int, int], at: float | None) -> None:
    from kvscope.tui.launch.compare import make_compare_app

    app = make_compare_app(paths, playing=False, clock=lambda: 0.0, auto_tick=False)
    async with app.run_test(size=size) as pilot:
        # Default moment: 40% into the fastest run, while every run is still busy.
        ends = [t.end for t in app.player.tracks if t is not None and t.keys]
        app.player.seek_time(at if at is not None else 0.4 * min(ends, default=0.0))
        app.pump()
        app.redraw(force=True)
        await pilot.pause()
        svg = app.export_screenshot(title="kvscope compare")
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(svg)


def make_compare_screenshot(paths: list[str], out_path: str, size: tuple[int, int] = (160, 45),
                            at: float | None = None) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    asyncio.run(_shoot_compare(paths, out_path, size, at))
    return out_path


async def _shoot_vllm(path: str, out_path: str, size: tuple[int, int], step: int | None) -> None:
    from kvscope.tui.launch import make_replay_app

    app = make_replay_app(path, playing=False, auto_tick=False)
    feed = app.feeds[0]
    src = feed.source
    # Default tick: 70% in, with the cache full and turning over and the window's rates set.
    app.player.seek(step if step is not None else src.first_step + 7 * (src.last_step - src.first_step) // 10)
    async with app.run_test(size=size) as pilot:
        feed.refresh_top()  # the prefix list refreshes once a second: draw it now
        app.pump()
        await pilot.pause()
        svg = app.export_screenshot(title="kvscope vLLM replay")
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(svg)


def make_vllm_screenshot(path: str, out_path: str, size: tuple[int, int] = (120, 30), step: int | None = None) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    asyncio.run(_shoot_vllm(path, out_path, size, step))
    return out_path


def make_detail_screenshot(path: str, out_path: str, step: int | None = None) -> str:
    """Request detail of a finished request with its prompt and completion as text (a real-model trace)."""
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    asyncio.run(_shoot(path, out_path, SIZES["request-detail"], step, "request-detail", with_text=True))
    return out_path


def make_screenshots(trace_path: str, outdir: str, step: int | None = None) -> list[str]:
    os.makedirs(outdir, exist_ok=True)
    written = []
    for what, size in SIZES.items():
        out = os.path.join(outdir, f"{what}.svg")
        asyncio.run(_shoot(trace_path, out, size, step, what))
        written.append(out)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvscope.tui.screenshots", description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", metavar="PATH", help="TRACE OUTDIR, or with --compare: 2-4 traces")
    p.add_argument("--step", type=int, default=None, help="step for the dashboard and detail shots")
    p.add_argument("--compare", metavar="OUT.svg", default=None, help="one compare screenshot of the traces")
    p.add_argument("--at", type=float, default=None, help="with --compare: seconds since the first arrival")
    p.add_argument("--vllm", metavar="OUT.svg", default=None, help="one shot of a recorded vLLM in the vLLM view")
    p.add_argument("--detail", metavar="OUT.svg", default=None,
                   help="one request-detail shot of a finished request with its text (a real-model trace)")
    args = p.parse_args(argv)
    if args.detail:
        if len(args.paths) != 1:
            p.error("give one trace with --detail")
        print(make_detail_screenshot(args.paths[0], args.detail, step=args.step))
        return 0
    if args.vllm:
        if len(args.paths) != 1:
            p.error("give one recorded vLLM trace with --vllm")
        print(make_vllm_screenshot(args.paths[0], args.vllm, step=args.step))
        return 0
    if args.compare:
        print(make_compare_screenshot(args.paths, args.compare, at=args.at))
        return 0
    if len(args.paths) != 2:
        p.error("give TRACE OUTDIR")
    for path in make_screenshots(args.paths[0], args.paths[1], args.step):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
