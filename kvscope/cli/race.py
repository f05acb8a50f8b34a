"""`kvscope race`: the same requests through several modes or policies, recorded, then compared."""

from __future__ import annotations

import argparse
import os
import sys

from kvscope.cli.command import Command
from kvscope.cli.common import (UsageError, add_palette, add_slo_args, check_output_path, engine_args,
                                engine_config, explicit_sim_overrides, slo_from_args, workload_args, write_json)
from kvscope.cli.compare import add_playback


class Race(Command):
    name = "race"
    help = "the same requests through several modes/policies, then compare them"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        engine_args(p)
        workload_args(p, "mixed")
        p.add_argument("--preset", metavar="NAME", help="a sim bench preset, e.g. lesson (kvscope/bench/presets/)")
        p.add_argument("--keep-arrivals", action="store_true",
                       help="sim: serve the requests at the workload's own arrival times (default: all at t=0, as "
                            "bench does; a queue that only drains shows no continuous batching)")
        p.add_argument("--modes", default=None, help="comma list (default: naive,static,continuous,chunked, "
                                                      "or the preset's)")
        p.add_argument("--policies", default=None, help="comma list of policies to race (default: --policy)")
        p.add_argument("--schedulers", default=None, help="comma list: kvscope,vllm races kvscope's scheduler "
                       "against vLLM's own V1 scheduler on the same requests (default: --scheduler; with several, "
                       "--modes defaults to chunked)")
        p.add_argument("--out", default="kvscope-race", metavar="DIR", help="where the traces go (default: "
                                                                             "./kvscope-race)")
        p.add_argument("--no-tui", action="store_true", help="print the table (and --json) instead of opening compare")
        p.add_argument("--json", metavar="FILE", help="write the rows as JSON (bench's shape)")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        add_slo_args(p)
        add_playback(p)
        add_palette(p)

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.bench.modes import print_table
        from kvscope.bench.race import plan, race_result, run_race, trace_path

        check_output_path(args.json, inputs=[args.workload, args.preset])
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise UsageError(f"--out {args.out}: not a directory")
        config, items, device, workload, preset_modes, sim = _race_inputs(args)
        schedulers = [s for s in args.schedulers.split(",") if s] if args.schedulers else []
        default_modes = ["chunked"] if len(schedulers) > 1 else ["naive", "static", "continuous", "chunked"]
        modes = args.modes.split(",") if args.modes else (
            default_modes if len(schedulers) > 1 else (preset_modes or default_modes))
        policies = args.policies.split(",") if args.policies else []
        runs = plan(config, [m for m in modes if m], [p for p in policies if p], schedulers)
        if os.path.isdir(args.out):  # the traces it will write: never over a file of another kind
            for run in runs:
                check_output_path(trace_path(run, args.out), inputs=[args.workload, args.preset, args.json],
                                  kind="kvtrace")
        where = "sim backend" if sim else f"{device}, one run after another"
        print(f"kvscope race: {len(runs)} runs of {len(items)} requests ({where})", file=sys.stderr)
        from kvscope.bench.harness import add_cost

        slo = slo_from_args(args)
        rows = run_race(runs, items, args.out, sim=sim, progress=not args.no_progress, slo=slo)
        result = add_cost(race_result(runs, rows, items, device, sim=sim, workload=workload), args.cost_per_hour)
        if args.json:
            write_json(args.json, result)
        if args.no_tui:
            print_table(result)
            return 0
        from kvscope.tui.launch.compare import make_compare_app

        note = ("sim runs: virtual clocks, replayed together" if sim else
                "runs took turns on this machine (never at once, so each had the cores to itself); replayed in sync")
        app = make_compare_app(result["traces"], align=args.align, speed=args.speed, palette=args.palette,
                               notes=[note], slo=slo, cost_per_hour=args.cost_per_hour)
        app.run()
        return 0


def _race_inputs(args):
    """(base config, requests, device, workload name, default modes, sim?) as bench would pick them."""
    from kvscope import workload as wl
    from kvscope.bench.preset import load_preset
    from kvscope.bench.sim import sim_workload
    from kvscope.engine.config import EngineConfig

    if args.preset:
        preset = load_preset(args.preset)
        if preset.kind != "modes":
            raise UsageError(f"preset {args.preset!r} has no engine and workload to race (try lesson)")
        config = EngineConfig(**{**preset.data.engine, **explicit_sim_overrides(args)})
        spec = wl.parse_spec(preset.data.workload)
        items = sim_workload(config, spec, args.num_requests, None, keep_arrivals=args.keep_arrivals)
        return config, items, _device(config), spec.name, preset.data.modes, config.backend == "sim"
    config = engine_config(args)
    if config.backend == "sim":
        spec = wl.load_spec(args.workload)
        items = sim_workload(config, spec, args.num_requests, None, keep_arrivals=args.keep_arrivals)
        return config, items, _device(config), spec.name, None, True
    from kvscope.bench.modes import BenchOptions, bench_items

    wl.load_spec(args.workload)
    items, device = bench_items(config, BenchOptions(workload=args.workload, num_requests=args.num_requests))
    return config, items, device, args.workload, None, False


def _device(config) -> str:
    from kvscope.engine.llm_engine import LLMEngine

    return str(LLMEngine(config).hello().config.device)
