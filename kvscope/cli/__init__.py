"""The `kvscope` command line: one module per command (a `Command`: name, parser set-up, run),
shared helpers in `common`, the parser and the error handling in `main`.

This package is the only user of argparse; heavy imports happen inside each command's run.
"""

from kvscope.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
