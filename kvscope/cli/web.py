"""`kvscope web COMMAND ...`: any of the TUI commands served to a browser through textual-serve."""

from __future__ import annotations

import argparse
import shlex
import sys

from kvscope.cli.command import Command
from kvscope.cli.common import UsageError, int_type

WEB_COMMANDS = ("tui", "replay", "compare", "race", "demo", "tour")


class Web(Command):
    name = "web"
    help = "serve a TUI command to a browser (textual-serve)"
    description = "Serve `kvscope COMMAND ...` in a browser: e.g. kvscope web replay t.kvtrace"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
        p.add_argument("--port", type=int_type(1, 65535), default=8000, help="port (default: 8000)")
        p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --host")
        p.add_argument("app", choices=WEB_COMMANDS, help="the kvscope command to serve")
        p.add_argument("app_args", nargs=argparse.REMAINDER, help="its arguments")

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.protocol.transport import check_bind_address

        try:
            check_bind_address(f"tcp://{args.host}:{args.port}", args.allow_remote)
        except ValueError as e:
            raise UsageError(str(e)) from None
        app_args = [a for a in args.app_args if a != "--"]
        command = shlex.join([sys.executable, "-m", "kvscope", args.app, *app_args])
        from textual_serve.server import Server

        server = Server(command, host=args.host, port=args.port, title=f"kvscope {args.app}")
        print(f"kvscope web: serving `kvscope {shlex.join([args.app, *app_args])}` at http://{args.host}:{args.port}/ "
              f"(ctrl+c stops)", file=sys.stderr)
        server.serve()
        return 0
