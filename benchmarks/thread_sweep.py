"""Output tok/s against --cpu-threads, per command, on this machine: how kvscope's CPU defaults were chosen.

    python benchmarks/thread_sweep.py [--threads 1,2] [--rounds 2] [--rows serve,bench] [--json FILE]
    python benchmarks/thread_sweep.py --competitor [--threads 1,2,auto] [--rows serve-mixed] [--json FILE]
    python benchmarks/thread_sweep.py --report benchmarks/results/threads-cpu.json

--threads takes counts and `auto` (no --cpu-threads: the runner picks online, kvscope/engine/cpu/threads.py),
each optionally with an OpenMP wait policy for its runs: `2:ACTIVE` is --cpu-threads 2 under OMP_WAIT_POLICY=ACTIVE
or `2:spin20000` under GOMP_SPINCOUNT=20000 (without one, the runs keep kvscope's own choice), and `2:PASSIVE:fixed`
also sets KVSCOPE_FIXED_THREADS=1 (exactly 2 threads: the explicit count's tuner off).
--competitor runs every row twice per round, quiet and beside one CPU-bound busy-loop process, interleaved
(quiet t=1, loaded t=1, quiet t=2, loaded t=2, ... in one run), so both conditions see the same drift; the
table then gives each condition's tok/s and each count against the best fixed count under the same load.

Rows (each run in its own process, thread counts alternating A B B A ... so drift on a
shared machine falls on both):
- serve:      `kvscope serve --model tiny --workload realsize --num-requests 256` (all at once, so the
              engine, not the arrival rate, sets the pace), nothing watching;
- serve-real: `kvscope serve --model qwen3-0.6b-shape --workload realsize` (24 requests at once);
- bench:      `kvscope bench --model tiny --workload realsize --num-requests 256 --modes chunked
              --peers hf-generate-batch`
              (kvscope's row and the peer's, both at the same thread count);
- chunked-mixed: the tiny model, 16 requests of the mixed workload, kvscope's chunked row alone (short: a loaded machine);
- single-stream-real: `kvscope bench --model smollm2-135m --workload chat --num-requests 4 --modes single-stream`
              (one chat stream at a time on the real model);
- demo:       the demo's engine (`kvscope demo`'s own command line) with the dashboard watching in
              a second process, as `make demo` runs them; tok/s counted from the step events over
              a fixed window after a warm-up;
- demo-real:  the same with --model qwen3-0.6b-shape: a real-size engine with a dashboard beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from statistics import median

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": ROOT}


def _kvscope(args: list[str], timeout: float, n=None) -> None:
    subprocess.run([PY, "-m", "kvscope", *args], env=_env(n), cwd=ROOT, check=True, capture_output=True,
                   timeout=timeout)


def _threads_args(n) -> list[str]:
    count = str(n).split(":")[0]
    return [] if count == "auto" else ["--cpu-threads", count]


def _env(n) -> dict:
    """A setting "COUNT:POLICY" (e.g. 2:ACTIVE) runs with OMP_WAIT_POLICY=POLICY, and "COUNT:POLICY:fixed" also
    with KVSCOPE_FIXED_THREADS=1 (exactly COUNT threads, never fewer beside a competitor); plain COUNT with
    kvscope's own choices."""
    _, policy, fixed = (str(n).split(":") + ["", ""])[:3]
    env = dict(ENV)
    env.pop("KVSCOPE_FIXED_THREADS", None)
    if policy.lower().startswith("spin"):  # 2:spin20000: libgomp spins that many rounds, then sleeps
        env["GOMP_SPINCOUNT"] = policy[4:]
    elif policy:
        env["OMP_WAIT_POLICY"] = policy
    if fixed == "fixed":
        env["KVSCOPE_FIXED_THREADS"] = "1"
    return env


def serve(n, model: str = "tiny", workload: str = "realsize", requests: str | None = "256") -> float:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "serve.json")
        extra = ["--num-requests", requests] if requests else []
        _kvscope(["serve", "--device", "cpu", "--model", model, "--workload", workload, *extra,
                  *_threads_args(n), "--no-progress", "--json", out], timeout=1200, n=n)
        with open(out) as f:
            return json.load(f)["summary"]["output_tok_per_s"]


