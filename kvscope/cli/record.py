"""`kvscope record`: a live kvscope engine's events, or a watched vLLM, into a .kvtrace file."""

from __future__ import annotations

import argparse
import sys

from kvscope.cli.command import Command
from kvscope.cli.common import UsageError, check_address, check_output_path, check_url, float_type, open_socket
from kvscope.cli.stop_signals import StopSignals


class Record(Command):
    name = "record"
    help = "record a live engine's events, or a watched vLLM, into a .kvtrace file"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from kvscope.protocol.transport import DEFAULT_CONTROL_ADDR, DEFAULT_EVENTS_ADDR

        p.add_argument("file", metavar="TRACE", help="the .kvtrace file to write")
        p.add_argument("--connect", default=None, metavar="ADDR", help=f"a kvscope engine's events "
                       f"(default {DEFAULT_EVENTS_ADDR})")
        p.add_argument("--control", default=None, metavar="ADDR", help=f"its control socket (default "
                       f"{DEFAULT_CONTROL_ADDR}); an empty string for none")
        p.add_argument("--vllm", metavar="URL", help="record a vLLM instead: poll URL/metrics (docs/VLLM.md)")
        p.add_argument("--kv-events", metavar="ADDR", help="vLLM's KV-event PUB socket (bind:ADDR where vLLM "
                       "connects to ADDR; with --vllm found by itself)")
        p.add_argument("--kv-replay", metavar="ADDR", help="vLLM's KV-event replay ROUTER socket")
        p.add_argument("--interval", type=float_type(positive=True), default=1.0, metavar="S",
                       help="--vllm: seconds between scrapes")
        p.add_argument("--duration", type=float_type(positive=True), default=None, metavar="S",
                       help="stop after S seconds")

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.protocol.transport import DEFAULT_CONTROL_ADDR, DEFAULT_EVENTS_ADDR
        from kvscope.traces.record import record

        check_output_path(args.file, kind="kvtrace")
        if args.vllm or args.kv_events:
            return _record_vllm(args)
        if args.kv_replay:
            raise UsageError("--kv-replay goes with --kv-events (recording a vLLM)")
        connect = args.connect or DEFAULT_EVENTS_ADDR
        control = DEFAULT_CONTROL_ADDR if args.control is None else args.control
        check_address(connect, bind=False)
        if control:
            check_address(control, bind=False)
        with StopSignals() as signals:  # a Ctrl-C Python swallows still ends the recording
            recorded = open_socket("connect to", connect, lambda: record(
                connect, args.file, stop_after_s=args.duration, control_addr=control, stop=signals.stop))
        if not recorded:  # as for a vLLM: say so, rather than exit 0 with no file
            print(f"kvscope record: nothing arrived from {connect}; no trace written", file=sys.stderr)
            return 1
        return 0


def _record_vllm(args: argparse.Namespace) -> int:
    from kvscope.vllm.watch.record import record_vllm

    if args.connect or args.control:
        raise UsageError("record either a kvscope engine (--connect/--control) or a vLLM (--vllm/--kv-events)")
    if args.vllm:
        check_url("--vllm", args.vllm)
    if args.kv_replay and not args.kv_events:
        raise UsageError("--kv-replay goes with --kv-events")
    for flag, addr in (("--kv-events", args.kv_events and args.kv_events.removeprefix("bind:")),
                       ("--kv-replay", args.kv_replay)):
        if addr and not addr.startswith(("tcp://", "ipc://")):
            raise UsageError(f"{flag} {addr}: expected tcp://HOST:PORT or ipc://PATH")
    with StopSignals() as signals:
        rec = record_vllm(args.file, args.vllm, args.kv_events, args.kv_replay, interval=args.interval,
                          duration=args.duration, stop=signals.stop)
    if rec.writer is None:
        print(f"kvscope record: nothing arrived from {args.vllm or args.kv_events}; no trace written",
              file=sys.stderr)
        return 1
    return 0
