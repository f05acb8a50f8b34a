"""Start-up of the dashboards as whole processes: from the command to its first frame and first step.

    python benchmarks/startup.py [--runs 5] [--warmup 1] [--rows demo,replay,replay-big,demo-real] [--json FILE]

Each run starts the command under a pseudo-terminal (160x50, as a user's terminal), with
KVSCOPE_STARTUP_LOG set: the app appends "first-draw T" once its first frame is on the
terminal and "first-step T" once a step has been folded (unix times, kvscope/tui/app.py).
The time is stamped just before the process is spawned, so the figures hold everything a
user waits for: the interpreter, imports, opening the trace or starting the engine. Once
a run has what its row measures (or its timeout passes) the bench presses q, then ends
the process group. Rows run in turn, round after round, so drift on a shared machine
falls on all of them alike.

Rows:
- demo:       `kvscope demo` (the tiny model: the dashboard draws at once, the engine loads beside it);
- replay:     `kvscope replay traces/demo-cpu.kvtrace` (the shipped trace, 0.6 MB);
- replay-big: `kvscope replay` of a large sim trace (about 134k steps, 6.6 MB; made once with
              `kvscope serve --backend sim --num-requests 2000 --record FILE` unless --big-trace names one);
- demo-real:  `kvscope demo --model smollm2-135m`: the first frame, and whether the engine's progress
              line ("starting the engine ...") is on the screen before the first step (the model
              is read from the converted cache, kvscope/engine/loader/model_cache.py, written by `kvscope
              fetch` or the first start; the row waits --real-timeout for the first step);
- demo-real-uncached: the same with KVSCOPE_NO_MODEL_CACHE=1: transformers parses and dequantizes
              the GGUF at every start, as before the cache;
- serve-real: `kvscope serve --model smollm2-135m --http 127.0.0.1:PORT`: seconds until GET /health
              answers 200 (its "first step" column; no frame);
- serve-real-uncached: the same with KVSCOPE_NO_MODEL_CACHE=1;
- demo-real-transformers, serve-real-transformers: the cached entry read by transformers' own llama classes
              and run by its forward (KVSCOPE_FORWARD=transformers), as before kvscope/engine/loader/light_llama.py.

The demo rows bind kvscope's default ports (5557/5558): nothing else may hold them meanwhile.
The first --warmup rounds (default 1: a cold file cache is not what the figures are about) are
kept in the JSON but left out of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from statistics import median

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_TRACE = os.path.join(ROOT, "traces", "demo-cpu.kvtrace")
BIG_TRACE = os.path.join(tempfile.gettempdir(), "kvscope-startup-big.kvtrace")
BIG_REQUESTS = 2000  # ~134k sim steps
COLS, ROWS = 160, 50
PROGRESS_TEXT = "starting the engine"  # the demo's header line while its engine loads (tui/launch/demo.py)
ALL_ROWS = ("demo", "replay", "replay-big", "demo-real", "demo-real-uncached", "demo-real-transformers", "serve-real",
            "serve-real-uncached", "serve-real-transformers")
UNCACHED = {"KVSCOPE_NO_MODEL_CACHE": "1"}
TRANSFORMERS = {"KVSCOPE_FORWARD": "transformers"}  # the cached entry read by transformers' own model classes


def _row_env(name: str) -> dict:
    return UNCACHED if name.endswith("-uncached") else TRANSFORMERS if name.endswith("-transformers") else {}
ANSI = re.compile(rb"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)|[()][0-9A-Za-z]|[@-Z\\-_])")
MAX_SCREEN_BYTES = 4 << 20  # what is kept of a run's terminal output (for the progress-line check)


def kvscope_cmd() -> list[str]:
    """The `kvscope` console script users type, or this interpreter's module when it is not on PATH."""
    exe = shutil.which("kvscope")
    return [exe] if exe else [sys.executable, "-m", "kvscope"]


