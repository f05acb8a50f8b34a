"""`kvscope bench --host-overhead`: what the engine costs on the host per step, with no compute.

A GPU idles while the engine is in Python between forwards, so this bench times one
engine step with a runner that computes nothing: it builds the forward's inputs as the
model runner does (kvscope.engine.worker.inputs), then takes the sim's deterministic tokens.
What is timed is everything else a step does: the scheduler and block manager, input
building, sampling bookkeeping and building the step event (into a sink that drops it).

The workload: N requests at t=0 (prompts 64-192 tokens, outputs 128-256), served by
the sim's Qwen3-0.6B on an H200 with max_num_seqs = N and an 8,192-token budget, so the
decode steps that follow the prefills all run N requests. The figure is the median CPU
time per step over those steps (process time, so other processes on a shared machine
count less); the mean over every step of the run is reported too.

Result files: benchmarks/results/host-overhead.json and .txt (`kvscope bench --host-overhead --json
benchmarks/results/host-overhead.json`). The second table times input building alone, the vectorized builder against the
per-token loop it replaced, on 256 decodes and on one 8,192-token chunked step.
"""

from __future__ import annotations

import platform
import statistics
import time
from random import Random

RUNNING = (64, 256, 1024)
BUDGET = 8192


class NoComputeRunner:
    """The runner interface with the forward left out: inputs are built, tokens come from the sim."""

    def __init__(self, sim_runner, inputs) -> None:
        self.sim = sim_runner
        self.inputs = inputs
        self.ops = sim_runner.ops
        self.last = None  # the last step's SchedulerOutput, for the bench to classify it

    def run(self, out, params):
        self.last = out
        if out.is_empty:
            return {}
        self.inputs.build(out)
        return self.sim.run(out, params)


class _DropSink:
    def publish(self, event) -> None:
        pass


def _engine(running: int):
    import torch

    from kvscope.engine.config import EngineConfig
    from kvscope.engine.worker.inputs import InputBuilder
    from kvscope.engine.llm_engine import LLMEngine

    config = EngineConfig(backend="sim", model="qwen3-0.6b", gpu="h200", mode="chunked", max_num_seqs=running,
                          max_num_batched_tokens=BUDGET, seed=0)
    engine = LLMEngine(config)
    builder = InputBuilder(config.block_size, engine.num_blocks, 0, torch.device("cpu"))
    engine.runner = NoComputeRunner(engine.runner, builder)
    return engine


def measure_steps(running: int, seed: int = 0) -> dict:
    """Serve `running` requests at t=0; CPU time of every step, summarised over the full decode steps."""
    from kvscope.engine.sampling_params import SamplingParams

    engine = _engine(running)
    engine.attach(_DropSink())
    rng = Random(f"kvscope.host-overhead/{seed}")
    vocab = engine.loaded.vocab_size
    for _ in range(running):
        prompt = [rng.randrange(vocab - 1) for _ in range(rng.randint(64, 192))]
        engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(128, 256), ignore_eos=True), arrival=0.0)
    steps: list[tuple[bool, float]] = []  # (all `running` requests decoding, CPU seconds)
    wall = time.perf_counter()
    while engine.has_unfinished():
        t = time.process_time()
        engine.step()
        dt = time.process_time() - t
        out = engine.runner.last
        decoding = len(out.seqs) == running and not any(s.is_prefill for s in out.seqs)
        steps.append((decoding, dt))
    wall = time.perf_counter() - wall
    full = [dt for decoding, dt in steps if decoding]
    host = statistics.median(full) if full else None
    return {
        "running": running,
        "steps": len(steps),
        "full_decode_steps": len(full),
        "host_ms_per_step": None if host is None else host * 1e3,
        "host_us_per_request": None if host is None else host * 1e6 / running,
        "mean_ms_per_step_all": 1e3 * sum(dt for _, dt in steps) / len(steps),
        "wall_s": wall,
    }


def _decode_step(n: int = 256, context: int = 1000, bs: int = 16):
    from kvscope.engine.sched.output import ScheduledSeq, SchedulerOutput

    out = SchedulerOutput(step=1, budget=BUDGET)
    blocks = -(-(context + 1) // bs)
    for r in range(n):
        out.add(ScheduledSeq(r, [r + 1], context, list(range(r * blocks, (r + 1) * blocks)), True, False))
    return out


def _chunked_step(tokens: int = BUDGET, chunk: int = 1024, bs: int = 16):
    from kvscope.engine.sched.output import ScheduledSeq, SchedulerOutput

    out = SchedulerOutput(step=1, budget=BUDGET)
    for r in range(tokens // chunk):
        start = r * chunk  # request r is at its r-th chunk
        blocks = -(-(start + chunk) // bs)
        out.add(ScheduledSeq(r, list(range(chunk)), start, list(range(r * 600, r * 600 + blocks)), True, True))
    return out


def measure_inputs(repeats: int = 30) -> list[dict]:
    """Median CPU time of the per-token loop and of the vectorized builder, alternated in one run."""
    import torch

    from kvscope.engine.worker.inputs import InputBuilder

    builder = InputBuilder(16, 1 << 16, 0, torch.device("cpu"))
    rows = []
    for name, out in (("256 decodes", _decode_step()), ("one 8,192-token chunked step", _chunked_step())):
        old, new = [], []
        for _ in range(repeats):
            for fn, times in ((builder.build_reference, old), (builder.build, new)):
                t = time.process_time()
                fn(out)
                times.append(time.process_time() - t)
        o, n = statistics.median(old), statistics.median(new)
        rows.append({"case": name, "tokens": out.num_tokens, "old_us": o * 1e6, "new_us": n * 1e6,
                     "speedup": o / n if n else None})
    return rows


def run_host_overhead(running: tuple[int, ...] | None = None, log=None) -> dict:
    rows = []
    for n in running or RUNNING:
        if log:
            log(f"[bench host-overhead] {n} running ...")
        rows.append(measure_steps(n))
    return {
        "bench": "host-overhead",
        "backend": "sim (no compute): qwen3-0.6b on h200, inputs built on CPU, events built and dropped",
        "budget": BUDGET,
        "host": {"python": platform.python_version(), "machine": platform.machine()},
        "rows": rows,
        "inputs": measure_inputs(),
    }


def format_table(result: dict) -> str:
    lines = ["host time per step (CPU, median over steps with all requests decoding)",
             f"{'running':>8} {'steps':>6} {'full':>5} {'ms/step':>8} {'us/req':>7} {'mean ms (all)':>14}"]
    for r in result["rows"]:
        ms = "-" if r["host_ms_per_step"] is None else f"{r['host_ms_per_step']:.3f}"
        us = "-" if r["host_us_per_request"] is None else f"{r['host_us_per_request']:.2f}"
        lines.append(f"{r['running']:>8} {r['steps']:>6} {r['full_decode_steps']:>5} {ms:>8} {us:>7} "
                     f"{r['mean_ms_per_step_all']:>14.3f}")
    lines += ["", "input building per step (CPU, median)",
              f"{'case':<30} {'tokens':>6} {'per-token loop':>15} {'vectorized':>11} {'speedup':>8}"]
    for r in result["inputs"]:
        lines.append(f"{r['case']:<30} {r['tokens']:>6} {r['old_us']:>12.0f} us {r['new_us']:>8.0f} us "
                     f"{r['speedup']:>7.1f}x")
    return "\n".join(lines)
