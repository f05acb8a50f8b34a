"""`kvscope compare A B [C D]`: two to four traces side by side on one clock."""

from __future__ import annotations

import argparse
import sys

from kvscope.cli.command import Command
from kvscope.cli.common import UsageError, add_palette, add_slo_args, float_type, slo_from_args


def add_playback(p: argparse.ArgumentParser) -> None:
    """Alignment and speed of a synced replay (compare, and race when it opens compare)."""
    from kvscope.tui.model.player import ALIGNS

    p.add_argument("--align", default="time", choices=ALIGNS,
                   help="time: engine time since each run's first arrival; step: by step number (default: time)")
    p.add_argument("--speed", type=float_type(0.1, 100.0), default=1.0, help="playback speed, 0.1-100 (default: 1)")


class Compare(Command):
    name = "compare"
    help = "play 2-4 traces side by side on one clock"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("files", nargs="+", metavar="TRACE", help="two to four .kvtrace files")
        add_playback(p)
        p.add_argument("--paused", action="store_true", help="start paused")
        add_slo_args(p, recorded=True)
        add_palette(p)

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.tui.launch.compare import make_compare_app
        from kvscope.tui.sources.runs import MAX_RUNS

        if not 2 <= len(args.files) <= MAX_RUNS:
            raise UsageError(f"compare takes 2 to {MAX_RUNS} traces, got {len(args.files)}")
        app = make_compare_app(args.files, align=args.align, speed=args.speed, playing=not args.paused,
                               palette=args.palette, slo=slo_from_args(args) or None,
                               cost_per_hour=args.cost_per_hour)
        for run in (feed.run for feed in app.feeds):
            if run is not None and run.error:
                print(f"kvscope compare: {run.path}: {run.error} (its column says so)", file=sys.stderr)
        app.run()
        return 0
