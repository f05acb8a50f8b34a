"""`kvscope report INPUT... --html OUT.html`: traces, benchmarks/race JSON or diagnose JSON as one HTML page."""

from __future__ import annotations

import argparse
import sys
import time

from kvscope.cli.command import Command
from kvscope.cli.common import add_slo_args, slo_from_args


class Report(Command):
    name = "report"
    help = "one self-contained HTML page of plots from 1-4 traces, benchmarks/race JSON or diagnose JSON"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("inputs", nargs="+", metavar="INPUT",
                       help="1-4 .kvtrace files (as compare takes them), and/or bench, race or diagnose JSON")
        p.add_argument("--html", required=True, metavar="OUT.html", help="the page to write")
        add_slo_args(p, recorded=True)

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.report.page import write_report

        started = time.monotonic()
        tty = sys.stderr.isatty()
        log = (lambda m: print(f"\rkvscope report: {m}\033[K", end="", file=sys.stderr, flush=True)) if tty \
            else (lambda m: None)
        size = write_report(args.inputs, args.html, log=log, slo=slo_from_args(args) or None,
                            cost_per_hour=args.cost_per_hour)
        if tty:
            print("\r\033[K", end="", file=sys.stderr)
        print(f"wrote {args.html} ({size / 1024:,.0f} KiB, {time.monotonic() - started:.1f} s)", file=sys.stderr)
        return 0
