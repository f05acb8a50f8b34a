"""`kvscope fetch`: download a named real model into the cache once (kvscope.engine.named_models)."""

from __future__ import annotations

import argparse

from kvscope.cli.command import Command
from kvscope.cli.common import UsageError

FETCHABLE = ["smollm2-135m"]  # kvscope.engine.named_models.NAMED_MODELS (tests/test_named_models.py keeps them equal)


class Fetch(Command):
    name = "fetch"
    help = "download a named real model into the cache (once; later runs reuse it)"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        # the name is checked in run(): building the parser must load nothing of the engine but its config
        p.add_argument("name", metavar="NAME", help=f"one of: {', '.join(FETCHABLE)}")

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.engine.named_models import NAMED_MODELS, fetch

        if args.name not in NAMED_MODELS:
            raise UsageError(f"unknown model {args.name!r} (choose from {', '.join(NAMED_MODELS)})")
        print(fetch(args.name))
        return 0
