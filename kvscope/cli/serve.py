"""`kvscope serve`: run the engine over a workload, the OpenAI API, or both."""

from __future__ import annotations

import argparse
import sys

from kvscope.cli.command import Command
from kvscope.cli.common import (UsageError, check_address, check_output_path, engine_args, engine_config,
                                float_type, int_type, open_socket, progress_bar, workload_args, write_json)
from kvscope.cli.stop_signals import StopSignals


class Serve(Command):
    name = "serve"
    help = "run the engine over a workload"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from kvscope.protocol.transport import DEFAULT_CONTROL_ADDR, DEFAULT_EVENTS_ADDR
        from kvscope.serve.options import DEFAULT_MAX_WAITING

        engine_args(p)
        workload_args(p, "mixed")
        p.add_argument("--forever", action="store_true", help="keep generating requests until stopped")
        p.add_argument("--burst-every", type=float_type(positive=True), default=None, metavar="S",
                       help="with --forever: a burst every S s")
        p.add_argument("--max-waiting", type=int_type(1, 1 << 20), default=DEFAULT_MAX_WAITING, metavar="N",
                       help="refuse new requests while N are waiting; a control burst past it is answered "
                            f"'refused' (default: {DEFAULT_MAX_WAITING})")
        p.add_argument("--events", metavar="ADDR", help=f"publish events (e.g. {DEFAULT_EVENTS_ADDR})")
        p.add_argument("--control", metavar="ADDR", help=f"accept control requests (e.g. {DEFAULT_CONTROL_ADDR})")
        p.add_argument("--allow-remote", action="store_true", help="allow binding to non-loopback addresses")
        p.add_argument("--record", metavar="FILE", help="record a .kvtrace file")
        p.add_argument("--kv-events-vllm", metavar="ADDR", help="publish prefix-cache events in vLLM's KV-event "
                       "format (e.g. tcp://127.0.0.1:5560)")
        p.add_argument("--kv-replay-vllm", metavar="ADDR", help="with --kv-events-vllm: a vLLM-style replay ROUTER")
        p.add_argument("--kv-events-vllm-encoding", default="map", choices=["map", "array"],
                       help="map: vLLM 0.26 and later; array: older releases (default: map)")
        p.add_argument("--json", metavar="FILE", help="write the summary as JSON")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        h = p.add_argument_group("HTTP API (docs/HTTP.md) and Prometheus metrics (docs/METRICS.md)")
        h.add_argument("--http", metavar="HOST:PORT", help="serve the OpenAI API, e.g. 127.0.0.1:8000 (synthetic "
                       "traffic then runs only with --forever)")
        h.add_argument("--served-model-name", nargs="+", metavar="NAME", help="the model names clients may ask "
                       "for; the first is the default and the one metrics carry (default: the --model argument)")
        h.add_argument("--api-key", metavar="KEY", help="/v1 routes need 'Authorization: Bearer KEY' (default: "
                       "$KVSCOPE_API_KEY, then $VLLM_API_KEY; none: open)")
        h.add_argument("--trust-request-chat-template", action="store_true",
                       help="render a chat template a request brings (chat_template, or inside "
                            "chat_template_kwargs; still sandboxed and bounded); without it such a request is a 400")
        h.add_argument("--metrics-port", type=int_type(1, 65535), metavar="N",
                       help="also serve /metrics alone on port N")

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.workload import load_spec

        load_spec(args.workload)  # fail on a bad workload before loading the model
        check_output_path(args.json, inputs=[args.record, args.workload])
        check_output_path(args.record, inputs=[args.workload], kind="kvtrace")
        if args.events and args.control and args.events == args.control:
            raise UsageError(f"--events and --control must be different addresses (both {args.events})")
        for addr in (args.events, args.control):
            if addr:
                check_address(addr, bind=True, allow_remote=args.allow_remote)
        front = _front_end_check(args)
        config = engine_config(args)
        publisher, control = _open_sockets(args)  # bind before the model loads: a port in use fails fast
        try:
            return _serve(args, config, publisher, control, front)
        finally:
            if publisher is not None:
                publisher.close()
            if control is not None:
                control.close()


def _open_sockets(args):
    publisher = control = None
    if args.events:
        from kvscope.protocol.transport import ZmqPublisher

        publisher = open_socket("bind", args.events, lambda: ZmqPublisher(args.events, allow_remote=args.allow_remote))
    if args.control:
        from kvscope.protocol.transport import ControlServer
        from kvscope.workload import PRESETS

        try:
            control = open_socket("bind", args.control, lambda: ControlServer(
                args.control, allow_remote=args.allow_remote, workloads=PRESETS))
        except BaseException:
            if publisher is not None:
                publisher.close()
            raise
    return publisher, control