def bench(n, workload: str = "realsize", requests: str = "256", peers: bool = True) -> tuple[float, ...]:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "bench.json")
        _kvscope(["bench", "--device", "cpu", "--model", "tiny", "--workload", workload, "--num-requests", requests,
                  "--modes", "chunked", *(["--peers", "hf-generate-batch"] if peers else []), *_threads_args(n),
                  "--json", out],
                 timeout=1200, n=n)
        with open(out) as f:
            rows = {r["name"]: r["output_tok_per_s"] for r in json.load(f)["rows"]}
        return (rows["chunked"], rows["hf-generate-batch"]) if peers else (rows["chunked"],)


def single_stream_real(n) -> float:
    """SmolLM2's single-stream row (one chat stream at a time): the rate one user chatting gets."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "bench.json")
        _kvscope(["bench", "--device", "cpu", "--model", "smollm2-135m", "--workload", "chat", "--num-requests", "4",
                  "--modes", "single-stream", "--peers", "", *_threads_args(n), "--json", out], timeout=1200, n=n)
        with open(out) as f:
            return json.load(f)["rows"][0]["output_tok_per_s"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DASHBOARD = """
import asyncio, sys
from kvscope.tui.app import KvscopeApp
from kvscope.tui.sources.live import LiveSource
source = LiveSource(sys.argv[1], sys.argv[2])
app = KvscopeApp(source, address=sys.argv[1])
async def go():
    async with app.run_test(size=(160, 48)):
        await asyncio.sleep(float(sys.argv[3]))
