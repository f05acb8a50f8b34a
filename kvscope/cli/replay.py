"""`kvscope replay`: play a recorded .kvtrace through the dashboard (or the vLLM view)."""

from __future__ import annotations

import argparse

from kvscope.cli.command import Command
from kvscope.cli.common import add_palette, add_slo_args, slo_from_args


class Replay(Command):
    name = "replay"
    help = "replay a recorded .kvtrace file"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("file")
        add_slo_args(p, cost=False, recorded=True)
        add_palette(p)

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.tui.launch import run_replay

        run_replay(args.file, palette=args.palette, slo=slo_from_args(args) or None)
        return 0
