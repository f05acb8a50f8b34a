"""`kvscope replay`: play a recorded .kvtrace through the dashboard (or the vLLM view)."""

from __future__ import annotations

import argparse

from kvscope.cli.command import Command
from kvscope.cli.common import add_palette, add_slo_args, float_type, slo_from_args


class Replay(Command):
    name = "replay"
    help = "replay a recorded .kvtrace file"
    description = "Replay a recorded .kvtrace file through the live dashboard's screens (space pauses, ← → step)."

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("file", metavar="TRACE", help="a .kvtrace file")
        p.add_argument("--speed", type=float_type(0.1, 100.0), default=1.0, help="playback speed, 0.1-100 (default: 1)")
        p.add_argument("--paused", action="store_true", help="start paused")
        add_slo_args(p, cost=False, recorded=True)
        add_palette(p)

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.tui.launch import run_replay

        run_replay(args.file, palette=args.palette, speed=args.speed, paused=args.paused,
                   slo=slo_from_args(args) or None)
        return 0