asyncio.run(go())
source.close()
"""


def demo(n: int, model: str = "tiny", warmup: float = 8.0, window: float = 25.0) -> float:
    """The demo's engine and a dashboard process; output tokens per second seen in the step events."""
    from kvscope.protocol.transport import Subscriber
    from kvscope.tui.launch.demo import demo_command

    ev, ctl = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    cmd = demo_command(ev, ctl, device="cpu", model=model, extra_args=tuple(_threads_args(n)))
    engine = subprocess.Popen(cmd, env=_env(n), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tui = subprocess.Popen([PY, "-c", DASHBOARD, ev, ctl, str(warmup + window + 30)], env=ENV, cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sub = Subscriber(ev)
    try:
        start = None
        tokens = 0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            e = sub.recv(200)
            if e is None or e.type != "step":
                continue
            if start is None:
                start = time.monotonic() + warmup  # count only after the model is warm and a burst is in
            now = time.monotonic()
            if now >= start:
                tokens += len(e.sampled)
                if now - start >= window:
                    return tokens / (now - start)
        raise RuntimeError("the demo engine published no steps")
    finally:
        sub.close()
        for p in (tui, engine):
            p.send_signal(signal.SIGTERM)
        for p in (tui, engine):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


ROWS = {
    "serve": lambda n: {"kvscope": serve(n)},
    "serve-real": lambda n: {"kvscope": serve(n, "qwen3-0.6b-shape", "realsize", None)},
    "bench": lambda n: dict(zip(("kvscope", "hf-generate-batch"), bench(n))),
    "demo": lambda n: {"kvscope": demo(n)},
    "demo-real": lambda n: {"kvscope": demo(n, "qwen3-0.6b-shape", warmup=20.0, window=40.0)},
    # the contention table of docs/BENCHMARKS.md: the tiny model, 48 requests of the mixed workload, chunked and generate_batch
    "bench-mixed": lambda n: dict(zip(("chunked", "hf-generate-batch"), bench(n, "mixed", "48"))),
    # the same, kvscope's row alone (the wait-policy A/B: a third of the requests, more rounds in the same time)
    "chunked-mixed": lambda n: dict(zip(("chunked",), bench(n, "mixed", "16", peers=False))),
    # one chat stream on the real model (SmolLM2-135M, fetched): per-step host work and small GEMMs
    "single-stream-real": lambda n: {"single-stream": single_stream_real(n)},
}

COMPETITOR = "while True: pass"  # one CPU-bound process, as a browser tab or a second engine would be


class Competitor:
    """A busy-loop process for the length of a `with` block."""

    def __enter__(self):
        self.proc = subprocess.Popen([PY, "-c", COMPETITOR])
        time.sleep(0.5)  # let it take its core before the measured run starts
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default=f"1,{os.cpu_count() or 1}",
                   help="comma list of counts and `auto` (default: 1 and all cores)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
    p.add_argument("--competitor", action="store_true",
                   help="measure each run quiet and beside one busy-loop process, interleaved")
    p.add_argument("--loaded-only", action="store_true",
                   help="with --competitor: only the runs beside the busy loop (half the time, on a slow machine)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--report", metavar="FILE", action="append", default=[],
                   help="print the table of earlier --json results instead of measuring (repeatable)")
    args = p.parse_args()
    if args.report:
        for path in args.report:
            with open(path) as f:
                saved = json.load(f)
            per_row = saved.get("rounds_per_row")  # merged from several sweeps
            rounds = ", ".join(f"{k} {v}" for k, v in per_row.items()) if per_row else saved["rounds"]
            if "loads" in saved:
                print(contention_table(saved["runs"], saved["threads"], saved["loads"]))
            else:
                print(table(saved["runs"], saved["threads"], saved["cores"], rounds))
        return 0
    threads = [x if not x.isdigit() else int(x) for x in dict.fromkeys(args.threads.split(","))]
    rows = args.rows.split(",")
    loads = (["loaded"] if args.loaded_only else ["quiet", "loaded"]) if args.competitor else ["quiet"]
    runs: dict = {r: {f"{load}/{n}": [] for n in threads for load in loads} for r in rows}
    uptimes = []
    for rnd in range(args.rounds):
        order = threads if rnd % 2 == 0 else threads[::-1]
        for row in rows:
            for n in order:
                for load in (loads if rnd % 2 == 0 else loads[::-1]):
                    uptimes.append(os.getloadavg()[0])
                    if load == "loaded":
                        with Competitor():
                            got = ROWS[row](n)
                    else:
                        got = ROWS[row](n)
                    runs[row][f"{load}/{n}"].append(got)
                    print(f"[threads] run {rnd + 1} {row} {load} threads={n} (load avg {uptimes[-1]:.1f}): " +
                          ", ".join(f"{k} {v:.1f} tok/s" for k, v in got.items()), file=sys.stderr, flush=True)
    if args.competitor:
        print(contention_table(runs, threads, loads))
    else:
        plain = {r: {str(n): per[f"quiet/{n}"] for n in threads} for r, per in runs.items()}
        print(table(plain, threads, os.cpu_count(), args.rounds))
    if args.json:
        saved = {"cores": os.cpu_count(), "threads": threads, "rounds": args.rounds, "load_avg_before_runs": uptimes}
        if args.competitor:
            saved.update(loads=loads, runs=runs)
        else:
            saved["runs"] = {r: {str(n): per[f"quiet/{n}"] for n in threads} for r, per in runs.items()}
        with open(args.json, "w") as f:
            json.dump(saved, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def contention_table(runs: dict, threads: list, loads: list[str]) -> str:
    """Per row and load: median tok/s per thread setting, and each setting against the best fixed count
    under the same load (the bar: no row below 90% of the better of 1 or all threads)."""
    fixed = [n for n in threads if not str(n).startswith("auto")]
    lines = ["output tok/s, median of rounds; (x) = against the best fixed thread count under the same load",
             f"{'row':<28} " + " ".join(f"{'t=' + str(n):>16}" for n in threads)]
    for row, per in runs.items():
        names = next(iter(per.values()))[0].keys()
        for name in names:
            for load in loads:
                med = {n: median([r[name] for r in per[f"{load}/{n}"]]) for n in threads}
                best = max(med[n] for n in fixed) if fixed else None
                cells = [f"{med[n]:8.1f} ({med[n] / best:4.2f})" if best else f"{med[n]:8.1f}" for n in threads]
                lines.append(f"{row + ' ' + name + ' ' + load:<28} " + " ".join(f"{c:>16}" for c in cells))
    return "\n".join(lines)


def table(runs: dict, threads: list[int], cores: int, rounds) -> str:
    """Median tok/s per thread count, and the median of each round's ratio (most threads / fewest):
    the ratio is taken within a round, so the machine's drift between rounds cancels."""
    lo, hi = str(threads[0]), str(threads[-1])
    lines = [f"cores={cores} rounds=({rounds}): output tok/s, median of rounds; ratio = t={hi} / t={lo} "
             "within each round, median",
             f"{'command':<12} {'row':<18} " + " ".join(f"{'t=' + str(n):>8}" for n in threads) + "    ratio"]
    for row, per in runs.items():
        for name in per[lo][0]:
            med = [median([r[name] for r in per[str(n)]]) for n in threads]
            ratio = median([b[name] / a[name] for a, b in zip(per[lo], per[hi]) if a[name]])
            lines.append(f"{row:<12} {name:<18} " + " ".join(f"{m:>8.1f}" for m in med) + f"   {ratio:>5.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
