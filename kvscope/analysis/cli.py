"""The `kvscope diagnose` command: a trace file, or a sim config run here and diagnosed."""

from __future__ import annotations

import sys


class _ListSink:
    def __init__(self) -> None:
        self.events: list = []

    def publish(self, event) -> None:
        self.events.append(event)


def run_config(config, workload: str, num_requests: int | None, seed: int) -> list:
    """Serve the workload on the sim with this config; the events it published."""
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.serve.driver import ServeOptions, Server

    sink = _ListSink()
    engine = LLMEngine(config, sink=sink)
    Server(engine, ServeOptions(workload=workload, num_requests=num_requests, seed=seed,
                                verbose_rejects=False)).run()
    engine.close()
    return sink.events


def run_diagnose(args, engine_config, usage_error) -> int:
    from kvscope.analysis.diagnose import NoSteps, diagnose_events, diagnose_trace, to_json
    from kvscope.analysis.report import format_text

    if args.window is not None and args.window < 1:
        raise usage_error(f"--window must be >= 1, got {args.window}")
    what_if = not args.no_what_if
    try:
        if args.file:
            d = diagnose_trace(args.file, window=args.window, what_if=what_if)
        elif args.backend == "sim":
            from kvscope.workload import load_spec

            load_spec(args.workload)  # a bad workload fails before the run
            config = engine_config(args)  # flags left out take the config's defaults
            events = run_config(config, args.workload, args.num_requests, config.seed)
            source = f"sim run of workload {args.workload} ({config.model} on {config.gpu})"
            d = diagnose_events(events, window=args.window, what_if=what_if, source=source)
        else:
            raise usage_error("give a trace file, or --backend sim with a config to run and diagnose")
    except NoSteps as e:
        raise usage_error(str(e)) from None
    print(format_text(d), flush=True)
    if args.json:
        try:
            with open(args.json, "wb") as f:
                f.write(to_json(d) + b"\n")
        except OSError as e:
            raise usage_error(f"cannot write {args.json}: {e.strerror}") from None
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
