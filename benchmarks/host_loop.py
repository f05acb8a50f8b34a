"""The engine's step loop on the host, this checkout against an earlier commit, in one run.

    python benchmarks/host_loop.py [--ref COMMIT] [--running 256 1024] [--rounds 2] [--json FILE]

The sim backend (Qwen3-0.6B on an H200) serves 1,024 requests that all arrive at t=0 (prompts
64-192 tokens, outputs 128-256, greedy, EOS ignored) with max_num_seqs = 256 or 1,024 and an
8,192-token budget; events are built and handed to a sink that drops them. The figure is the
median CPU time of engine.step() over the steps that decode all `running` requests at once.

Each tree runs in its own process (PYTHONPATH set to it), alternating A B A B, so load on a shared
machine falls on both. The number of steps must match: the same schedule, or the comparison says so.

--ref defaults to the engine loop as first written, before its host-overhead pass (the parent of
commit b908221): the loop a faster one is measured against. The ref is exported with `git archive`
into a temporary folder; nothing in the checkout changes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST_LOOP = "6c2716073050df40f341a7ddb9bab51d1bd87427"  # parent of b908221 (the host-overhead pass)

# Run inside each tree: only the API both have (EngineConfig, LLMEngine, add_request, step, attach).
CHILD = r"""
import json, statistics, sys, time
from random import Random
from kvscope.engine.config import EngineConfig
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.sampling_params import SamplingParams

class Drop:
    def publish(self, event):
        pass

running = int(sys.argv[1])
engine = LLMEngine(EngineConfig(backend="sim", model="qwen3-0.6b", gpu="h200", max_num_seqs=running,
                                max_num_batched_tokens=8192, seed=0))
engine.attach(Drop())
rng = Random(0)
vocab = engine.loaded.vocab_size
for _ in range(1024):
    prompt = [rng.randrange(vocab - 1) for _ in range(rng.randint(64, 192))]
    engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(128, 256), ignore_eos=True))
full, steps, total = [], 0, 0.0
while engine.has_unfinished():
    t = time.process_time()
    engine.step()
    dt = time.process_time() - t
    steps += 1
    total += dt
    if len(engine.scheduler.running) == running:
        full.append(dt)
print(json.dumps({"steps": steps, "full_steps": len(full), "total_s": total,
                  "ms_per_step": statistics.median(full) * 1e3 if full else None}))
"""


def export(ref: str, into: str) -> str:
    """The tree of commit `ref` under `into` (git archive: no worktree, nothing in the checkout touched)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
    return into


def run_tree(tree: str, running: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    done = subprocess.run([sys.executable, "-c", CHILD, str(running)], env=env, capture_output=True, text=True,
                          cwd=tree)
    if done.returncode != 0:
        raise SystemExit(f"host_loop: the run in {tree} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ref", default=FIRST_LOOP, help="the commit to compare against (default: the first engine loop)")
    p.add_argument("--running", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--rounds", type=int, default=2, help="A B rounds per load (default 2)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvscope-host-loop-") as tmp:
        ref_tree = export(args.ref, tmp)
        trees = {"ref": ref_tree, "now": str(ROOT)}
        for running in args.running:
            got: dict[str, list[dict]] = {"ref": [], "now": []}
            for r in range(args.rounds):
                order = ("ref", "now") if r % 2 == 0 else ("now", "ref")  # A B, then B A
                for name in order:
                    print(f"[host_loop] {running} running, round {r + 1}: {name}", file=sys.stderr)
                    got[name].append(run_tree(trees[name], running))
            ref_ms = statistics.median(x["ms_per_step"] for x in got["ref"])
            now_ms = statistics.median(x["ms_per_step"] for x in got["now"])
            same = {x["steps"] for x in got["ref"]} == {x["steps"] for x in got["now"]}
            rows.append({"running": running, "ref_ms_per_step": ref_ms, "now_ms_per_step": now_ms,
                         "speedup": ref_ms / now_ms, "steps": got["now"][0]["steps"], "same_steps": same,
                         "runs": got})
    print(f"sim step loop, CPU ms per step (median over steps with all running decoding); ref {args.ref[:12]}")
    print(f"{'running':>8} {'steps':>6} {'ref ms':>8} {'now ms':>8} {'speedup':>8}  schedule")
    for r in rows:
        print(f"{r['running']:>8} {r['steps']:>6} {r['ref_ms_per_step']:>8.3f} {r['now_ms_per_step']:>8.3f} "
              f"{r['speedup']:>7.2f}x  {'same steps' if r['same_steps'] else 'STEPS DIFFER'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"bench": "host-loop", "ref": args.ref, "rows": rows}, indent=1) + "\n")
    return 0 if all(r["same_steps"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
