"""`kvscope tui`: watch a live engine, a vLLM, or several of either (the overview)."""

from __future__ import annotations

import argparse

from kvscope.cli.command import Command
from kvscope.cli.common import (UsageError, add_palette, add_slo_args, check_address, check_url, float_type, int_type,
                                open_socket)

MAX_WATCHED = 64


class Tui(Command):
    name = "tui"
    help = "watch a live engine"
    description = ("Watch a live engine (kvscope serve publishes on tcp://127.0.0.1:5557 by default), a vLLM "
                   "server, or several of either in one overview.")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from kvscope.protocol.transport import DEFAULT_CONTROL_ADDR, DEFAULT_EVENTS_ADDR

        p.add_argument("--connect", action="append", metavar="ADDR",
                       help=f"an engine's events (default {DEFAULT_EVENTS_ADDR}); repeat for an overview")
        p.add_argument("--control", action="append", metavar="ADDR",
                       help=f"its control socket (default {DEFAULT_CONTROL_ADDR}); once per --connect")
        p.add_argument("--vllm", action="append", metavar="URL",
                       help="a vLLM server: poll URL/metrics (docs/VLLM.md); repeat for an overview")
        p.add_argument("--kv-events", action="append", metavar="ADDR",
                       help="vLLM's KV-event PUB socket, e.g. tcp://127.0.0.1:5557 (bind:ADDR where vLLM connects "
                            "to ADDR; with --vllm found by itself); once per --vllm")
        p.add_argument("--kv-replay", action="append", metavar="ADDR",
                       help="vLLM's KV-event replay ROUTER socket; once per --kv-events")
        p.add_argument("--interval", type=float_type(positive=True), default=1.0, metavar="S",
                       help="--vllm: seconds between scrapes")
        p.add_argument("--replicas", type=int_type(1, MAX_WATCHED), default=None, metavar="N",
                       help="N data-parallel ranks side by side, each its events on the --connect port + rank (as "
                            "vLLM's ranks publish) and its control on port + N + rank (`kvscope serve --engine vllm "
                            "-- --data-parallel-size N` says so)")
        add_slo_args(p, cost=False, recorded=True)
        add_palette(p)

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.protocol.transport import DEFAULT_CONTROL_ADDR, DEFAULT_EVENTS_ADDR

        connects, controls = args.connect or [], args.control or []
        urls, kv_events, kv_replays = args.vllm or [], args.kv_events or [], args.kv_replay or []
        for url in urls:
            check_url("--vllm", url)
        if args.replicas is not None:
            return _replicas(args, connects, controls, urls)
        if (len(kv_events) > max(1, len(urls)) or len(kv_replays) > len(kv_events)
                or len(controls) > max(1, len(connects))):
            raise UsageError("give --kv-events/--kv-replay once per --vllm, and --control once per --connect, "
                             "in order")
        if len(connects) + len(urls) > 1:
            from kvscope.tui.launch.overview import run_overview

            if len(connects) + len(urls) > MAX_WATCHED:
                raise UsageError(f"the overview watches at most {MAX_WATCHED} engines")
            kvscope = [(a, controls[i] if i < len(controls) else None) for i, a in enumerate(connects)]
            vllm = [(u, kv_events[i] if i < len(kv_events) else None, kv_replays[i] if i < len(kv_replays) else None)
                    for i, u in enumerate(urls)]
            run_overview(kvscope, vllm, interval=args.interval, palette=args.palette)
            return 0
        if urls or kv_events:
            from kvscope.tui.launch.vllm import run_vllm

            run_vllm(urls[0] if urls else None, kv_events[0] if kv_events else None,
                     kv_replays[0] if kv_replays else None, interval=args.interval, palette=args.palette)
            return 0
        from kvscope.tui.launch import run_live

        connect = connects[0] if connects else DEFAULT_EVENTS_ADDR
        control = controls[0] if controls else DEFAULT_CONTROL_ADDR
        check_address(connect, bind=False)
        if control:
            check_address(control, bind=False)
        from kvscope.cli.common import slo_from_args

        slo = slo_from_args(args) or None
        open_socket("connect to", connect, lambda: run_live(connect, control, palette=args.palette, slo=slo))
        return 0


def _replicas(args: argparse.Namespace, connects: list[str], controls: list[str], urls: list[str]) -> int:
    """`--replicas N`: the ranks of one data-parallel deployment, on the ports after the base address."""
    from kvscope.vllm.launch.ports import offset_port
    from kvscope.protocol.transport import DEFAULT_EVENTS_ADDR
    from kvscope.tui.launch import run_replicas

    if len(connects) > 1 or urls or controls:
        raise UsageError("--replicas N takes one --connect (rank 0's events; default "
                         f"{DEFAULT_EVENTS_ADDR}) and finds the other ranks and the control sockets from it")
    base = connects[0] if connects else DEFAULT_EVENTS_ADDR
    check_address(base, bind=False)
    n = args.replicas
    try:
        ranks = [(offset_port(base, r), offset_port(base, n + r)) for r in range(n)]
    except Exception as e:  # noqa: BLE001 - the one-line error of a base without a port
        raise UsageError(f"--replicas: {e}") from None
    from kvscope.cli.common import slo_from_args

    open_socket("connect to", base, lambda: run_replicas(ranks, palette=args.palette, slo=slo_from_args(args) or None))
    return 0
