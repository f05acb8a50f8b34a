"""`kvscope replay`: play a recorded .kvtrace through the dashboard (or the vLLM view)."""

from __future__ import annotations

import argparse

from kvscope.cli.command import Command
from kvscope.cli.common import add_palette


class Replay(Command):
    name = "replay"
    help = "replay a recorded .kvtrace file"
    description = "Replay a recorded .kvtrace file through the live dashboard's screens (space pauses, ← → step)."

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("file", metavar="TRACE", help="a .kvtrace file")
        add_palette(p)

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.tui.launch import run_replay

        run_replay(args.file, palette=args.palette)
        return 0
