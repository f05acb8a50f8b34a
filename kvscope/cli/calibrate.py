"""`kvscope calibrate`: fit the sim's efficiencies and per-step overhead to a recorded trace."""

from __future__ import annotations

import argparse

from kvscope.cli.command import Command
from kvscope.cli.common import check_output_path, write_json


class Calibrate(Command):
    name = "calibrate"
    help = "fit the sim's efficiencies and overhead to a recorded trace"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("file", metavar="TRACE", help="a .kvtrace file")
        p.add_argument("--gpu", default=None, help="the GPU the trace ran on (default: from the trace; cpu for CPU)")
        p.add_argument("--sim-model", default=None, help="catalog shape of the trace's model (default: from the trace)")
        p.add_argument("--no-per-seq", action="store_true", help="fit only efficiencies and the per-step overhead")
        p.add_argument("--validate", metavar="TRACE", action="append", default=[],
                       help="also replay another trace of the same setup with the fitted parameters (repeatable)")
        p.add_argument("--json", metavar="FILE", help="write the fit (usable as --sim-efficiency FILE)")

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.analysis.calibrate import calibrate, format_report

        check_output_path(args.json, inputs=[args.file, *args.validate])
        result = calibrate(args.file, gpu=args.gpu, model=args.sim_model, fit_per_seq=not args.no_per_seq,
                           validate_paths=args.validate)
        print(format_report(result))
        if args.json:
            write_json(args.json, result)
        return 0
