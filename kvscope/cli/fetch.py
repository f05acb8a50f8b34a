"""`kvscope fetch`: download a named real model into the cache once (kvscope.engine.loader.named_models), and
convert it once into the form the engine reads directly (kvscope.engine.loader.model_cache), so the first
`kvscope demo --model NAME` starts as fast as every later one. It also compiles the CPU attention
kernel for this machine (kvscope.kernels.cpu.library), once, for the same reason."""

from __future__ import annotations

import argparse

from kvscope.cli.command import Command
from kvscope.cli.common import UsageError

FETCHABLE = ["smollm2-135m"]  # kvscope.engine.loader.named_models.NAMED_MODELS (tests/test_named_models.py keeps them equal)


class Fetch(Command):
    name = "fetch"
    help = "download a named real model into the cache (once; later runs reuse it)"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        # the name is checked in run(): building the parser must load nothing of the engine but its config
        p.add_argument("name", metavar="NAME", help=f"one of: {', '.join(FETCHABLE)}")
        p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                       help="the dtype to convert the weights to, as the engine's --dtype (default auto: bfloat16 "
                            "on CPUs with AMX or AVX-512 BF16, else float32)")
        p.add_argument("--no-convert", action="store_true",
                       help="download only; the first start then converts (slow once)")

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.engine.loader.named_models import NAMED_MODELS, fetch

        if args.name not in NAMED_MODELS:
            raise UsageError(f"unknown model {args.name!r} (choose from {', '.join(NAMED_MODELS)})")
        path = fetch(args.name)
        if not args.no_convert:
            import torch

            from kvscope.engine.worker.model_backend import resolve_dtype
            from kvscope.engine.loader.models import load_model

            load_model(args.name, resolve_dtype(args.dtype, torch.device("cpu")), "cpu")  # converts, or checks
        from kvscope.kernels.cpu import library as cpu_attention

        if not cpu_attention.forced_reference():
            cpu_attention.load()  # cached: a no-op; a failed build is a note, and the engine uses the reference
        print(path)
        return 0