def _serve(args, config, publisher, control, front) -> int:
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.metrics import summary_table
    from kvscope.serve.driver import ServeOptions, Server

    engine = LLMEngine(config)
    print(f"kvscope: {engine.describe_model()}", file=sys.stderr)
    print(f"kvscope: {engine.describe_dtype()}", file=sys.stderr)
    print(f"kvscope: {engine.describe_kv_cache()}", file=sys.stderr)
    front = front(engine) if front else None
    sinks = ([front.sink] if front else []) + ([publisher] if publisher is not None else [])
    if args.record:
        from kvscope.traces.writer import TraceWriter

        sinks.append(TraceWriter(args.record, engine.hello(), snapshot_provider=engine.snapshot))
    if args.kv_events_vllm:
        from kvscope.adapters.vllm_publisher import VllmKvPublisher

        if not engine.config.prefix_caching:
            print("kvscope: note: --kv-events-vllm without --prefix-caching publishes no blocks", file=sys.stderr)
        vllm_publisher = open_socket("bind", args.kv_events_vllm, lambda: VllmKvPublisher(
            args.kv_events_vllm, args.kv_replay_vllm, block_size=engine.config.block_size,
            encoding=args.kv_events_vllm_encoding, allow_remote=args.allow_remote))
        engine.kv_event_consumers.append(vllm_publisher.consume)
        sinks.append(vllm_publisher)
    if sinks:
        from kvscope.protocol.sinks import FanOut

        engine.attach(sinks[0] if len(sinks) == 1 else FanOut(sinks))
    # with the HTTP API the engine serves until stopped; synthetic traffic only with --forever
    http_only = front is not None and front.http_address is not None and not args.forever
    options = ServeOptions(workload=args.workload, num_requests=args.num_requests, seed=engine.config.seed,
                           forever=args.forever or http_only, burst_every_s=args.burst_every,
                           max_waiting=args.max_waiting)
    progress = progress_bar(not args.no_progress, total=_total_requests(options), desc=f"{engine.config.mode}")
    reason = "drained"
    server = Server(engine, options, control=control, on_progress=progress.update,
                    inbox=front.bridge if front else None)
    # Ctrl-C and SIGTERM end serve alike (the summary prints, the trace gets its index); the loop also
    # checks the flag, so a stop whose KeyboardInterrupt Python swallowed still ends the run
    signals = StopSignals(server.stop)
    with signals:
        try:
            if front is not None:
                front.start()
            summary = server.run(items=() if http_only else None)
        except KeyboardInterrupt:
            summary = server.summary()
        finally:
            signals.ignore()  # a second SIGTERM or Ctrl-C must not cut the trace's index short
            if signals.requested:
                reason = "interrupted"
            progress.close()
            if front is not None:
                front.close()
            engine.close(reason)
            for sink in sinks:
                if sink is not publisher:  # run() closes the publisher, which it opened
                    sink.close()
    print(summary_table(summary))
    if args.json:
        write_json(args.json, {"config": engine.hello().config.as_dict(), "summary": summary.to_dict()})
    return 0


def _total_requests(options) -> int | None:
    """The run's request count, or None for a run with no end (--forever, or the HTTP API alone)."""
    if options.forever:
        return None
    from kvscope.workload import load_spec

    return options.num_requests or load_spec(options.workload).num_requests


def _front_end_check(args):
    """Check --http / --metrics-port before loading the model; returns engine -> FrontEnd, or None."""
    if not args.http and args.metrics_port is None:
        return None
    from kvscope.serve.frontend import FrontEnd, parse_host_port

    if args.http:
        parse_host_port(args.http, args.allow_remote)
    for name in args.served_model_name or ():
        if not name.strip():  # a client's "model": "" would then be served, and metrics labelled with nothing
            raise UsageError("--served-model-name: a model name cannot be empty")
    # the names clients ask for: the flag, else the model the engine resolved (its default included)
    return lambda engine: FrontEnd(engine, http=args.http, metrics_port=args.metrics_port,
                                   served_model_name=args.served_model_name or engine.config.model,
                                   allow_remote=args.allow_remote, max_waiting=args.max_waiting,
                                   api_key=args.api_key,
                                   trust_request_chat_template=args.trust_request_chat_template)
