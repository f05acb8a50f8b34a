"""The docs-test harness's machinery (test helper for tests/test_docs.py).

It finds every ```sh / ```bash / ```python block of README.md and docs/*.md and runs it
as a reader would, in a fresh temporary directory, bounded:

- a command that ends (``kvscope trace-info``, ``export``, a finite ``serve``, ``curl``...)
  runs to its end and must exit 0;
- a server (``kvscope serve --http`` or ``--forever``, ``record``, ``web``) is started, must
  come up (every address it was given accepts a connection; ``/health`` answers for
  ``--http``), stays up while the block's later commands run (the README's ``curl`` talks to
  it), and is stopped with Ctrl-C at the end of the block, which it must survive cleanly;
- a dashboard (``kvscope tui``, ``replay``, ``compare``, ``demo``, ``race`` without
  ``--no-tui``) is run on a pseudo-terminal until it has drawn its first screen, then sent
  ``q`` and must exit 0.

A block that cannot run here is marked in the doc source with ``<!-- doc-test: skip
(reason) -->`` on the line before it; its flags are still checked. Port numbers in a block
are replaced, consistently within the block, by free ones, so a run never collides with
another process on the machine.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import os
import pty
import re
import select
import shlex
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
import urllib.request
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
RUN_LANGS = ("sh", "bash", "python")
SKIP_RE = re.compile(r"^<!--\s*doc-test:\s*skip\s*\((?P<reason>.+)\)\s*-->\s*$")
MARKER_RE = re.compile(r"^<!--\s*doc-test:")

# Deadlines, not expectations: generous for a shared 2-core host under other jobs' load.
COMMAND_TIMEOUT_S = 300  # one command that ends
UP_TIMEOUT_S = 180  # a server's imports and model load
TUI_UP_TIMEOUT_S = 240  # race runs its configurations before the compare screen opens
STOP_TIMEOUT_S = 60  # Ctrl-C: a server closes its trace and sockets, at nice 19 beside other jobs
DAEMON_COMMANDS = ("record", "web")
TUI_COMMANDS = ("tui", "replay", "compare", "demo", "tour")
ALT_SCREEN = b"\x1b[?1049h"  # Textual switches to the alternate screen once it runs
FRAME_BYTES = 500  # more than the alternate-screen switch and cursor setup: a drawn screen
AFTER_FRAME_S = 0.5


@dataclass
class Block:
    doc: str
    line: int  # the line of the opening fence, 1-based
    lang: str
    text: str
    skip: str | None  # the reason, when marked

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks(doc: str) -> list[Block]:
    """The fenced blocks of one doc, every language (the caller picks)."""
    lines = open(os.path.join(ROOT, doc), encoding="utf-8").read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if m:
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            prev = lines[i - 1].strip() if i else ""
            skip = None
            if MARKER_RE.match(prev):
                sm = SKIP_RE.match(prev)
                if not sm:
                    raise ValueError(f"{doc}:{i}: unreadable doc-test marker {prev!r}")
                skip = sm.group("reason")
            out.append(Block(doc, i + 1, m.group(1), "\n".join(lines[i + 1:j]), skip))
            i = j
        i += 1
    return out


def all_blocks() -> list[Block]:
    return [b for doc in DOCS for b in blocks(doc)]


def runnable_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.lang in RUN_LANGS]


# ----------------------------------------------------------------------------- commands
def commands(text: str) -> list[str]:
    """A shell block's commands: continued lines joined, comments and blank lines dropped."""
    out, cur = [], ""
    for raw in text.split("\n"):
        cur += raw
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        words = shlex.split(cur, comments=True)
        if words:
            out.append(cur)
        cur = ""
    return out


def words(command: str) -> list[str]:
    return shlex.split(command, comments=True)


ENV_WORD = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def program(argv: list[str]) -> list[str]:
    """A command's words after any leading VAR=value assignments."""
    i = 0
    while i < len(argv) and ENV_WORD.match(argv[i]):
        i += 1
    return argv[i:]


