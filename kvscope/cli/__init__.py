"""The `kvscope` command line: one module per command (a `Command`: name, parser set-up, run),
shared helpers in `common`, the parser and the error handling in `main`.

This package is the only user of argparse; heavy imports happen inside each command's run.
"""

from kvscope.openmp_wait import prefer_short_spin_wait

# every command, before any of them can import torch: OpenMP reads its wait policy once, when torch loads it
# (`kvscope bench` imports torch before the model backend that used to set it, and kept spinning waits)
prefer_short_spin_wait()

from kvscope.cli.main import build_parser, main  # noqa: E402

__all__ = ["build_parser", "main"]
