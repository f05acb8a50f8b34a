"""`kvscope trace-info`: what a .kvtrace file holds, every chunk checked (or the index trusted)."""

from __future__ import annotations

import argparse

from kvscope.cli.command import Command


class TraceInfo(Command):
    name = "trace-info"
    help = "describe a .kvtrace file and check every chunk"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("file", metavar="TRACE", help="a .kvtrace file")
        p.add_argument("--fast", action="store_true", help="trust the index: read no chunk (no checksum check)")

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.traces.info import trace_info

        print(trace_info(args.file, verify=not args.fast))
        return 0