def kvscope_invocations(text: str, shell: bool = True) -> list[list[str]]:
    """Each `kvscope ...` command of a block, as words starting after `kvscope`. A synopsis
    (```text: brackets, alternatives) is split on spaces rather than parsed as shell."""
    found = []
    for c in commands(text) if shell else text.split("\n"):
        w = program(words(c) if shell else re.findall(r"[^\s\[\]|]+", c.lstrip("$ ")))
        if w and w[0] == "kvscope":
            found.append(w[1:])
    return found


def subcommand(argv: list[str]) -> str | None:
    return argv[0] if argv and not argv[0].startswith("-") else None


def flags(argv: list[str]) -> list[str]:
    """The --flags of a kvscope invocation; after a lone `--` they are another program's (serve --engine vllm)."""
    if "--" in argv:
        argv = argv[:argv.index("--")]
    return [re.match(r"--[A-Za-z0-9][A-Za-z0-9-]*", a).group(0) for a in argv
            if re.match(r"--[A-Za-z0-9]", a)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT_RE = re.compile(r"(?P<host>127\.0\.0\.1|localhost):(?P<port>\d{4,5})\b")
METRICS_PORT_RE = re.compile(r"(--metrics-port[ =])(\d{4,5})\b")


def remap_ports(text: str) -> str:
    """Every loopback port of the block to a free one (the same one wherever it repeats)."""
    mapping: dict[str, str] = {}

    def sub(port: str) -> str:
        if port not in mapping:
            mapping[port] = str(free_port())
        return mapping[port]

    text = PORT_RE.sub(lambda m: f"{m.group('host')}:{sub(m.group('port'))}", text)
    return METRICS_PORT_RE.sub(lambda m: m.group(1) + sub(m.group(2)), text)


# ----------------------------------------------------------------------------- environment
def environment() -> dict:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TERM", "xterm-256color")
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    return env


def seed_workdir(path: str) -> None:
    """What the docs' commands expect in the current directory: the repo's traces/ and benchmarks/
    (read only), the venv as .venv, and a recorded run as run.kvtrace (a copy of the demo)."""
    for name in ("traces", "benchmarks"):
        os.symlink(os.path.join(ROOT, name), os.path.join(path, name))
    os.symlink(sys.prefix, os.path.join(path, ".venv"))
    with open(os.path.join(ROOT, "traces", "demo-cpu.kvtrace"), "rb") as src, \
            open(os.path.join(path, "run.kvtrace"), "wb") as dst:
        dst.write(src.read())


# ----------------------------------------------------------------------------- processes
def _tail(text: str, n: int = 1500) -> str:
    return text if len(text) <= n else "..." + text[-n:]


@dataclass
class Daemon:
    command: str
    proc: subprocess.Popen
    log: str
    records: str | None  # the file it records into, if any

    def output(self) -> str:
        with open(self.log, encoding="utf-8", errors="replace") as f:
            return f.read()


def _addresses(argv: list[str]) -> list[tuple[str, int]]:
    """(host, port) of every socket a server command was told to open."""
    out = []
    for i, a in enumerate(argv[:-1]):
        v = argv[i + 1]
        if a in ("--http",):
            host, _, port = v.rpartition(":")
            out.append((host, int(port)))
        elif a in ("--events", "--control", "--kv-events-vllm", "--kv-replay-vllm") and v.startswith("tcp://"):
            host, _, port = v[len("tcp://"):].rpartition(":")
            out.append((host, int(port)))
        elif a == "--metrics-port":
            out.append(("127.0.0.1", int(v)))
    return out


def _accepts(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


def _http_health(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2) as r:
        return r.status == 200
    return False


def _exec(command: str) -> str:
    """The command for `bash -c`, exec'd so signals reach it (`env` carries a VAR=value prefix)."""
    return ("exec env " if ENV_WORD.match(command) else "exec ") + command


def start_daemon(command: str, argv: list[str], cwd: str, env: dict) -> Daemon:
    log = os.path.join(cwd, f".daemon-{len(os.listdir(cwd))}.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", "-c", _exec(command)], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    records = argv[argv.index("--record") + 1] if "--record" in argv[:-1] else None
    if subcommand(argv) == "record":
        records = next((a for a in argv[1:] if not a.startswith("-")), None)
    d = Daemon(command, proc, log, records)
    addrs = _addresses(argv)
    http = [(h, p) for a, v in zip(argv, argv[1:]) if a == "--http" for h, _, p in [v.rpartition(":")]]
    deadline = time.monotonic() + UP_TIMEOUT_S
    settle_until = time.monotonic() + 3  # a server given no address: alive for a while counts as up
    # serve binds its sockets before it loads the model (a port in use fails fast), so an accepting events
    # socket is not yet an engine: without an HTTP /health to ask, wait for its first published frame
    events = (argv[argv.index("--events") + 1] if subcommand(argv) == "serve" and "--events" in argv[:-1] and not http
              else None)
    sub = _subscriber(events) if events else None
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"`{command}` exited {proc.returncode} before it came up:\n{_tail(d.output())}")
            up = all(_accepts(h, p) for h, p in addrs) and all(_http_health(h, int(p)) for h, p in http)
            if up and sub is not None:
                up = bool(sub.poll(200))
            if up and (addrs or time.monotonic() > settle_until):
                return d
            if time.monotonic() > deadline:
                stop_daemon(d, check=False)
                raise AssertionError(f"`{command}` did not come up in {UP_TIMEOUT_S}s:\n{_tail(d.output())}")
            time.sleep(0.2)
    finally:
        if sub is not None:
            sub.close(linger=0)


def _subscriber(addr: str):
    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(addr)
    return sub


def stop_daemon(d: Daemon, check: bool = True) -> None:
    """Ctrl-C, as a user stops it; it must exit cleanly and print no traceback."""
    if d.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(d.proc.pid, signal.SIGINT)
        try:
            d.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(d.proc.pid, signal.SIGKILL)
            d.proc.wait()
            if check:
                raise AssertionError(f"`{d.command}` did not stop within {STOP_TIMEOUT_S}s of Ctrl-C") from None
    if not check:
        return
    out = d.output()
    assert d.proc.returncode in (0, -signal.SIGINT, 128 + signal.SIGINT), \
        f"`{d.command}` exited {d.proc.returncode} on Ctrl-C:\n{_tail(out)}"
    assert "Traceback" not in out, f"`{d.command}` printed a traceback:\n{_tail(out)}"


def run_to_end(command: str, cwd: str, env: dict, timeout: float = COMMAND_TIMEOUT_S) -> str:
    try:
        p = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"`{command}` did not finish in {timeout}s:\n{_tail(str(e.stdout or ''))}") from None
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"`{command}` exited {p.returncode}:\n{_tail(out)}"
    assert "Traceback" not in out, f"`{command}` printed a traceback:\n{_tail(out)}"
    return p.stdout


