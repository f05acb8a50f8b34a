"""The `kvscope` command: serve, bench, bench-features, tui, replay, demo, record, calibrate, trace-info.

This is the only module that uses argparse. The engine flags are built from
EngineConfig's fields (help and choices live in their metadata), so each setting and
its default are defined once. Heavy imports happen inside each command, so
`kvscope replay` never loads torch.

Errors: a user's mistake (KvscopeError, ProtocolError, OSError, a ZeroMQ error, a
number too large) ends in one line on stderr and exit status 2; anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any, Callable, get_args

from kvscope.engine.config import CONFIG_FIELDS, MODES, SIM_GPUS, EngineConfig
from kvscope.engine.errors import KvscopeError

EXIT_USAGE = 2


class UsageError(KvscopeError):
    """A one-line problem with what the user asked for on the command line."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the full usage is one --help away)."""

    def error(self, message: str):
        first = message.splitlines()[0] if message else "bad arguments"
        self.exit(EXIT_USAGE, f"{self.prog}: error: {first} (see {self.prog} --help)\n")


# ---- argument types: one-line errors, sizes as numbers like 1e9 -----------------------------
def _int_type(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            try:
                f = float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
            if not math.isfinite(f) or f != int(f):
                raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
            value = int(f)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            span = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
            raise argparse.ArgumentTypeError(f"{text} is outside {span}")
        return value

    parse.__name__ = "integer"
    return parse


def _float_type(lo: float | None = None, hi: float | None = None, *, positive: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
        if (positive and value <= 0) or (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{text} is out of range")
        return value

    parse.__name__ = "number"
    return parse


def _comma_list(choices: tuple[str, ...] | None = None, what: str = "name") -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if choices is not None and x not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad[0]!r} (choose from {', '.join(choices)})")
        return items

    parse.__name__ = "list"
    return parse


# ---- engine flags, from EngineConfig ----------------------------------------------------------
def _field_type(f: dataclasses.Field) -> type:
    """int, float, str, bool or dict from a field's annotation (``int | None`` is int)."""
    names = {"int": int, "float": float, "str": str, "bool": bool, "dict": dict}
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    for part in str(text).replace(" ", "").split("|"):
        if part in names:
            return names[part]
    args = [a for a in get_args(f.type) if a is not type(None)]
    return args[0] if args else str


def _default_text(f: dataclasses.Field) -> str:
    if f.default is None:
        return ""
    if isinstance(f.default, bool):
        return f" (default: {'on' if f.default else 'off'})"
    return f" (default: {f.default})"


def _engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field. Every default is None, so the config's own defaults apply and
    a preset can tell which flags were given."""
    groups = {"engine": p.add_argument_group("engine"),
              "sim": p.add_argument_group("sim backend (docs/SIM.md); --model then names a catalog shape, "
                                          "e.g. llama-3.3-70b-fp8")}
    for f in dataclasses.fields(EngineConfig):
        meta = f.metadata
        flag = "--" + f.name.replace("_", "-")
        kind = _field_type(f)
        kw: dict[str, Any] = {"default": None, "help": meta["help"] + _default_text(f)}
        choices = meta.get("choices")
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif kind is dict:
            kw["metavar"] = meta.get("metavar") or "FILE"
        elif choices and "module:Class" in choices:
            kw["metavar"] = "{" + ",".join(choices) + "}"
        elif choices:
            kw["choices"] = choices
        elif kind is int:
            kw["type"] = _int_type()
        elif kind is float:
            kw["type"] = _float_type()
        if meta.get("metavar") and "choices" not in kw and kind is not bool:
            kw["metavar"] = meta["metavar"]
        groups[meta.get("group", "engine")].add_argument(flag, **kw)


def _engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags given on the command line (a FILE flag already read)."""
    settings = {k: getattr(args, k) for k in CONFIG_FIELDS if getattr(args, k, None) is not None}
    if isinstance(settings.get("sim_efficiency"), str):
        from kvscope.engine.sim.backend import load_efficiency

        settings["sim_efficiency"] = load_efficiency(settings["sim_efficiency"])
    return settings


def _engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    config = EngineConfig(**{**_engine_settings(args), **overrides})
    config.validate()  # one line before anything is loaded or allocated
    return config


def _workload_args(p: argparse.ArgumentParser, default: str) -> None:
    from kvscope.workload import MAX_REQUESTS

    p.add_argument("--workload", default=default, help=f"preset name or JSON spec file (default: {default})")
    p.add_argument("--num-requests", type=_int_type(1, MAX_REQUESTS), default=None,
                   help="override the workload's request count")


# ---- checks made before a run ---------------------------------------------------------------
def _check_output_path(path: str | None) -> None:
    """A file we will write at the end of a run: fail now, not after the run."""
    if not path:
        return
    if os.path.isdir(path):
        raise UsageError(f"cannot write {path}: it is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"cannot write {path}: no directory {parent}")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"cannot write {path}: permission denied")


def _check_address(addr: str, *, bind: bool, allow_remote: bool = False) -> None:
    """The address's syntax (and, to bind, that it is loopback unless allowed) as one line."""
    from kvscope.protocol.transport import check_bind_address

    try:
        check_bind_address(addr, allow_remote or not bind)
    except ValueError as e:
        raise UsageError(str(e).splitlines()[0]) from None
    if addr.startswith("ipc://"):
        path = addr[len("ipc://"):]
        parent = os.path.dirname(os.path.abspath(path))
        if bind and not os.path.isdir(parent):
            raise UsageError(f"cannot bind {addr}: no directory {parent}")


def _zmq_errors() -> tuple[type[BaseException], ...]:
    zmq = sys.modules.get("zmq")
    return (zmq.ZMQError,) if zmq is not None else ()


def _open_socket(what: str, addr: str, make: Callable[[], Any]):
    try:
        return make()
    except _zmq_errors() as e:
        raise UsageError(f"cannot {what} {addr}: {e}") from None


def _write_json(path: str, data: dict) -> None:
    try:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror}") from None
    print(f"wrote {path}", file=sys.stderr)


# ---- serve -----------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    from kvscope.workload import load_spec

    load_spec(args.workload)  # fail on a bad workload before loading the model
    _check_output_path(args.json)
    _check_output_path(args.record)
    if args.events and args.control and args.events == args.control:
        raise UsageError(f"--events and --control must be different addresses (both {args.events})")
    for addr in (args.events, args.control):
        if addr:
            _check_address(addr, bind=True, allow_remote=args.allow_remote)
    front = _front_end_check(args)
    config = _engine_config(args)
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

        publisher = _open_socket("bind", args.events, lambda: ZmqPublisher(args.events, allow_remote=args.allow_remote))
    if args.control:
        from kvscope.protocol.transport import ControlServer
        from kvscope.workload import PRESETS

        try:
            control = _open_socket("bind", args.control, lambda: ControlServer(
                args.control, allow_remote=args.allow_remote, workloads=PRESETS))
        except BaseException:
            if publisher is not None:
                publisher.close()
            raise
    return publisher, control


def _serve(args, config: EngineConfig, publisher, control, front) -> int:
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.metrics import summary_table
    from kvscope.serve.driver import ServeOptions, Server

    engine = LLMEngine(config)
    print(f"kvscope: {engine.describe_kv_cache()}", file=sys.stderr)
    front = front(engine) if front else None
    sinks = ([front.sink] if front else []) + ([publisher] if publisher is not None else [])
    if args.record:
        from kvscope.traces.writer import TraceWriter

        sinks.append(TraceWriter(args.record, engine.hello(), snapshot_provider=engine.snapshot))
    if getattr(args, "kv_events_vllm", None):
        from kvscope.adapters.vllm_publisher import VllmKvPublisher

        if not engine.config.prefix_caching:
            print("kvscope: note: --kv-events-vllm without --prefix-caching publishes no blocks", file=sys.stderr)
        vllm_publisher = _open_socket("bind", args.kv_events_vllm, lambda: VllmKvPublisher(
            args.kv_events_vllm, args.kv_replay_vllm, block_size=engine.config.block_size,
            encoding=args.kv_events_vllm_encoding, allow_remote=args.allow_remote))
        engine.block_manager.cache_events = vllm_publisher
        sinks.append(vllm_publisher)
    if sinks:
        from kvscope.protocol.sinks import FanOut

        engine.attach(sinks[0] if len(sinks) == 1 else FanOut(sinks))
    # with the HTTP API the engine serves until stopped; synthetic traffic only with --forever
    http_only = front is not None and front.http_address is not None and not args.forever
    options = ServeOptions(workload=args.workload, num_requests=args.num_requests, seed=engine.config.seed,
                           forever=args.forever or http_only, burst_every_s=args.burst_every,
                           max_waiting=args.max_waiting)
    progress = _progress_bar(args, options, engine)
    reason = "drained"
    original_handlers = _stop_on_sigterm()
    server = Server(engine, options, control=control, on_progress=progress.update if progress else None,
                    inbox=front.bridge if front else None)
    try:
        if front is not None:
            front.start()
        summary = server.run(items=() if http_only else None)
    except KeyboardInterrupt:
        reason = "interrupted"
        summary = server.summary()
    finally:
        _ignore_stop_signals()  # a second SIGTERM or Ctrl-C must not cut the trace's index short
        if progress:
            progress.close()
        if front is not None:
            front.close()
        engine.close(reason)
        for sink in sinks:
            if sink is not publisher:  # cmd_serve closes the publisher, which it opened
                sink.close()
        _restore_signals(original_handlers)
    print(summary_table(summary))
    if args.json:
        _write_json(args.json, {"config": engine.hello().config.as_dict(), "summary": summary.to_dict()})
    return 0


def _front_end_check(args):
    """Check --http / --metrics-port before loading the model; returns engine -> FrontEnd, or None."""
    if not args.http and args.metrics_port is None:
        return None
    from kvscope.serve.frontend import FrontEnd, parse_host_port

    if args.http:
        parse_host_port(args.http, args.allow_remote)
    name = args.served_model_name or args.model
    return lambda engine: FrontEnd(engine, http=args.http, metrics_port=args.metrics_port, served_model_name=name,
                                   allow_remote=args.allow_remote, max_waiting=getattr(args, "max_waiting", None))


def _stop_on_sigterm() -> dict:
    """SIGTERM ends serve like Ctrl-C does: the summary prints and the trace gets its index.

    Returns the handlers it replaced, for _restore_signals.
    """
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    original = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, interrupt)
    return original


def _ignore_stop_signals() -> None:
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def _restore_signals(handlers: dict) -> None:
    import signal

    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def _progress_bar(args, options, engine):
    if args.no_progress:
        return None
    from tqdm import tqdm

    from kvscope.workload import load_spec

    total = None if options.forever else (options.num_requests or load_spec(options.workload).num_requests)
    return tqdm(total=total, desc=f"{engine.config.mode}", unit="req", file=sys.stderr, dynamic_ncols=True)


# ---- bench ------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    from kvscope.workload import load_spec

    _check_output_path(args.json)
    if args.host_overhead:
        from kvscope.bench.host_overhead import cmd_host_overhead

        return cmd_host_overhead(args, _write_json)
    if args.fit and args.anchors is None:
        raise UsageError("--fit goes with --anchors")
    if args.anchors is not None:  # always on the sim: the published runs' table (docs/SIM.md)
        return _bench_anchors(args)
    if not args.preset:
        load_spec(args.workload)
    from kvscope.bench.report import write_json

    if args.backend == "sim" or args.preset:
        from kvscope.bench import sim as sim_bench

        if args.preset:
            result = sim_bench.run_preset(args.preset, _explicit_sim_overrides(args))
        else:
            result = sim_bench.run_sim_bench(_engine_config(args), load_spec(args.workload),
                                             num_requests=args.num_requests, modes=list(args.modes))
        sim_bench.print_result(result)
    else:
        from kvscope.bench.modes import BenchOptions, print_table, run_bench

        options = BenchOptions(workload=args.workload, num_requests=args.num_requests, modes=args.modes,
                               peers=args.peers, events=args.events_overhead)
        result = run_bench(_engine_config(args), options)
        print_table(result)
    if args.json:
        write_json(args.json, result)
    return 0


def _bench_anchors(args: argparse.Namespace) -> int:
    """`kvscope bench --backend sim --anchors [FILE] [--fit] [--sim-efficiency F] [--json F]`."""
    from kvscope.bench.report import write_json

    path = args.anchors if isinstance(args.anchors, str) else None
    if args.fit:
        from kvscope.bench.anchor_fit import fit, print_fit

        result = fit(path, log=lambda msg: print(msg, file=sys.stderr))
        print_fit(result)
    else:
        from kvscope.bench.anchors import print_anchors, run_anchors

        eff = _explicit_sim_overrides(args).get("sim_efficiency")  # one set for every anchor
        result = run_anchors(path, eff, log=print)
        print_anchors(result)
    if args.json:
        write_json(args.json, result)
    return 0


def _explicit_sim_overrides(args: argparse.Namespace) -> dict:
    """Sim flags given on the command line on top of a preset (their argparse defaults are None)."""
    keys = ("gpu", "tp", "kv_cache_dtype", "sim_efficiency")
    overrides = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    if isinstance(overrides.get("sim_efficiency"), str):  # the flag names a file
        from kvscope.engine.sim.backend import load_efficiency

        overrides["sim_efficiency"] = load_efficiency(overrides["sim_efficiency"])
    return overrides


def cmd_bench_features(args: argparse.Namespace) -> int:
    from kvscope.bench.features import experiment, table
    from kvscope.bench.report import write_json

    _check_output_path(args.json)
    results = []
    for name in args.experiments:
        results.append(experiment(name, model=args.model, device=args.device, scale=args.scale, seed=args.seed))
        print(table(results[-1]) + "\n", flush=True)
    if args.json:
        write_json(args.json, {"results": results})
    return 0


# ---- watchers ---------------------------------------------------------------------------
def cmd_tui(args: argparse.Namespace) -> int:
    from kvscope.protocol.transport import DEFAULT_CONTROL_ADDR, DEFAULT_EVENTS_ADDR

    connects, controls = args.connect or [], args.control or []
    urls, kv_events, kv_replays = args.vllm or [], args.kv_events or [], args.kv_replay or []
    if args.interval <= 0:
        raise UsageError(f"--interval {args.interval}: must be above 0 seconds")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise UsageError(f"--vllm {url}: expected a URL such as http://127.0.0.1:8000")
    if len(kv_events) > max(1, len(urls)) or len(kv_replays) > len(kv_events) or len(controls) > max(1, len(connects)):
        raise UsageError("give --kv-events/--kv-replay once per --vllm, and --control once per --connect, in order")
    if len(connects) + len(urls) > 1:
        from kvscope.tui.overview_app import run_overview

        if len(connects) + len(urls) > 64:
            raise UsageError("the overview watches at most 64 engines")
        kvscope = [(a, controls[i] if i < len(controls) else None) for i, a in enumerate(connects)]
        vllm = [(u, kv_events[i] if i < len(kv_events) else None, kv_replays[i] if i < len(kv_replays) else None)
                for i, u in enumerate(urls)]
        run_overview(kvscope, vllm, interval=args.interval, palette=args.palette)
        return 0
    if urls or kv_events:
        from kvscope.tui.vllm_app import run_vllm

        run_vllm(urls[0] if urls else None, kv_events[0] if kv_events else None,
                 kv_replays[0] if kv_replays else None, interval=args.interval, palette=args.palette)
        return 0
    from kvscope.tui.launch import run_live

    connect = connects[0] if connects else DEFAULT_EVENTS_ADDR
    control = controls[0] if controls else DEFAULT_CONTROL_ADDR
    _check_address(connect, bind=False)
    if control:
        _check_address(control, bind=False)
    _open_socket("connect to", connect, lambda: run_live(connect, control, palette=args.palette))
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from kvscope.tui.launch import run_replay

    run_replay(args.file, palette=args.palette)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvscope.tui.demo import run_demo

    run_demo(palette=args.palette, device=args.device, sim_gpu=args.gpu if args.sim else None)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from kvscope.analysis.calibrate import calibrate, format_report

    _check_output_path(args.json)
    result = calibrate(args.file, gpu=args.gpu, model=args.sim_model, fit_per_seq=not args.no_per_seq,
                       validate_paths=args.validate)
    print(format_report(result))
    if args.json:
        _write_json(args.json, result)
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    from kvscope.analysis.cli import run_diagnose

    return run_diagnose(args, _engine_config, UsageError)


def cmd_trace_info(args: argparse.Namespace) -> int:
    from kvscope.traces.info import trace_info

    print(trace_info(args.file, verify=not args.fast))
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    from kvscope.protocol.transport import DEFAULT_CONTROL_ADDR, DEFAULT_EVENTS_ADDR
    from kvscope.traces.record import record

    _check_output_path(args.file)
    if args.vllm or args.kv_events:
        return _record_vllm(args)
    if args.kv_replay:
        raise UsageError("--kv-replay goes with --kv-events (recording a vLLM)")
    args.connect = args.connect or DEFAULT_EVENTS_ADDR
    args.control = DEFAULT_CONTROL_ADDR if args.control is None else args.control
    _check_address(args.connect, bind=False)
    if args.control:
        _check_address(args.control, bind=False)
    _open_socket("connect to", args.connect,
                 lambda: record(args.connect, args.file, stop_after_s=args.duration, control_addr=args.control))
    return 0


def _record_vllm(args: argparse.Namespace) -> int:
    from kvscope.adapters.vllm_record import record_vllm

    if args.connect or args.control:
        raise UsageError("record either a kvscope engine (--connect/--control) or a vLLM (--vllm/--kv-events)")
    if args.vllm and not args.vllm.startswith(("http://", "https://")):
        raise UsageError(f"--vllm {args.vllm}: expected a URL such as http://127.0.0.1:8000")
    if args.kv_replay and not args.kv_events:
        raise UsageError("--kv-replay goes with --kv-events")
    for flag, addr in (("--kv-events", args.kv_events), ("--kv-replay", args.kv_replay)):
        if addr and not addr.startswith(("tcp://", "ipc://")):
            raise UsageError(f"{flag} {addr}: expected tcp://HOST:PORT or ipc://PATH")
    rec = record_vllm(args.file, args.vllm, args.kv_events, args.kv_replay, interval=args.interval,
                      duration=args.duration)
    if rec.writer is None:
        print(f"kvscope record: nothing arrived from {args.vllm or args.kv_events}; no trace written",
              file=sys.stderr)
        return 1
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from kvscope.serve.export import export_trace

    if not (args.perfetto or args.requests or args.steps):
        raise UsageError("export needs at least one of --perfetto OUT.json, --requests OUT.csv, --steps OUT.csv")
    stats = export_trace(args.file, perfetto=args.perfetto, requests_csv=args.requests, steps_csv=args.steps)
    print(f"exported {stats.steps} steps, {stats.requests} requests ({stats.slices} slices on "
          f"{stats.lanes} request lanes)", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvscope.protocol.transport import DEFAULT_CONTROL_ADDR, DEFAULT_EVENTS_ADDR
    from kvscope.serve.options import DEFAULT_MAX_WAITING

    parser = Parser(prog="kvscope", description="A small, real LLM inference engine whose scheduler you can watch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    palettes = ("default", "cb")

    p = sub.add_parser("serve", help="run the engine over a workload")
    _engine_args(p)
    _workload_args(p, "mixed")
    p.add_argument("--forever", action="store_true", help="keep generating requests until stopped")
    p.add_argument("--burst-every", type=_float_type(positive=True), default=None, metavar="S",
                   help="with --forever: a burst every S s")
    p.add_argument("--max-waiting", type=_int_type(1, 1 << 20), default=DEFAULT_MAX_WAITING, metavar="N",
                   help="refuse new requests while N are waiting; a control burst past it is answered "
                        f"'refused' (default: {DEFAULT_MAX_WAITING})")
    p.add_argument("--events", metavar="ADDR", help=f"publish events (e.g. {DEFAULT_EVENTS_ADDR})")
    p.add_argument("--control", metavar="ADDR", help=f"accept control requests (e.g. {DEFAULT_CONTROL_ADDR})")
    p.add_argument("--allow-remote", action="store_true", help="allow binding to non-loopback addresses")
    p.add_argument("--record", metavar="FILE", help="record a .kvtrace file")
    p.add_argument("--kv-events-vllm", metavar="ADDR", help="publish prefix-cache events in vLLM's KV-event format "
                   "(e.g. tcp://127.0.0.1:5560)")
    p.add_argument("--kv-replay-vllm", metavar="ADDR", help="with --kv-events-vllm: a vLLM-style replay ROUTER")
    p.add_argument("--kv-events-vllm-encoding", default="map", choices=["map", "array"],
                   help="map: vLLM 0.26 and later; array: older releases (default: map)")
    p.add_argument("--json", metavar="FILE", help="write the summary as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    h = p.add_argument_group("HTTP API (docs/HTTP.md) and Prometheus metrics (docs/METRICS.md)")
    h.add_argument("--http", metavar="HOST:PORT", help="serve the OpenAI API, e.g. 127.0.0.1:8000 (synthetic "
                   "traffic then runs only with --forever)")
    h.add_argument("--served-model-name", metavar="NAME", help="the model name clients ask for (default: --model)")
    h.add_argument("--metrics-port", type=_int_type(1, 65535), metavar="N", help="also serve /metrics alone on port N")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="compare the four modes and transformers on one workload")
    _engine_args(p)
    _workload_args(p, "mixed")
    p.add_argument("--modes", type=_comma_list(MODES, "mode"), default=list(MODES),
                   help=f"comma list of {', '.join(MODES)} (default: all)")
    p.add_argument("--peers", type=_comma_list(), default=["hf-static", "hf-generate-batch"],
                   help="comma list of hf-static, hf-generate-batch; empty for none (default: both)")
    p.add_argument("--events-overhead", action="store_true", help="also measure events + recording on vs off")
    p.add_argument("--host-overhead", action="store_true",
                   help="host time per step at 64, 256 and 1,024 running, with no compute")
    p.add_argument("--preset", metavar="NAME", help="sim bench preset: lesson or fragmentation, or a .json file")
    p.add_argument("--anchors", nargs="?", const=True, default=None, metavar="FILE",
                   help="sim vs published runs of real engines (default bench/anchors.json)")
    p.add_argument("--fit", action="store_true", help="with --anchors: refit the sim's default efficiencies")
    p.add_argument("--json", metavar="FILE", help="write results as JSON")
    p.set_defaults(func=cmd_bench)

    from kvscope.bench import FEATURE_EXPERIMENTS as EXPERIMENTS

    p = sub.add_parser("bench-features", help="prefix caching on/off, priority vs fcfs, swap vs recompute")
    p.add_argument("--experiments", type=_comma_list(EXPERIMENTS, "experiment"), default=list(EXPERIMENTS),
                   help=f"comma list of {', '.join(EXPERIMENTS)} (default: all)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--scale", type=_float_type(positive=True, hi=1000.0), default=1.0,
                   help="multiply request counts (default: 1)")
    p.add_argument("--seed", type=_int_type(0), default=0)
    p.add_argument("--json", metavar="FILE", help="write results as JSON")
    p.set_defaults(func=cmd_bench_features)

    p = sub.add_parser("tui", help="watch a live engine")
    p.add_argument("--connect", action="append", metavar="ADDR",
                   help=f"an engine's events (default {DEFAULT_EVENTS_ADDR}); repeat for an overview")
    p.add_argument("--control", action="append", metavar="ADDR",
                   help=f"its control socket (default {DEFAULT_CONTROL_ADDR}); once per --connect")
    p.add_argument("--vllm", action="append", metavar="URL",
                   help="a vLLM server: poll URL/metrics (docs/VLLM.md); repeat for an overview")
    p.add_argument("--kv-events", action="append", metavar="ADDR",
                   help="vLLM's KV-event PUB socket, e.g. tcp://127.0.0.1:5557; once per --vllm")
    p.add_argument("--kv-replay", action="append", metavar="ADDR",
                   help="vLLM's KV-event replay ROUTER socket; once per --kv-events")
    p.add_argument("--interval", type=_float_type(positive=True), default=1.0, metavar="S",
                   help="--vllm: seconds between scrapes")
    p.add_argument("--palette", default="default", choices=palettes, help="cb: colour-blind safe")
    p.set_defaults(func=cmd_tui)

    p = sub.add_parser("demo", help="engine + dashboard")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    p.add_argument("--sim", action="store_true", help="no model: a simulated GPU serving Llama 3.3 70B FP8, in real time")
    p.add_argument("--gpu", default="h100-sxm5", choices=SIM_GPUS, help="with --sim: the GPU to simulate")
    p.add_argument("--palette", default="default", choices=palettes, help="cb: colour-blind safe")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("replay", help="replay a recorded .kvtrace file")
    p.add_argument("file")
    p.add_argument("--palette", default="default", choices=palettes)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("record", help="record a live engine's events, or a watched vLLM, into a .kvtrace file")
    p.add_argument("file")
    p.add_argument("--connect", default=None, metavar="ADDR", help=f"a kvscope engine's events "
                   f"(default {DEFAULT_EVENTS_ADDR})")
    p.add_argument("--control", default=None, metavar="ADDR", help=f"its control socket (default "
                   f"{DEFAULT_CONTROL_ADDR}); an empty string for none")
    p.add_argument("--vllm", metavar="URL", help="record a vLLM instead: poll URL/metrics (docs/VLLM.md)")
    p.add_argument("--kv-events", metavar="ADDR", help="vLLM's KV-event PUB socket")
    p.add_argument("--kv-replay", metavar="ADDR", help="vLLM's KV-event replay ROUTER socket")
    p.add_argument("--interval", type=_float_type(positive=True), default=1.0, metavar="S",
                   help="--vllm: seconds between scrapes")
    p.add_argument("--duration", type=_float_type(positive=True), default=None, metavar="S",
                   help="stop after S seconds")
    p.set_defaults(func=cmd_record)

    p = sub.add_parser("calibrate", help="fit the sim's efficiencies and overhead to a recorded trace")
    p.add_argument("file")
    p.add_argument("--gpu", default=None, help="the GPU the trace ran on (default: from the trace; cpu for CPU)")
    p.add_argument("--sim-model", default=None, help="catalog shape of the trace's model (default: from the trace)")
    p.add_argument("--no-per-seq", action="store_true", help="fit only efficiencies and the per-step overhead")
    p.add_argument("--validate", metavar="TRACE", action="append", default=[],
                   help="also replay another trace of the same setup with the fitted parameters (repeatable)")
    p.add_argument("--json", metavar="FILE", help="write the fit (usable as --sim-efficiency FILE)")
    p.set_defaults(func=cmd_calibrate)

    from kvscope import cli_compare

    cli_compare.add_parsers(sub, _engine_args, _workload_args)

    p = sub.add_parser("diagnose", help="name the bottleneck of a trace (or of a sim config) and the knobs to turn")
    p.add_argument("file", nargs="?", help="a .kvtrace file (omit it with --backend sim to diagnose a config)")
    p.add_argument("--json", metavar="FILE", help="also write the diagnosis as JSON")
    p.add_argument("--window", type=_int_type(1), default=None, metavar="N", help="judge only the last N steps")
    p.add_argument("--no-what-if", action="store_true", help="skip re-running the requests in the sim")
    _engine_args(p)
    _workload_args(p, "mixed")
    p.set_defaults(func=cmd_diagnose)

    p = sub.add_parser("export", help="a .kvtrace as Perfetto/chrome://tracing JSON and CSV tables (docs/EXPORT.md)")
    p.add_argument("file")
    p.add_argument("--perfetto", metavar="OUT.json", help="Chrome trace event JSON for Perfetto or chrome://tracing")
    p.add_argument("--requests", metavar="OUT.csv", help="one row per request")
    p.add_argument("--steps", metavar="OUT.csv", help="one row per scheduler step")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("trace-info", help="describe a .kvtrace file and check every chunk")
    p.add_argument("file")
    p.add_argument("--fast", action="store_true", help="trust the index: read no chunk (no checksum check)")
    p.set_defaults(func=cmd_trace_info)
    return parser


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename and e.strerror:
        return f"{e.strerror}: {e.filename}"
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return first if len(first) <= 400 else first[:397] + "..."


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, its line already printed)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    from kvscope.protocol.codec import ProtocolError

    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        # zmq is imported lazily, by the commands that need it: look its error up now
        if not isinstance(e, (KvscopeError, ProtocolError, OSError, OverflowError, *_zmq_errors())):
            raise  # a bug: it keeps its traceback
        print(f"kvscope: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
