"""The `kvscope` command: one parser, a subcommand per module of this package.

Errors: a user's mistake (a KvscopeError, an OSError, a ZeroMQ error, a number too large)
ends in one line on stderr and exit status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys

from kvscope.cli.bench import Bench
from kvscope.cli.bench_features import BenchFeatures
from kvscope.cli.calibrate import Calibrate
from kvscope.cli.command import Command
from kvscope.cli.common import EXIT_USAGE, Parser, zmq_errors
from kvscope.cli.compare import Compare
from kvscope.cli.demo import Demo
from kvscope.cli.diagnose import Diagnose
from kvscope.cli.export import Export
from kvscope.cli.fetch import Fetch
from kvscope.cli.race import Race
from kvscope.cli.record import Record
from kvscope.cli.replay import Replay
from kvscope.cli.report import Report
from kvscope.cli.serve import Serve
from kvscope.cli.tour import Tour
from kvscope.cli.trace_info import TraceInfo
from kvscope.cli.tui import Tui
from kvscope.cli.web import Web
from kvscope.errors import KvscopeError

# in the order `kvscope --help` lists them
COMMANDS: tuple[Command, ...] = (Serve(), Bench(), BenchFeatures(), Tui(), Demo(), Tour(), Replay(), Record(), Calibrate(),
                                 Compare(), Race(), Web(), Diagnose(), Export(), TraceInfo(),
                                 Report(), Fetch())


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvscope", description="A small, real LLM inference engine whose scheduler you can watch.")
    parser.add_argument("--version", action="version", version=f"kvscope {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        # every command's --help says what it does: its own description, else its one-line help as a sentence
        description = command.description or command.help[0].upper() + command.help[1:] + "."
        p = sub.add_parser(command.name, help=command.help, description=description)
        command.add_arguments(p)
        p.set_defaults(run=command.run)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvscope")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename and e.strerror:
        return f"{e.strerror}: {e.filename}"
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return first if len(first) <= 400 else first[:397] + "..."


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, its line already printed)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        # the OS's and ZeroMQ's errors (zmq is imported lazily, by the commands that need it) are not ours
        # to subclass; everything else a user can cause is a KvscopeError
        if not isinstance(e, (KvscopeError, OSError, OverflowError, *zmq_errors())):
            raise  # a bug: it keeps its traceback
        print(f"kvscope: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