def _set_winsize(fd: int, rows: int = 30, cols: int = 100) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


@dataclass
class PtyRun:
    """A command on a pseudo-terminal: what it wrote, and how it ended."""

    command: str
    pid: int
    fd: int
    output: bytearray = field(default_factory=bytearray)
    status: int | None = None

    def pump(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while self.status is None:
            left = end - time.monotonic()
            if left <= 0:
                return
            r, _, _ = select.select([self.fd], [], [], min(left, 0.2))
            if r:
                try:
                    data = os.read(self.fd, 65536)
                except OSError as e:  # EIO: the child closed the terminal
                    if e.errno != errno.EIO:
                        raise
                    data = b""
                if data:
                    self.output += data
                    # answer the cursor-position query some terminal apps send, as a terminal would
                    if b"\x1b[6n" in data:
                        os.write(self.fd, b"\x1b[1;1R")
                    continue
            self.poll()

    def poll(self) -> None:
        if self.status is None:
            pid, st = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(st)

    def wait(self, timeout: float) -> int | None:
        end = time.monotonic() + timeout
        while self.status is None and time.monotonic() < end:
            self.pump(0.3)
            self.poll()
        return self.status

    def kill(self) -> None:
        if self.status is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.wait(10)
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def text(self) -> str:
        return self.output.decode("utf-8", errors="replace")


def start_pty(command: str, cwd: str, env: dict) -> PtyRun:
    pid, fd = pty.fork()
    if pid == 0:  # child: its own session already (pty.fork makes it the session leader)
        try:
            os.chdir(cwd)
            os.execvpe("bash", ["bash", "-c", _exec(command)], env)
        finally:
            os._exit(127)
    _set_winsize(fd)
    return PtyRun(command, pid, fd)


def run_tui(command: str, cwd: str, env: dict, up_timeout: float = TUI_UP_TIMEOUT_S) -> str:
    """Start a dashboard on a terminal, let it draw, press q; it must exit 0 without a traceback."""
    run = start_pty(command, cwd, env)
    try:
        deadline = time.monotonic() + up_timeout
        while ALT_SCREEN not in run.output and run.status is None and time.monotonic() < deadline:
            run.pump(0.5)
        assert run.status is None, f"`{command}` exited {run.status} before drawing:\n{_tail(run.text())}"
        assert ALT_SCREEN in run.output, f"`{command}` drew nothing in {up_timeout}s:\n{_tail(run.text())}"
        # its first frame: a screen drawn (an idle engine's dashboard need not change again after it)
        drawn = lambda: len(run.output) - run.output.index(ALT_SCREEN) > FRAME_BYTES  # noqa: E731
        while not drawn() and run.status is None and time.monotonic() < deadline:
            run.pump(0.2)
        assert run.status is None, f"`{command}` exited {run.status} after starting:\n{_tail(run.text())}"
        assert drawn(), f"`{command}` drew no frame after starting"
        run.pump(AFTER_FRAME_S)  # whatever it does once drawn (timers, the first poll) before q
        assert run.status is None, f"`{command}` exited {run.status} after drawing:\n{_tail(run.text())}"
        os.write(run.fd, b"q")
        status = run.wait(STOP_TIMEOUT_S)
        assert status is not None, f"`{command}` did not quit within {STOP_TIMEOUT_S}s of q"
        assert status == 0, f"`{command}` exited {status} on q:\n{_tail(run.text())}"
        assert "Traceback" not in run.text(), f"`{command}` printed a traceback:\n{_tail(run.text())}"
        return run.text()
    finally:
        run.kill()


# ----------------------------------------------------------------------------- one block
def kind(argv: list[str]) -> str:
    """How a kvscope command runs: "daemon" (serves until stopped), "tui" (a dashboard) or "end"."""
    cmd = subcommand(argv)
    if cmd == "serve" and ("--forever" in argv or "--http" in argv):
        return "daemon"
    if cmd in DAEMON_COMMANDS:
        return "daemon"
    if cmd in TUI_COMMANDS or (cmd == "race" and "--no-tui" not in argv):
        return "tui"
    return "end"


def check_curl_answer(command: str, out: str) -> None:
    """The docs' curl lines ask for a completion: the answer is one, not an error."""
    try:
        body = json.loads(out)
    except ValueError:
        raise AssertionError(f"`{command}` answered no JSON: {_tail(out, 400)!r}") from None
    assert "error" not in body, f"`{command}` answered an error: {body['error']}"
    assert body.get("choices"), f"`{command}` answered no choices: {_tail(out, 400)}"


def run_shell_block(text: str, cwd: str, env: dict) -> None:
    daemons: list[Daemon] = []
    try:
        for command in commands(remap_ports(text)):
            # `PYTHONPATH=. kvscope ...` (a doc's own module beside kvscope): keep kvscope importable too
            command = re.sub(r"^PYTHONPATH=(\S+) ", r"PYTHONPATH=\1:$PYTHONPATH ", command)
            argv = program(words(command))
            # a recording is finished before anything reads it, as a user stops it first
            for d in [d for d in daemons if d.records and d.records in argv]:
                stop_daemon(d)
                daemons.remove(d)
            if argv[0] != "kvscope":
                out = run_to_end(command, cwd, env)
                if argv[0] == "curl" and any("completions" in a for a in argv):
                    check_curl_answer(command, out)
                continue
            k = kind(argv[1:])
            if k == "daemon":
                daemons.append(start_daemon(command, argv[1:], cwd, env))
            elif k == "tui":
                run_tui(command, cwd, env)
            else:
                run_to_end(command, cwd, env)
        for d in daemons:
            assert d.proc.poll() is None, f"`{d.command}` exited {d.proc.returncode} while the block ran:\n" \
                                          f"{_tail(d.output())}"
        while daemons:
            stop_daemon(daemons.pop())
    finally:
        for d in daemons:
            stop_daemon(d, check=False)


def run_python_block(text: str, cwd: str, env: dict) -> None:
    path = os.path.join(cwd, "doc_block.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    run_to_end(f"{shlex.quote(sys.executable)} doc_block.py", cwd, env)


FILE_RE = re.compile(r"^# (?P<name>[A-Za-z0-9_]+\.py)\s*$")


def files_before(block: Block) -> dict[str, str]:
    """Files the doc asks the reader to write before this block: a ```python block whose first
    line is `# NAME.py` is that file (POLICIES.md's my_policies.py)."""
    out = {}
    for b in blocks(block.doc):
        if b.line >= block.line:
            break
        first = b.text.split("\n", 1)[0]
        m = FILE_RE.match(first) if b.lang == "python" else None
        if m:
            out[m.group("name")] = b.text + "\n"
    return out


def run_block(block: Block, cwd: str) -> None:
    seed_workdir(cwd)
    for name, text in files_before(block).items():
        with open(os.path.join(cwd, name), "w", encoding="utf-8") as f:
            f.write(text)
    env = environment()
    if block.lang == "python":
        run_python_block(block.text, cwd, env)
    else:
        run_shell_block(block.text, cwd, env)


# ----------------------------------------------------------------------------- flags
HELP_SCRIPT = r"""
import contextlib, io, json, sys
from kvscope.cli import main
out = {}
for cmd in sys.argv[1:]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        main([cmd, "--help"] if cmd else ["--help"])
    out[cmd] = buf.getvalue()
print(json.dumps(out))
"""


def help_texts(cmds: list[str]) -> dict[str, str]:
    """`kvscope CMD --help` for each command, in one process."""
    p = subprocess.run([sys.executable, "-c", HELP_SCRIPT, *cmds], cwd=ROOT, env=environment(),
                       capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def subcommands(top_help: str) -> list[str]:
    m = re.search(r"\{([a-z,-]+)\}", top_help)
    if m:
        return m.group(1).split(",")
    return re.findall(r"^    ([a-z][a-z-]+)\b", top_help, flags=re.M)


def help_flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[A-Za-z0-9][A-Za-z0-9-]*", text))


INLINE_RE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")


def prose(doc: str) -> list[tuple[int, str]]:
    """(line, text) of a doc outside its fenced blocks."""
    out, fenced = [], False
    for n, line in enumerate(open(os.path.join(ROOT, doc), encoding="utf-8").read().split("\n"), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def inline_spans(doc: str) -> list[tuple[int, str]]:
    """Inline code spans of a doc's prose (a span may not cross a line: docs keep them short)."""
    return [(n, m.group(1)) for n, line in prose(doc) for m in INLINE_RE.finditer(line)]
