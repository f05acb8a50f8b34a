"""The side-by-side commands of `kvscope`: compare, race and web (registered by kvscope.cli).

- ``compare A B [C D]``: two to four traces on one screen, one clock;
- ``race``: the same requests through several modes or policies, recorded, then compared;
- ``web``: any of the TUI commands served to a browser through textual-serve.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

WEB_COMMANDS = ("tui", "replay", "compare", "race", "demo")


def add_parsers(sub, engine_args, workload_args) -> None:
    from kvscope.tui.sync import ALIGNS

    p = sub.add_parser("compare", help="play 2-4 traces side by side on one clock")
    p.add_argument("files", nargs="+", metavar="TRACE", help="two to four .kvtrace files")
    p.add_argument("--align", default="time", choices=ALIGNS,
                   help="time: engine time since each run's first arrival; step: by step number (default: time)")
    p.add_argument("--speed", type=float, default=1.0, help="playback speed, 0.1-100 (default: 1)")
    p.add_argument("--paused", action="store_true", help="start paused")
    p.add_argument("--palette", default="default", choices=["default", "cb"], help="cb: colour-blind safe")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("race", help="the same requests through several modes/policies, then compare them")
    engine_args(p)
    workload_args(p, "mixed")
    p.add_argument("--preset", metavar="NAME", help="a sim bench preset, e.g. lesson (kvscope/bench/presets/)")
    p.add_argument("--modes", default=None, help="comma list (default: naive,static,continuous,chunked, "
                                                  "or the preset's)")
    p.add_argument("--policies", default=None, help="comma list of policies to race (default: --policy)")
    p.add_argument("--out", default="kvscope-race", metavar="DIR", help="where the traces go (default: "
                                                                         "./kvscope-race)")
    p.add_argument("--no-tui", action="store_true", help="print the table (and --json) instead of opening compare")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON (bench's shape)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--align", default="time", choices=ALIGNS, help="compare alignment (default: time)")
    p.add_argument("--speed", type=float, default=1.0, help="compare playback speed (default: 1)")
    p.add_argument("--palette", default="default", choices=["default", "cb"])
    p.set_defaults(func=cmd_race)

    p = sub.add_parser("web", help="serve a TUI command to a browser (textual-serve)",
                       description="Serve `kvscope COMMAND ...` in a browser: e.g. kvscope web replay t.kvtrace")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --host")
    p.add_argument("app", choices=WEB_COMMANDS, help="the kvscope command to serve")
    p.add_argument("app_args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(func=cmd_web)


def _usage(message: str):
    from kvscope.cli import UsageError

    return UsageError(message)


# ---- compare -------------------------------------------------------------------------------
def cmd_compare(args: argparse.Namespace) -> int:
    from kvscope.tui.compare_app import CompareError, make_compare_app
    from kvscope.tui.runs import MAX_RUNS

    if not 2 <= len(args.files) <= MAX_RUNS:
        raise _usage(f"compare takes 2 to {MAX_RUNS} traces, got {len(args.files)}")
    try:
        app = make_compare_app(args.files, align=args.align, speed=args.speed, playing=not args.paused,
                               palette=args.palette)
    except CompareError as e:
        raise _usage(str(e)) from None
    for run in app.runs:
        if run.error:
            print(f"kvscope compare: {run.path}: {run.error} (its column says so)", file=sys.stderr)
    app.run()
    return 0


# ---- race ----------------------------------------------------------------------------------
def _race_inputs(args, engine_config):
    """(base config, requests, device, workload name, default modes, sim?) as bench would pick them."""
    from kvscope import workload as wl
    from kvscope.bench.preset import load_preset
    from kvscope.bench.sim import sim_workload
    from kvscope.cli import _explicit_sim_overrides as preset_overrides
    from kvscope.engine.config import EngineConfig

    if args.preset:
        preset = load_preset(args.preset)
        if preset.kind != "modes":
            raise _usage(f"preset {args.preset!r} has no engine and workload to race (try lesson)")
        config = EngineConfig(**{**preset.data.engine, **preset_overrides(args)})
        spec = wl.parse_spec(preset.data.workload)
        items = sim_workload(config, spec, None, None)
        return config, items, _device(config), spec.name, preset.data.modes, config.backend == "sim"
    config = engine_config(args)
    if config.backend == "sim":
        spec = wl.load_spec(args.workload)
        items = sim_workload(config, spec, args.num_requests, None)
        return config, items, _device(config), spec.name, None, True
    from kvscope.bench.modes import BenchOptions, bench_items

    wl.load_spec(args.workload)
    items, device = bench_items(config, BenchOptions(workload=args.workload, num_requests=args.num_requests))
    return config, items, device, args.workload, None, False


def _device(config) -> str:
    from kvscope.engine.llm_engine import LLMEngine

    return str(LLMEngine(config).hello().config.device)


def cmd_race(args: argparse.Namespace) -> int:
    from kvscope.bench.modes import print_table
    from kvscope.bench.race import RaceError, plan, race_result, run_race
    from kvscope.cli import _check_output_path, _engine_config, _write_json

    _check_output_path(args.json)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise _usage(f"--out {args.out}: not a directory")
    config, items, device, workload, preset_modes, sim = _race_inputs(args, _engine_config)
    modes = args.modes.split(",") if args.modes else (preset_modes or ["naive", "static", "continuous", "chunked"])
    policies = args.policies.split(",") if args.policies else []
    try:
        runs = plan(config, [m for m in modes if m], [p for p in policies if p])
    except RaceError as e:
        raise _usage(str(e)) from None
    where = "sim backend" if sim else f"{device}, one run after another"
    print(f"kvscope race: {len(runs)} runs of {len(items)} requests ({where})", file=sys.stderr)
    rows = run_race(runs, items, args.out, sim=sim, progress=not args.no_progress)
    result = race_result(runs, rows, items, device, sim=sim, workload=workload)
    if args.json:
        _write_json(args.json, result)
    if args.no_tui:
        print_table(result)
        return 0
    from kvscope.tui.compare_app import make_compare_app

    note = ("sim runs: virtual clocks, replayed together" if sim else
            "runs took turns on this machine (never at once, so each had the cores to itself); replayed in sync")
    app = make_compare_app(result["traces"], align=args.align, speed=args.speed, palette=args.palette,
                           notes=[note])
    app.run()
    return 0


# ---- web -----------------------------------------------------------------------------------
def cmd_web(args: argparse.Namespace) -> int:
    from kvscope.protocol.transport import check_bind_address

    if not 0 < args.port < 65536:
        raise _usage(f"--port {args.port}: not a port number")
    try:
        check_bind_address(f"tcp://{args.host}:{args.port}", args.allow_remote)
    except ValueError as e:
        raise _usage(str(e)) from None
    app_args = [a for a in args.app_args if a != "--"]
    command = shlex.join([sys.executable, "-m", "kvscope", args.app, *app_args])
    from textual_serve.server import Server

    server = Server(command, host=args.host, port=args.port, title=f"kvscope {args.app}")
    print(f"kvscope web: serving `kvscope {shlex.join([args.app, *app_args])}` at http://{args.host}:{args.port}/ "
          f"(ctrl+c stops)", file=sys.stderr)
    server.serve()
    return 0
