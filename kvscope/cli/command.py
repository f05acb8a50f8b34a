"""The shape of a `kvscope` command, as vLLM's CLISubcommand: a name, its parser, its run."""

from __future__ import annotations

import argparse
from typing import ClassVar


class Command:
    """One subcommand. Its module imports only argparse-level things at the top; the work it
    does imports what it needs inside ``run``, so `kvscope replay` never loads torch."""

    name: ClassVar[str]
    help: ClassVar[str]
    description: ClassVar[str | None] = None

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        raise NotImplementedError

    def run(self, args: argparse.Namespace) -> int:
        raise NotImplementedError
