"""`kvscope diagnose`: name the bottleneck of a trace, or of a sim config run here, and the knobs to turn."""

from __future__ import annotations

import argparse
import os
import sys

from kvscope.cli.command import Command
from kvscope.cli.common import (UsageError, add_slo_args, check_output_path, engine_args, engine_config, int_type,
                                slo_from_args, workload_args)
from kvscope.cli.diagnose_vllm import add_vllm_args, diagnose_file

MAX_WINDOW = 1 << 40  # steps: more than any trace holds (a larger number overflowed a C size: a cryptic error)


class Diagnose(Command):
    name = "diagnose"
    help = "name the bottleneck of a trace (or of a sim config) and the knobs to turn"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("file", nargs="*", metavar="TRACE", help="a .kvtrace file (omit it with --backend sim to diagnose "
                       "a config); several: the replicas of one deployment, judged together (is the load spread?) "
                       "and each on its own")
        p.add_argument("--json", metavar="FILE", help="also write the diagnosis as JSON")
        p.add_argument("--window", type=int_type(1, MAX_WINDOW), default=None, metavar="N",
                       help="judge only the last N steps")
        p.add_argument("--no-what-if", action="store_true", help="skip re-running the requests in the sim")
        engine_args(p)
        workload_args(p, "mixed")
        add_vllm_args(p)
        add_slo_args(p, recorded=True)

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.analysis.diagnose import diagnose_events, to_json
        from kvscope.analysis.report import format_text

        files, args.file = list(args.file), (args.file[0] if args.file else None)
        check_output_path(args.json, inputs=files)
        what_if = not args.no_what_if
        if len(files) > 1:
            return _diagnose_replicas(args, files, what_if)
        if args.file:
            d = diagnose_file(args, what_if)  # an engine trace, or a recorded vLLM
        elif args.backend == "sim":
            from kvscope.workload import load_spec

            load_spec(args.workload)  # a bad workload fails before the run
            config = engine_config(args)  # flags left out take the config's defaults
            events = run_config(config, args.workload, args.num_requests, config.seed)
            source = f"sim run of workload {args.workload} ({config.model} on {config.gpu})"
            d = diagnose_events(events, window=args.window, what_if=what_if, source=source,
                                slo=slo_from_args(args) or None)
        else:
            raise UsageError("give a trace file, or --backend sim with a config to run and diagnose")
        text = format_text(d)
        if args.cost_per_hour is not None:
            text += "\n" + cost_line(d, args.cost_per_hour)
        print(text, flush=True)
        if args.json:
            try:
                with open(args.json, "wb") as f:
                    f.write(to_json(d) + b"\n")
            except OSError as e:
                raise UsageError(f"cannot write {args.json}: {e.strerror}") from None
            print(f"wrote {args.json}", file=sys.stderr)
        return 0


def _diagnose_replicas(args: argparse.Namespace, files: list[str], what_if: bool) -> int:
    """Several traces: the replicas of one deployment, judged together, then each on its own."""
    from kvscope.analysis.diagnose import diagnose_trace, to_json
    from kvscope.analysis.replicas import format_replicas, judge_replicas
    from kvscope.analysis.report import format_text
    from kvscope.traces.reader import TraceReader

    if len(set(map(os.path.realpath, files))) < len(files):
        raise UsageError("the same trace is named twice")
    for path in files:
        if TraceReader(path).vllm_recording:
            raise UsageError(f"{path} is a recorded vLLM's metrics: diagnose it alone; replicas are judged from the "
                             "scheduler's steps (kvscope serve --engine vllm --record, or record --connect)")
    slo = slo_from_args(args) or None
    ds = [diagnose_trace(path, window=args.window, what_if=what_if, slo=slo) for path in files]
    report = judge_replicas(ds)
    print(format_replicas(report))
    for d in ds:
        print("\n" + format_text(d))
    if args.json:
        import msgspec

        body = {"replicas": msgspec.to_builtins(report), "diagnoses": [msgspec.json.decode(to_json(d)) for d in ds]}
        try:
            with open(args.json, "wb") as f:
                f.write(msgspec.json.format(msgspec.json.encode(body), indent=2) + b"\n")
        except OSError as e:
            raise UsageError(f"cannot write {args.json}: {e.strerror}") from None
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def cost_line(d, cost_per_hour: float) -> str:
    """$ per million output (and goodput) tokens of the trace, and of the best knob's prediction."""
    from kvscope.goodput import fmt_usd, usd_per_mtok

    def both(f) -> str:
        text = f"{fmt_usd(usd_per_mtok(cost_per_hour, f.output_tok_per_s))}/Mtok"
        if f.goodput_tok_per_s is not None:
            text += f", {fmt_usd(usd_per_mtok(cost_per_hour, f.goodput_tok_per_s))}/Mgood"
        return text

    line = f"cost at ${cost_per_hour:g}/hour: this run {both(d.trace_figures)}"
    best = next((k for k in d.knobs if k.predicted is not None), None)
    if best is not None:
        line += f"; with {best.flag} {best.to} (predicted) {both(best.predicted)}"
    return line


def run_config(config, workload: str, num_requests: int | None, seed: int) -> list:
    """Serve the workload on the sim with this config; the events it published."""
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.protocol.sinks import ListSink
    from kvscope.serve.driver import ServeOptions, Server

    sink = ListSink()
    engine = LLMEngine(config, sink=sink)
    Server(engine, ServeOptions(workload=workload, num_requests=num_requests, seed=seed,
                                verbose_rejects=False)).run()
    engine.close()
    return sink.events