def row_spec(name: str, args: argparse.Namespace) -> dict:
    """What a row runs and what it waits for: needs first-step too, or the first frame only."""
    kv = kvscope_cmd()
    if name == "demo":
        return {"cmd": kv + ["demo"], "need_step": True, "timeout": args.timeout}
    if name == "replay":
        return {"cmd": kv + ["replay", args.trace], "need_step": True, "timeout": args.timeout}
    if name == "replay-big":
        return {"cmd": kv + ["replay", args.big_trace], "need_step": True, "timeout": args.timeout}
    if name in ("demo-real", "demo-real-uncached", "demo-real-transformers"):
        return {"cmd": kv + ["demo", "--model", "smollm2-135m"], "need_step": True,
                "timeout": args.real_timeout, "progress": True, "env": _row_env(name)}
    if name in ("serve-real", "serve-real-uncached", "serve-real-transformers"):
        port = _free_port()
        return {"cmd": kv + ["serve", "--model", "smollm2-135m", "--http", f"127.0.0.1:{port}"], "health_port": port,
                "timeout": args.real_timeout, "env": _row_env(name)}
    raise SystemExit(f"startup.py: unknown row {name!r} (rows: {', '.join(ALL_ROWS)})")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=0.5) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def run_health(spec: dict) -> dict:
    """One run of a server row: seconds from spawn until /health answers 200 (kept as first_step_s)."""
    env = dict(os.environ, **spec.get("env", {}))
    t0 = time.time()
    proc = subprocess.Popen(spec["cmd"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env, cwd=ROOT, start_new_session=True)
    result: dict = {"first_draw_s": None, "first_step_s": None}
    try:
        deadline = time.monotonic() + spec["timeout"]
        while time.monotonic() < deadline and proc.poll() is None:
            if _healthy(spec["health_port"]):
                result["first_step_s"] = round(time.time() - t0, 4)
                break
            time.sleep(0.05)
        else:
            result["error"] = (f"exited with code {proc.returncode}" if proc.poll() is not None
                               else f"timed out after {spec['timeout']:g} s")
    finally:
        for sig in (signal.SIGINT, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=15)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
    return result


def make_big_trace(path: str, requests: int = BIG_REQUESTS) -> None:
    """A large trace from the sim backend (virtual time: ~30 s of CPU, whatever the engine time)."""
    print(f"startup.py: writing {path} (sim, {requests} requests) ...", file=sys.stderr, flush=True)
    tmp = path + ".part"
    subprocess.run(kvscope_cmd() + ["serve", "--backend", "sim", "--num-requests", str(requests), "--no-progress",
                                    "--record", tmp], check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    os.replace(tmp, path)


def read_stamps(log_path: str) -> dict[str, float]:
    """The first "first-draw T" and "first-step T" in the app's start-up log."""
    out: dict[str, float] = {}
    try:
        with open(log_path, encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[0] in ("first-draw", "first-step") and parts[0] not in out:
                    try:
                        out[parts[0]] = float(parts[1])
                    except ValueError:
                        pass
    except OSError:
        pass
    return out


def _set_winsize(fd: int) -> None:
    import fcntl
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))


def _drain(master: int, screen: bytearray, wait: float) -> bool:
    """Read what the child wrote (it blocks on a full terminal otherwise); False once it closed."""
    try:
        ready, _, _ = select.select([master], [], [], wait)
    except (OSError, ValueError):
        return False
    if not ready:
        return True
    try:
        data = os.read(master, 65536)
    except OSError:  # EIO: the child side is closed
        return False
    if not data:
        return False
    screen += data
    if len(screen) > MAX_SCREEN_BYTES:
        del screen[: len(screen) - MAX_SCREEN_BYTES]
    return True


def _stop(proc: subprocess.Popen, master: int, screen: bytearray) -> None:
    """q first (the demo then stops its engine), then the process group, politely and then not."""
    try:
        os.write(master, b"q")
    except OSError:
        pass
    for sig, grace in ((None, 10.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        if sig is not None:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return
            _drain(master, screen, 0.05)
    proc.wait(timeout=5)


def run_once(spec: dict) -> dict:
    """One run of a row's command: seconds from spawn to first draw, first step, progress line."""
    fd, log_path = tempfile.mkstemp(prefix="kvscope-startup-", suffix=".log")
    os.close(fd)
    env = dict(os.environ, **spec.get("env", {}), KVSCOPE_STARTUP_LOG=log_path, TERM=os.environ.get("TERM", "xterm-256color"),
               COLUMNS=str(COLS), LINES=str(ROWS))
    if env["TERM"] in ("", "dumb"):
        env["TERM"] = "xterm-256color"
    master, slave = pty.openpty()
    _set_winsize(slave)
    screen = bytearray()
    progress_s = None
    result: dict = {"first_draw_s": None, "first_step_s": None}
    t0 = time.time()
    try:
        proc = subprocess.Popen(spec["cmd"], stdin=slave, stdout=slave, stderr=slave, env=env, cwd=ROOT,
                                start_new_session=True, close_fds=True)
    except OSError as e:
        os.close(master)
        os.close(slave)
        os.unlink(log_path)
        return {**result, "error": f"cannot start: {e}"}
    os.close(slave)
    try:
        deadline = time.monotonic() + spec["timeout"]
        open_ = True
        while time.monotonic() < deadline:
            open_ = _drain(master, screen, 0.02) and open_
            if spec.get("progress") and progress_s is None and PROGRESS_TEXT.encode() in ANSI.sub(b"", screen):
                progress_s = time.time() - t0
            stamps = read_stamps(log_path)
            have_draw = "first-draw" in stamps
            have_step = "first-step" in stamps
            if have_draw and (have_step or not spec["need_step"]):
                break
            if proc.poll() is not None:
                break
            if not open_:
                time.sleep(0.02)
        rc = proc.poll()
        _stop(proc, master, screen)
    finally:
        os.close(master)
    stamps = read_stamps(log_path)
    os.unlink(log_path)
    for key, name in (("first_draw_s", "first-draw"), ("first_step_s", "first-step")):
        if name in stamps:
            result[key] = round(stamps[name] - t0, 4)
    if spec.get("progress"):
        result["progress_s"] = round(progress_s, 4) if progress_s is not None else None
        step = result["first_step_s"]
        # shown while the engine loads: seen on the terminal before the first step (or with none yet)
        result["progress_before_step"] = progress_s is not None and (step is None or progress_s <= step + 0.05)
    if rc is not None:  # it ended on its own before it had what the row measures
        tail = ANSI.sub(b"", screen).decode("utf-8", "replace").strip().splitlines()
        result["error"] = f"exited with code {rc}: {tail[-1][:200] if tail else 'no output'}"
    elif result["first_draw_s"] is None or (spec["need_step"] and result["first_step_s"] is None):
        result["error"] = f"timed out after {spec['timeout']:g} s"
    return result


def summarize(values: list[float | None]) -> dict | None:
    got = [v for v in values if v is not None]
    if not got:
        return None
    return {"median": round(median(got), 4), "max": round(max(got), 4), "n": len(got)}


def fmt(s: dict | None) -> str:
    return f"{s['median']:.2f} / {s['max']:.2f}" if s else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="measured runs per row (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and left out of the figures (default 1)")
    ap.add_argument("--rows", default=",".join(ALL_ROWS), help=f"comma-separated, of {', '.join(ALL_ROWS)}")
    ap.add_argument("--trace", default=SMALL_TRACE, help="the replay row's trace")
    ap.add_argument("--big-trace", default=BIG_TRACE, help="the replay-big row's trace (written when missing)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a run may take (default 60)")
    ap.add_argument("--real-timeout", type=float, default=300.0,
                    help="demo-real: seconds to wait for the first step (default 300)")
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.warmup < 0:
        ap.error("--runs must be >= 1 and --warmup >= 0")
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    specs = {r: row_spec(r, args) for r in rows}
    if "replay-big" in rows and not os.path.exists(args.big_trace):
        make_big_trace(args.big_trace)
    runs: dict[str, list[dict]] = {r: [] for r in rows}
    for rnd in range(args.warmup + args.runs):
        for r in rows:
            res = run_health(specs[r]) if "health_port" in specs[r] else run_once(specs[r])
            res["warmup"] = rnd < args.warmup
            runs[r].append(res)
            shown = {k: v for k, v in res.items() if v is not None}
            print(f"startup.py: {r} run {rnd + 1}: {shown}", file=sys.stderr, flush=True)
    out_rows = []
    for r in rows:
        kept = [x for x in runs[r] if not x["warmup"]]
        row = {"row": r, "command": " ".join(["kvscope"] + specs[r]["cmd"][len(kvscope_cmd()):]),
               "first_draw_s": summarize([x["first_draw_s"] for x in kept]),
               "first_step_s": summarize([x["first_step_s"] for x in kept]),
               "errors": sum(1 for x in kept if x.get("error")), "runs": runs[r]}
        if specs[r].get("progress"):
            row["progress_s"] = summarize([x.get("progress_s") for x in kept])
            row["progress_before_step"] = all(x.get("progress_before_step") for x in kept)
        if r == "replay-big" or r == "replay":
            path = args.big_trace if r == "replay-big" else args.trace
            row["trace_bytes"] = os.path.getsize(path) if os.path.exists(path) else None
        out_rows.append(row)
    print(f"\nstart-up, seconds from the command (median / max of {args.runs} runs, {args.warmup} warm-up left out)")
    print(f"{'row':<19} {'first frame':>13} {'first step':>13} {'errors':>6}  command "
          "(serve rows: first step = /health answers)")
    for row in out_rows:
        env = " ".join(f"{k}={v}" for k, v in specs[row["row"]].get("env", {}).items())
        print(f"{row['row']:<19} {fmt(row['first_draw_s']):>13} {fmt(row['first_step_s']):>13} "
              f"{row['errors']:>6}  {env + ' ' if env else ''}{row['command']}")
        if "progress_before_step" in row:
            print(f"{'':<19} progress line on screen at {fmt(row['progress_s'])} s, before the first step: "
                  f"{'yes' if row['progress_before_step'] else 'NO'}")
    if args.json:
        doc = {"bench": "startup", "runs": args.runs, "warmup": args.warmup,
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                           "python": platform.python_version()},
               "terminal": f"{COLS}x{ROWS}", "rows": out_rows}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}")
    return 1 if any(row["errors"] for row in out_rows) else 0


if __name__ == "__main__":
    sys.exit(main())
