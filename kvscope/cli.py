"""The `kvscope` command: serve, bench, tui, replay, demo, record, trace-info.

Heavy imports happen inside each command, so `kvscope replay` never loads torch.
User mistakes end in one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

EXIT_USAGE = 2


class UsageError(Exception):
    """A one-line problem with what the user asked for."""


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="tiny", help="tiny, qwen3-0.6b-shape, or a local checkpoint directory")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    g.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    g.add_argument("--mode", default="chunked", help="naive, static, continuous or chunked (default: chunked)")
    g.add_argument("--policy", default="fcfs",
                   help="fcfs, sjf, priority, or module:Class for your own (docs/POLICIES.md; default: fcfs)")
    g.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                   help="share KV blocks of common prompt prefixes (default: off)")
    g.add_argument("--preemption", default="recompute", choices=["recompute", "swap"],
                   help="what a preempted request loses: recompute its KV, or swap it to CPU (default: recompute)")
    g.add_argument("--swap-space", type=float, default=4.0, metavar="GIB",
                   help="CPU memory for swapped-out KV, in GiB (default: 4)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: sized from memory)")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--cpu-threads", type=int, default=None, help="torch threads on CPU (default: half the cores)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of GPU memory for weights, activations and KV (default: 0.9)")
    g.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode steps")
    s = p.add_argument_group("sim backend (docs/SIM.md); --model then names a catalog shape, e.g. llama-3.3-70b-fp8")
    s.add_argument("--backend", default="model", choices=["model", "sim"],
                   help="model: run the network; sim: a cost model of --gpu on a virtual clock (default: model)")
    s.add_argument("--gpu", default=None, help="sim: h100-sxm5, h200, a100-80gb, l4 or cpu (default: h100-sxm5)")
    s.add_argument("--tp", type=int, default=None, help="sim: tensor-parallel degree (default: 1)")
    s.add_argument("--kv-cache-dtype", default=None, help="sim: auto, bf16, fp16, fp8 or fp32 (default: auto)")
    s.add_argument("--sim-efficiency", metavar="FILE", default=None,
                   help="sim: efficiencies and overhead from `kvscope calibrate --json FILE`")
    s.add_argument("--sim-pace", type=float, default=None, metavar="X",
                   help="sim: hold virtual time to X x wall time (1: real time, for a live dashboard)")


def _engine_config(args: argparse.Namespace, **overrides):
    from kvscope.engine.config import EngineConfig

    settings = dict(model=args.model, device=args.device, dtype=args.dtype, mode=args.mode, policy=args.policy,
                    block_size=args.block_size, num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                    seed=args.seed, cpu_threads=args.cpu_threads)
    settings.update(prefix_caching=args.prefix_caching, preemption=args.preemption, swap_space=args.swap_space)
    settings.update(gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager)
    settings.update(_sim_settings(args))
    settings.update(overrides)
    return EngineConfig(**settings)


def _sim_settings(args: argparse.Namespace) -> dict:
    settings = {"backend": getattr(args, "backend", "model")}
    for key in ("gpu", "tp", "kv_cache_dtype", "sim_pace"):
        if getattr(args, key, None) is not None:
            settings[key] = getattr(args, key)
    if getattr(args, "sim_efficiency", None):
        from kvscope.engine.sim.backend import load_efficiency

        settings["sim_efficiency"] = load_efficiency(args.sim_efficiency)
    return settings


def _workload_args(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--workload", default=default, help=f"preset name or JSON spec file (default: {default})")
    p.add_argument("--num-requests", type=int, default=None, help="override the workload's request count")


# ---- serve -----------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.metrics import summary_table
    from kvscope.serve.driver import ServeOptions, Server
    from kvscope.workload import load_spec

    load_spec(args.workload)  # fail on a bad workload before loading the model
    front = _front_end_check(args)
    engine = LLMEngine(_engine_config(args))
    front = front(engine) if front else None
    sinks, control = _open_outputs(args, engine, extra_sinks=[front.sink] if front else [])
    # with the HTTP API the engine serves until stopped; synthetic traffic only with --forever
    http_only = front is not None and front.http_address is not None and not args.forever
    options = ServeOptions(workload=args.workload, num_requests=args.num_requests, seed=args.seed,
                           forever=args.forever or http_only, burst_every_s=args.burst_every)
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
            sink.close()
        if control is not None:
            control.close()
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


def _open_outputs(args, engine, extra_sinks=()):
    """Event publisher, trace recorder and control socket, as asked for on the command line."""
    sinks = list(extra_sinks)
    control = None
    if args.events:
        from kvscope.protocol.transport import ZmqPublisher

        sinks.append(ZmqPublisher(args.events, allow_remote=args.allow_remote))
    if args.record:
        from kvscope.traces.writer import TraceWriter

        sinks.append(TraceWriter(args.record, engine.hello(), snapshot_provider=engine.snapshot))
    if getattr(args, "kv_events_vllm", None):
        from kvscope.adapters.vllm_publisher import VllmKvPublisher

        if not engine.config.prefix_caching:
            print("kvscope: note: --kv-events-vllm without --prefix-caching publishes no blocks", file=sys.stderr)
        publisher = VllmKvPublisher(args.kv_events_vllm, args.kv_replay_vllm, block_size=engine.config.block_size,
                                    encoding=args.kv_events_vllm_encoding, allow_remote=args.allow_remote)
        engine.block_manager.cache_events = publisher
        sinks.append(publisher)
    if args.control:
        from kvscope.workload import PRESETS
        from kvscope.protocol.transport import ControlServer

        control = ControlServer(args.control, allow_remote=args.allow_remote, workloads=PRESETS)
    if sinks:
        from kvscope.protocol.sinks import FanOut

        engine.attach(sinks[0] if len(sinks) == 1 else FanOut(sinks))
    return sinks, control


def _progress_bar(args, options, engine):
    if args.no_progress:
        return None
    from tqdm import tqdm

    from kvscope.workload import load_spec

    total = None if options.forever else (options.num_requests or load_spec(options.workload).num_requests)
    return tqdm(total=total, desc=f"{engine.config.mode}", unit="req", file=sys.stderr, dynamic_ncols=True)


def _write_json(path: str, data: dict) -> None:
    try:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror}") from None
    print(f"wrote {path}", file=sys.stderr)


# ---- bench ------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    from kvscope.bench.modes import BenchOptions, print_table, run_bench

    if args.host_overhead:
        from kvscope.bench.host_overhead import cmd_host_overhead

        return cmd_host_overhead(args, _write_json)
    if args.fit and args.anchors is None:
        raise UsageError("--fit goes with --anchors")
    if args.anchors is not None:  # always on the sim: the published runs' table (docs/SIM.md)
        from kvscope.bench.anchors import cmd_bench_anchors

        return cmd_bench_anchors(args, _write_json)
    if args.backend == "sim" or args.preset:
        from kvscope.bench.sim import cmd_bench_sim

        return cmd_bench_sim(args, None if args.preset else _engine_config(args), _write_json)

    options = BenchOptions(
        workload=args.workload, num_requests=args.num_requests, modes=args.modes.split(","),
        peers=[p for p in args.peers.split(",") if p], events=args.events_overhead,
    )
    result = run_bench(_engine_config(args), options)
    print_table(result)
    if args.json:
        _write_json(args.json, result)
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

    run_live(connects[0] if connects else DEFAULT_EVENTS_ADDR, controls[0] if controls else DEFAULT_CONTROL_ADDR,
             palette=args.palette)
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from kvscope.tui.launch import run_replay

    run_replay(args.file, palette=args.palette)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvscope.tui.launch import run_demo

    run_demo(palette=args.palette, device=args.device, sim_gpu=args.gpu if args.sim else None)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from kvscope.analysis.calibrate import calibrate, format_report

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

    print(trace_info(args.file))
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    from kvscope.traces.record import record

    record(args.connect, args.file, stop_after_s=args.duration, control_addr=args.control)
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

    parser = argparse.ArgumentParser(prog="kvscope", description="A small, real LLM inference engine whose "
                                     "scheduler you can watch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="run the engine over a workload")
    _engine_args(p)
    _workload_args(p, "mixed")
    p.add_argument("--forever", action="store_true", help="keep generating requests until stopped")
    p.add_argument("--burst-every", type=float, default=None, metavar="S", help="with --forever: a burst every S s")
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
    h.add_argument("--metrics-port", type=int, metavar="N", help="also serve /metrics alone on port N")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="compare the four modes and transformers on one workload")
    _engine_args(p)
    _workload_args(p, "mixed")
    p.add_argument("--modes", default="naive,static,continuous,chunked")
    p.add_argument("--peers", default="hf-static,hf-generate-batch", help="comma list; empty for none")
    p.add_argument("--events-overhead", action="store_true", help="also measure events + recording on vs off")
    p.add_argument("--host-overhead", action="store_true",
                   help="host time per step at 64, 256 and 1,024 running, with no compute")
    p.add_argument("--preset", metavar="NAME", help="sim bench preset: lesson or fragmentation (bench/presets/)")
    p.add_argument("--anchors", nargs="?", const=True, default=None, metavar="FILE",
                   help="sim vs published runs of real engines (default bench/anchors.json)")
    p.add_argument("--fit", action="store_true", help="with --anchors: refit the sim's default efficiencies")
    p.add_argument("--json", metavar="FILE", help="write results as JSON")
    p.set_defaults(func=cmd_bench)

    for name, func, helptext in (("tui", cmd_tui, "watch a live engine"), ("demo", cmd_demo, "engine + dashboard")):
        p = sub.add_parser(name, help=helptext)
        if name == "tui":
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
            p.add_argument("--interval", type=float, default=1.0, metavar="S", help="--vllm: seconds between scrapes")
        else:
            p.add_argument("--device", default="auto")
            p.add_argument("--sim", action="store_true",
                           help="no model: a simulated GPU serving Llama 3.3 70B FP8, in real time")
            p.add_argument("--gpu", default="h100-sxm5", help="with --sim: the GPU to simulate")
        p.add_argument("--palette", default="default", choices=["default", "cb"], help="cb: colour-blind safe")
        p.set_defaults(func=func)

    from kvscope.bench import features as bench_features

    bench_features.add_parser(sub)

    p = sub.add_parser("replay", help="replay a recorded .kvtrace file")
    p.add_argument("file")
    p.add_argument("--palette", default="default", choices=["default", "cb"])
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("record", help="record a live engine's events into a .kvtrace file")
    p.add_argument("file")
    p.add_argument("--connect", default=DEFAULT_EVENTS_ADDR, metavar="ADDR")
    p.add_argument("--control", default=DEFAULT_CONTROL_ADDR, metavar="ADDR")
    p.add_argument("--duration", type=float, default=None, metavar="S", help="stop after S seconds")
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
    p.add_argument("--window", type=int, default=None, metavar="N", help="judge only the last N steps")
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

    p = sub.add_parser("trace-info", help="describe a .kvtrace file")
    p.add_argument("file")
    p.set_defaults(func=cmd_trace_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kvscope.protocol.codec import ProtocolError

    user_errors: tuple[type[BaseException], ...] = (UsageError, ProtocolError, ValueError, FileNotFoundError,
                                                     IsADirectoryError, PermissionError)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except user_errors as e:
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        if isinstance(e, OSError) and e.filename:
            message = f"{e.strerror}: {e.filename}"
        print(f"kvscope: error: {message}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
