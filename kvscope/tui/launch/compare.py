"""`kvscope compare` / `kvscope race`: N traces as N ReplayFeeds, one Player in sync, the compare screen.

Each run has its own state, folded from its own events by the same fold loop as the
dashboard, so a column at a moment shows what that run's replay shows at that step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from kvscope.errors import KvscopeError
from kvscope.tui.sources.runs import MAX_RUNS, Run, load_run

if TYPE_CHECKING:
    from kvscope.tui.app import KvscopeApp

LABELS = "ABCD"


class CompareError(KvscopeError):
    """A compare the user asked for that cannot be shown (one line)."""


def load_runs(paths: list[str], clock: Callable[[], float], slo=None, cost_per_hour: float | None = None) -> list[Run]:
    if not 2 <= len(paths) <= MAX_RUNS:
        raise CompareError(f"compare takes 2 to {MAX_RUNS} traces, got {len(paths)}")
    return [load_run(p, LABELS[i], clock=clock, slo=slo, cost_per_hour=cost_per_hour) for i, p in enumerate(paths)]


def make_compare_app(paths: list[str], *, align: str = "time", speed: float = 1.0, playing: bool = True,
                     palette: str = "default", clock: Callable[[], float] = time.monotonic,
                     auto_tick: bool = True, notes: list[str] | None = None, slo=None,
                     cost_per_hour: float | None = None) -> "KvscopeApp":
    """The app on the compare screen for 2-4 trace files; a damaged trace gets a column that says so."""
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.feeds import ReplayFeed
    from kvscope.tui.model.player import Player, make_track

    runs = load_runs(paths, clock, slo, cost_per_hour)
    if not any(r.ok for r in runs):
        raise CompareError("none of the traces can be read: " + "; ".join(f"{r.path}: {r.error}" for r in runs))
    feeds = [ReplayFeed(r.controller, name=f"{r.label} · {r.name}", run=r, slo=slo) for r in runs]
    tracks = [make_track(r.controller, align, r.first_arrival) if r.ok else None for r in runs]
    player = Player([r.controller for r in runs], tracks, align=align, speed=speed, playing=playing, clock=clock)
    return KvscopeApp(feeds, player, "compare", palette=palette, auto_tick=auto_tick, notes=notes)
