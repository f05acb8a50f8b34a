"""Encode and decode cost per event: the msgspec codec against the one it replaced, in one run.

    python benchmarks/protocol_codec.py [--old-rev a966494] [--json benchmarks/results/protocol-codec.json]

The old codec (hand-written validators over dataclasses) is loaded from git at
``--old-rev`` into a throwaway package, so both run in the same process on the same
bytes. Events: a decode step with 256 running requests shaped like the engine's
(``kvscope.bench.events.synthetic_step``), a step recorded from the sim backend with
the most requests running, and a snapshot of 256 requests with their block tables.
Each figure is the median of 7 rounds; the wire bytes of both codecs are compared
first (they must be identical).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from kvscope.bench.events import synthetic_step
from kvscope.protocol import codec as new
from kvscope.protocol import events as E

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_old(rev: str):
    tmp = tempfile.mkdtemp(prefix="kvscope-oldcodec-")
    pkg = os.path.join(tmp, "oldproto")
    os.makedirs(pkg)
    open(os.path.join(pkg, "__init__.py"), "w").close()
    for name in ("events", "codec"):
        src = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:kvscope/protocol/{name}.py"],
                             check=True, capture_output=True, text=True).stdout
        with open(os.path.join(pkg, f"{name}.py"), "w") as f:
            f.write(src)
    sys.path.insert(0, tmp)
    return importlib.import_module("oldproto.codec")


def snapshot_256() -> E.SnapshotEvent:
    reqs = [E.RequestState(i, E.RUNNING, 600, 128, 640, 40, 0, i * 0.01, 0.25, 0, 0) for i in range(256)]
    tables = {i: list(range(i * 41, i * 41 + 41)) for i in range(256)}
    blocks = [E.BlockOwner(b, i, 1) for i, t in tables.items() for b in t]
    return E.SnapshotEvent(9000, 812.0, reqs, blocks, tables, list(range(256)), list(range(256, 288)), [], [],
                           E.KvCounters(16384, 10496, 5888, 0, 0, 163840, 2000, 0))


def sim_step() -> E.StepEvent:
    """The step with the most requests running in a short sim run (max_num_seqs 256)."""
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.sampling_params import SamplingParams

    class Keep:
        best: E.StepEvent | None = None

        def publish(self, ev) -> None:
            if ev.type == "step" and (self.best is None or len(ev.running) >= len(self.best.running)):
                self.best = ev

        def close(self) -> None:
            pass

    sink = Keep()
    cfg = EngineConfig(backend="sim", model="llama-3.1-8b", gpu="h100-sxm5", max_num_seqs=256,
                       max_num_batched_tokens=2048)
    engine = LLMEngine(cfg, sink=sink)
    for i in range(300):
        engine.add_request([1 + (i % 50)] * 64, SamplingParams(max_tokens=48, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return sink.best


def per_call_us(fns: list, args: list, number: int) -> list[float]:
    """Median per-call time of each fn(arg) over 7 rounds; the fns take turns round by round,
    so a busy machine slows them alike."""
    rounds: list[list[float]] = [[] for _ in fns]
    for _ in range(7):
        for i, (fn, arg) in enumerate(zip(fns, args)):
            t0 = time.perf_counter()
            for _ in range(number):
                fn(arg)
            rounds[i].append((time.perf_counter() - t0) / number * 1e6)
    return [statistics.median(r) for r in rounds]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old-rev", default="a966494")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--number", type=int, default=300)
    args = p.parse_args(argv)
    old = load_old(args.old_rev)
    cases = {"step, 256 running (synthetic_step)": synthetic_step(256), "step, sim engine": sim_step(),
             "snapshot, 256 requests": snapshot_256()}
    rows = []
    for name, ev in cases.items():
        data = new.encode(ev)
        old_ev = old.decode(data)
        assert old.encode(old_ev) == data, f"{name}: wire bytes differ"
        assert new.decode(data) == ev
        n = args.number if ev.type == "step" else max(10, args.number // 20)
        enc_old, enc_new = per_call_us([old.encode, new.encode], [old_ev, ev], n)
        dec_old, dec_new = per_call_us([old.decode, new.decode], [data, data], n)
        row = {
            "event": name,
            "running": len(ev.running),
            "bytes": len(data),
            "encode_us_old": round(enc_old, 1),
            "encode_us_new": round(enc_new, 1),
            "decode_us_old": round(dec_old, 1),
            "decode_us_new": round(dec_new, 1),
        }
        rows.append(row)
    print(f"{'event':36} {'run':>4} {'bytes':>7} {'enc old':>9} {'enc new':>9} {'dec old':>9} {'dec new':>9}  (us)")
    for r in rows:
        print(f"{r['event']:36} {r['running']:>4} {r['bytes']:>7} {r['encode_us_old']:>9.1f} "
              f"{r['encode_us_new']:>9.1f} {r['decode_us_old']:>9.1f} {r['decode_us_new']:>9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"old_rev": args.old_rev, "python": sys.version.split()[0], "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
