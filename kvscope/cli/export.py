"""`kvscope export`: a .kvtrace as a Perfetto timeline and CSV tables (docs/EXPORT.md)."""

from __future__ import annotations

import argparse
import sys

from kvscope.cli.command import Command
from kvscope.cli.common import UsageError


class Export(Command):
    name = "export"
    help = "a .kvtrace as Perfetto/chrome://tracing JSON and CSV tables (docs/EXPORT.md)"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("file", metavar="TRACE", help="a .kvtrace file")
        p.add_argument("--perfetto", metavar="OUT.json", help="Chrome trace event JSON for Perfetto or chrome://tracing")
        p.add_argument("--requests", metavar="OUT.csv", help="one row per request")
        p.add_argument("--steps", metavar="OUT.csv", help="one row per scheduler step")

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.serve.export import export_trace

        outputs = [("--perfetto", args.perfetto), ("--requests", args.requests), ("--steps", args.steps)]
        given = [(flag, path) for flag, path in outputs if path]
        if not given:
            raise UsageError("export needs at least one of --perfetto OUT.json, --requests OUT.csv, --steps OUT.csv")
        from kvscope.output_paths import CSV, JSON, check_outputs

        check_outputs([(args.perfetto, JSON, "--perfetto"), (args.requests, CSV, "--requests"),
                       (args.steps, CSV, "--steps")], inputs=[args.file])
        stats = export_trace(args.file, perfetto=args.perfetto, requests_csv=args.requests, steps_csv=args.steps)
        print(f"exported {stats.steps} steps, {stats.requests} requests ({stats.slices} slices on "
              f"{stats.lanes} request lanes)", file=sys.stderr)
        return 0
