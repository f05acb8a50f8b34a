"""`kvscope fetch`: download a named real model into the cache once (kvscope.engine.named_models)."""

from __future__ import annotations

import argparse

from kvscope.cli.command import Command

FETCHABLE = ["smollm2-135m"]  # kvscope.engine.named_models.NAMED_MODELS (tests/test_named_models.py keeps them equal)


class Fetch(Command):
    name = "fetch"
    help = "download a named real model into the cache (once; later runs reuse it)"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        # the names, not the module: building the parser must load nothing of the engine but its config
        p.add_argument("name", choices=FETCHABLE)

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.engine.named_models import fetch

        print(fetch(args.name))
        return 0
