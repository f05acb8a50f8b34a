"""The first minutes of a newcomer: `--version`, every command's description, a wrong model name
suggests the right one, `serve` fails on a busy HTTP port before loading anything, publishes where the
dashboard looks (or on a free port, said in a line), an idle engine's heartbeat keeps the dashboard live
whichever starts first, and a demo whose engine dies ends without a Textual traceback."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import subprocess
import sys
import time

import pytest
from _helpers import free_port, wait_for

from kvscope.cli import main
from kvscope.errors import KvscopeError

ENV = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}


def _kvscope(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvscope", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


# ---- the command line ---------------------------------------------------------------------------------
def test_version(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("kvscope ") and len(out.split()) >= 2


def test_every_command_help_has_a_description():
    from kvscope.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        assert p.description and len(p.description) > 10, name


@pytest.mark.parametrize("command", ["replay", "export", "trace-info", "calibrate", "record", "diagnose"])
def test_the_trace_argument_is_named_TRACE(command):
    from kvscope.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert re.search(r"[ \[]TRACE\b", sub.choices[command].format_usage())


@pytest.mark.parametrize("model", ["SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm-135m"])
def test_a_wrong_model_name_lists_the_known_ones_and_suggests_the_closest(model, capsys):
    assert main(["serve", "--model", model, "--num-requests", "1", "--events", "none"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "tiny" in err and "qwen3-0.6b-shape" in err and err.endswith("did you mean smollm2-135m?")


def test_an_unrelated_model_name_suggests_nothing(capsys):
    assert main(["demo", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown model 'no-such-model'" in err and "smollm2-135m" in err and "did you mean" not in err


# ---- serve starts fast and says where it is --------------------------------------------------------
def test_a_busy_http_port_fails_at_once_in_one_line_before_the_model_loads():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = _kvscope("serve", "--http", f"127.0.0.1:{port}", "--model", "smollm2-135m")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"kvscope: error: cannot serve HTTP on 127.0.0.1:{port}: "
                                               "Address already in use"]  # nothing loaded, no uvicorn line


def _serve_args(*argv: str) -> argparse.Namespace:
    from kvscope.cli.main import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_serve_publishes_where_the_dashboard_looks_unless_told_not_to(monkeypatch):
    from kvscope.cli import serve
    from kvscope.protocol.transport import DEFAULT_CONTROL_ADDR, DEFAULT_EVENTS_ADDR

    args = _serve_args()
    serve._default_addresses(args)
    assert (args.events, args.control) == (DEFAULT_EVENTS_ADDR, DEFAULT_CONTROL_ADDR)
    args = _serve_args("--events", "none")
    serve._default_addresses(args)
    assert (args.events, args.control) == (None, None)
    args = _serve_args("--control", "none")
    serve._default_addresses(args)
    assert (args.events, args.control) == (DEFAULT_EVENTS_ADDR, None)


def test_a_taken_default_port_falls_back_to_a_free_one_and_says_which(monkeypatch, capsys):
    pytest.importorskip("zmq")
    from kvscope.cli import serve
    from kvscope.cli.common import UsageError
    from kvscope.protocol import transport

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = f"tcp://127.0.0.1:{held.getsockname()[1]}"
        monkeypatch.setattr(transport, "DEFAULT_EVENTS_ADDR", taken)
        monkeypatch.setattr(transport, "DEFAULT_CONTROL_ADDR", f"tcp://127.0.0.1:{free_port()}")
        args = _serve_args()
        serve._default_addresses(args)
        publisher, control = serve._open_sockets(args)
        try:
            assert publisher.addr.startswith("tcp://127.0.0.1:") and publisher.addr != taken
            err = capsys.readouterr().err.strip().splitlines()
            assert err == [f"kvscope: {taken} is taken (another engine?); events on {publisher.addr} instead"]
            assert serve._watch_hint(publisher, control).endswith(f"kvscope tui --connect {publisher.addr}")
        finally:
            publisher.close()
            control.close()
        # an address the user named is theirs: taken is an error, not a silent move
        args = _serve_args("--events", taken, "--control", "none")
        serve._default_addresses(args)
        with pytest.raises(UsageError, match="cannot bind"):
            serve._open_sockets(args)


# ---- an idle engine looks alive ---------------------------------------------------------------------
def test_an_idle_publisher_sends_heartbeats_that_decode():
    pytest.importorskip("zmq")
    from kvscope.protocol import HeartbeatEvent
    from kvscope.protocol.transport import Subscriber, ZmqPublisher

    pub = ZmqPublisher("tcp://127.0.0.1:0", heartbeat_s=0.1)
    sub = Subscriber(pub.addr)
    try:
        got = []
        assert wait_for(lambda: (got.append(sub.recv(100)), isinstance(got[-1], HeartbeatEvent))[1])
        assert sub.malformed == 0 and pub.sent == 0  # heartbeats are not events: the count stays honest
    finally:
        sub.close()
        pub.close()


def test_a_publisher_without_heartbeats_stays_quiet():
    pytest.importorskip("zmq")
    from kvscope.protocol.transport import Subscriber, ZmqPublisher

    pub = ZmqPublisher("tcp://127.0.0.1:0")
    sub = Subscriber(pub.addr)
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert sub.recv(100) is None
    finally:
        sub.close()
        pub.close()


@pytest.mark.parametrize("dashboard_first", [True, False])
def test_heartbeats_alone_show_an_idle_engine_live_whichever_starts_first(dashboard_first):
    pytest.importorskip("zmq")
    from kvscope.protocol.transport import ZmqPublisher
    from kvscope.tui.sources.live import LiveSource
    from kvscope.tui.model.state import CONN_LIVE

    addr = f"tcp://127.0.0.1:{free_port()}"
    source = pub = None
    try:
        if dashboard_first:
            source = LiveSource(addr, None)
            time.sleep(0.3)
        pub = ZmqPublisher(addr, heartbeat_s=0.2)
        if source is None:
            time.sleep(0.3)
            source = LiveSource(addr, None)
        assert wait_for(lambda: source.connection == CONN_LIVE)
        assert source.take_malformed()[0] == 0
        time.sleep(2.5)  # longer than the silence that reads "disconnected": heartbeats keep it live
        assert source.connection == CONN_LIVE
    finally:
        if source is not None:
            source.close()
        if pub is not None:
            pub.close()


def test_the_header_says_idle_when_live_with_nothing_to_do(monkeypatch):
    pytest.importorskip("textual")
    from textual.geometry import Size

    from kvscope.tui.palette import get_palette
    from kvscope.tui.model.state import CONN_LIVE, TuiState
    from kvscope.tui.widgets.header import HeaderBar

    monkeypatch.setattr(HeaderBar, "size", property(lambda self: Size(200, 2)))  # drawn unmounted, 200 wide
    header = HeaderBar()
    st = TuiState()
    st.conn = CONN_LIVE
    header.show(st, get_palette("default"), None)
    assert "● live · idle" in header.render().plain
    st.running = [1]
    assert "● live" in header.render().plain and "idle" not in header.render().plain


# ---- the demo: a dying engine ends the dashboard with its one line -----------------------------------
class _DeadEngine:
    def line(self) -> str:
        return "starting the engine"

    def error(self) -> str:
        return "the engine exited with code 2: cannot bind tcp://127.0.0.1:5557 (log: /tmp/x.log)"


def test_a_demo_whose_engine_dies_at_start_exits_cleanly_with_its_error():
    pytest.importorskip("textual")
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.feeds import LiveFeed
    from kvscope.tui.sources.live import LiveSource

    addr = f"tcp://127.0.0.1:{free_port()}"
    source = LiveSource(addr, None)
    feed = LiveFeed(source, address=addr, starting=_DeadEngine())

    async def run() -> None:
        app = KvscopeApp([feed])
        async with app.run_test() as pilot:
            for _ in range(20):
                await pilot.pause(0.1)
                app.pump()  # the timer's work, also after the app was told to exit
            assert app._exit  # noqa: SLF001 - the app asked to exit: the caller raises feed.fatal

    try:
        asyncio.run(run())  # a redraw after exit would raise here (NoMatches on the going screens)
    finally:
        source.close()
    assert feed.fatal and feed.fatal.startswith("the engine exited with code 2")
    with pytest.raises(KvscopeError):
        raise KvscopeError(feed.fatal)


def test_demo_moves_off_a_taken_port_and_says_so(capsys):
    from kvscope.tui.launch.demo import free_if_taken

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = f"tcp://127.0.0.1:{held.getsockname()[1]}"
        moved = free_if_taken(taken)
    assert moved != taken and moved.startswith("tcp://127.0.0.1:")
    assert capsys.readouterr().err.strip() == f"kvscope demo: {taken} is taken (another engine or demo?); using {moved}"
    free = f"tcp://127.0.0.1:{free_port()}"
    assert free_if_taken(free) == free


# ---- the model's loading line --------------------------------------------------------------------------
class _Terminal:
    def __init__(self, tty: bool) -> None:
        self.text, self.tty = "", tty

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return self.tty


def test_the_loading_line_in_a_log_is_one_line_when_loaded_and_nothing_on_failure():
    from kvscope.cli.common import loading_line

    log = _Terminal(tty=False)
    with loading_line("tiny", log, checkpoint=False):
        pass
    assert log.text.startswith("kvscope: loaded tiny in ") and log.text.count("\n") == 1
    log = _Terminal(tty=False)
    with pytest.raises(KvscopeError), loading_line("tiny", log, checkpoint=False):
        raise KvscopeError("the one line")
    assert log.text == ""  # the error is the only line


def test_the_loading_line_on_a_terminal_counts_seconds_in_place_then_gives_way():
    from kvscope.cli.common import loading_line

    term = _Terminal(tty=True)
    with loading_line("tiny", term, quiet_s=0.0, checkpoint=False):
        assert wait_for(lambda: "loading tiny …" in term.text)
    assert term.text.startswith("\rkvscope: loading tiny … ") and "\n" not in term.text.split("\x1b[K")[0]
    assert term.text.split("\r\x1b[K")[-1].startswith("kvscope: loaded tiny in ")
    term = _Terminal(tty=True)
    with pytest.raises(KvscopeError), loading_line("tiny", term, quiet_s=0.0, checkpoint=False):
        wait_for(lambda: "loading" in term.text)
        raise KvscopeError("the one line")
    assert term.text.endswith("\r\x1b[K")  # erased: the error line starts on a clean line
