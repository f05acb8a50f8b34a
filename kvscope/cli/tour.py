"""`kvscope tour`: a guided walk through the lesson on the live engine, one idea per chapter."""

from __future__ import annotations

import argparse
import os

from kvscope.cli.command import Command
from kvscope.cli.common import UsageError, add_palette, float_type, int_type
from kvscope.engine.config import SIM_GPUS

DEFAULT_STEP_MS = 40.0


class Tour(Command):
    name = "tour"
    help = "a guided, live walk through the lesson"
    description = ("The dashboard with a caption panel: each chapter stages one idea on the real engine and "
                   "freezes at the moment it happens. → next, ← replay the chapter, space pause/resume, q quit.")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from kvscope.tour.chapters import CHAPTERS

        p.add_argument("--model", default="tiny", help="tiny (default), smollm2-135m, or a checkpoint")
        p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
        p.add_argument("--sim", action="store_true", help="no model: a simulated GPU serving Llama 3.3 70B FP8")
        p.add_argument("--gpu", default="h100-sxm5", choices=SIM_GPUS, help="with --sim: the GPU to simulate")
        p.add_argument("--chapter", type=int_type(1, len(CHAPTERS)), default=1, metavar="N",
                       help=f"start at chapter N (1-{len(CHAPTERS)})")
        p.add_argument("--record", metavar="DIR", help="keep each chapter's trace in DIR (for replay and report)")
        p.add_argument("--step-ms", type=float_type(0.0, 10_000.0), default=DEFAULT_STEP_MS, metavar="MS",
                       help=f"each engine step lasts at least MS ms, so eyes can follow (default: "
                            f"{DEFAULT_STEP_MS:g}; 0: as fast as it runs)")
        p.add_argument("--cpu-threads", type=int_type(1, 4096), default=None, metavar="N",
                       help="torch threads (default: every core but one, which the dashboard gets)")
        add_palette(p)

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.errors import KvscopeError
        from kvscope.tour.driver import TourOptions

        if args.record:
            if os.path.exists(args.record) and not os.path.isdir(args.record):
                raise UsageError(f"--record {args.record}: not a directory")
            os.makedirs(args.record, exist_ok=True)
        options = TourOptions(model=args.model, device=args.device, sim_gpu=args.gpu if args.sim else None,
                              record_dir=args.record, cpu_threads=args.cpu_threads, step_ms=args.step_ms)
        _check(options)
        from kvscope.tour.run import run_tour

        error = run_tour(options, chapter=args.chapter, palette=args.palette)
        if error:
            raise KvscopeError(error)
        return 0


def _check(options) -> None:
    """The engine settings, checked (and a named model fetched) before the dashboard takes the terminal."""
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.loader.named_models import NAMED_MODELS, fetch

    EngineConfig(**options.engine_base()).validate()
    if options.sim_gpu is None and options.model in NAMED_MODELS:
        fetch(options.model)
