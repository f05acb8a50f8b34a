"""`kvscope bench-features`: prefix caching on/off, priority vs fcfs, swap vs recompute."""

from __future__ import annotations

import argparse

from kvscope.cli.command import Command
from kvscope.cli.common import check_output_path, comma_list, float_type, int_type


class BenchFeatures(Command):
    name = "bench-features"
    help = "prefix caching on/off, priority vs fcfs, swap vs recompute"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from kvscope.bench import FEATURE_EXPERIMENTS as EXPERIMENTS

        p.add_argument("--experiments", type=comma_list(EXPERIMENTS, "experiment"), default=list(EXPERIMENTS),
                       help=f"comma list of {', '.join(EXPERIMENTS)} (default: all)")
        p.add_argument("--model", default="tiny")
        p.add_argument("--device", default="cpu")
        p.add_argument("--scale", type=float_type(positive=True, hi=1000.0), default=1.0,
                       help="multiply request counts (default: 1)")
        p.add_argument("--seed", type=int_type(0, (1 << 63) - 1), default=0)
        p.add_argument("--json", metavar="FILE", help="write results as JSON")

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.bench.features import experiment, table
        from kvscope.bench.report import write_json

        check_output_path(args.json)
        results = []
        for name in args.experiments:
            results.append(experiment(name, model=args.model, device=args.device, scale=args.scale, seed=args.seed))
            print(table(results[-1]) + "\n", flush=True)
        if args.json:
            write_json(args.json, {"results": results})
        return 0
