"""How long `kvscope report` takes and how much memory it holds, as traces grow.

    python benchmarks/report_bench.py [--json benchmarks/results/report.json]

Makes a 7.5k-step and a 160k-step sim trace (naive mode: a step per output token), then times
the report of each, and of the shipped 4-run lesson race, each in its own process, reading
that process's peak RSS. Flat memory means the peak does not grow with the steps.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = ("import resource, sys, time; from kvscope.report.page import write_report; t = time.monotonic(); "
         "n = write_report(sys.argv[2:], sys.argv[1]); "
         "print(time.monotonic() - t, n, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")


def sim_trace(path: str, requests: int) -> None:
    if os.path.exists(path):
        return
    subprocess.run([sys.executable, "-m", "kvscope", "serve", "--backend", "sim", "--model", "qwen3-0.6b", "--gpu", "l4",
                    "--mode", "naive", "--workload", "mixed", "--num-requests", str(requests), "--no-progress",
                    "--record", path], check=True, stdout=subprocess.DEVNULL, cwd=ROOT)


def steps_of(paths: list[str]) -> int:
    from kvscope.traces.reader import TraceReader

    return sum(TraceReader(p).summary().steps for p in paths)


def measure(name: str, paths: list[str], out_dir: str) -> dict:
    out = os.path.join(out_dir, f"{name}.html")
    proc = subprocess.run([sys.executable, "-c", CHILD, out, *paths], capture_output=True, text=True, check=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    wall, size, rss_kib = proc.stdout.split()
    return {"input": name, "traces": len(paths), "steps": steps_of(paths), "seconds": round(float(wall), 2),
            "peak_rss_mib": round(int(rss_kib) / 1024, 1), "page_kib": round(int(size) / 1024)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="kvscope-report-bench-")
    small, big = os.path.join(work, "sim-7k.kvtrace"), os.path.join(work, "sim-160k.kvtrace")
    sim_trace(small, 50)
    sim_trace(big, 1070)
    rows = [measure("sim 7.5k steps", [small], work),
            measure("lesson race (4 traces)", sorted(glob.glob(os.path.join(ROOT, "traces/race-lesson/*.kvtrace"))),
                    work),
            measure("sim 160k steps", [big], work)]
    print(f"{'input':<24} {'traces':>6} {'steps':>8} {'seconds':>8} {'peak RSS MiB':>13} {'page KiB':>9}")
    for r in rows:
        print(f"{r['input']:<24} {r['traces']:>6} {r['steps']:>8,} {r['seconds']:>8.1f} {r['peak_rss_mib']:>13.1f} "
              f"{r['page_kib']:>9,}")
    load = os.getloadavg()[0]
    print(f"(load average {load:.1f} on {os.cpu_count()} cores)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "report", "host": platform.node(), "load_avg_1m": load, "started": time.time(),
                       "rows": rows}, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
