"""`kvscope fetch`: download a named real model into the cache once (kvscope.engine.named_models)."""

from __future__ import annotations

import argparse

from kvscope.cli.command import Command


class Fetch(Command):
    name = "fetch"
    help = "download a named real model into the cache (once; later runs reuse it)"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from kvscope.engine.named_models import NAMED_MODELS

        p.add_argument("name", choices=list(NAMED_MODELS))

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.engine.named_models import fetch

        print(fetch(args.name))
        return 0
