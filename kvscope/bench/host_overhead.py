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

`kvscope bench --device null` is the same bench: the device is left out, the host is all that runs.

Beside each row, in the same run and on the same requests: vLLM's own V1 scheduler (its
`schedule()` and `update_from_output()`, the classes vLLM 0.33 runs; docs/VLLM_SCHEDULER.md),
driven by the same no-compute loop, timed alone. That is what vLLM's engine core costs per step
before its model runner builds inputs, so kvscope's whole step within a small multiple of it is
the mark. The column is left out where vLLM is not installed.
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


class _Timed:
    """Wraps one of vLLM's scheduler methods on its instance, adding the CPU time of each call to `spent`."""

    def __init__(self, obj, name: str) -> None:
        self.inner = getattr(obj, name)
        self.spent = 0.0
        setattr(obj, name, self)

    def __call__(self, *args, **kwargs):
        t = time.process_time()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.spent += time.process_time() - t


def vllm_available() -> bool:
    from kvscope.vllm.inproc.core import VllmMissing, require_vllm

    try:
        require_vllm()
    except VllmMissing:
        return False
    return True


def _engine(running: int, scheduler: str = "kvscope"):
    import torch

    from kvscope.engine.config import EngineConfig
    from kvscope.engine.worker.inputs import InputBuilder
    from kvscope.engine.llm_engine import LLMEngine

    config = EngineConfig(backend="sim", model="qwen3-0.6b", gpu="h200", mode="chunked", max_num_seqs=running,
                          max_num_batched_tokens=BUDGET, seed=0, scheduler=scheduler)
    engine = LLMEngine(config)
    builder = InputBuilder(config.block_size, engine.num_blocks, 0, torch.device("cpu"))
    engine.runner = NoComputeRunner(engine.runner, builder)
    return engine


def _serve(engine, running: int, seed: int, on_step=None) -> tuple[list[tuple[bool, float]], float]:
    """Serve `running` requests at t=0 to the end: (all `running` decoding, CPU seconds) per step, and wall time.
    on_step() is called after each step and its number is kept in place of the step's own time."""
    from kvscope.engine.sampling_params import SamplingParams

    engine.attach(_DropSink())
    rng = Random(f"kvscope.host-overhead/{seed}")
    vocab = engine.loaded.vocab_size
    for _ in range(running):
        prompt = [rng.randrange(vocab - 1) for _ in range(rng.randint(64, 192))]
        engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(128, 256), ignore_eos=True), arrival=0.0)
    steps: list[tuple[bool, float]] = []
    wall = time.perf_counter()
    while engine.has_unfinished():
        t = time.process_time()
        engine.step()
        dt = time.process_time() - t
        out = engine.runner.last
        decoding = len(out.seqs) == running and not any(s.is_prefill for s in out.seqs)
        steps.append((decoding, on_step() if on_step else dt))
    return steps, time.perf_counter() - wall


def measure_steps(running: int, seed: int = 0) -> dict:
    """Serve `running` requests at t=0; CPU time of every step, summarised over the full decode steps."""
    steps, wall = _serve(_engine(running), running, seed)
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


def measure_vllm_scheduler(running: int, seed: int = 0) -> dict:
    """The same requests under vLLM's own scheduler (`--scheduler vllm`): the CPU time of its
    schedule() and update_from_output() alone in each step, over the steps that decode all of them."""
    engine = _engine(running, scheduler="vllm")
    vllm = engine.scheduler.vllm
    timers = [_Timed(vllm, "schedule"), _Timed(vllm, "update_from_output")]
    last = [0.0]

    def spent_this_step() -> float:
        total = sum(t.spent for t in timers)
        dt, last[0] = total - last[0], total
        return dt

    steps, _ = _serve(engine, running, seed, on_step=spent_this_step)
    full = [dt for decoding, dt in steps if decoding]
    vllm_s = statistics.median(full) if full else None
    return {"running": running, "steps": len(steps), "full_decode_steps": len(full),
            "vllm_ms_per_step": None if vllm_s is None else vllm_s * 1e3}


def _decode_step(n: int = 256, context: int = 1000, bs: int = 16):
    from kvscope.engine.sched.output import SchedulerOutput

    out = SchedulerOutput(step=1, budget=BUDGET)
    out.tables_grow_in_place = True  # as the scheduler hands them: the builder keeps the tables' rows
    blocks = -(-(context + 1) // bs)
    d = out.decodes
    for r in range(n):
        d.req_ids.append(r), d.positions.append(context), d.token_ids.append(r + 1)
        d.block_tables.append(list(range(r * blocks, (r + 1) * blocks)))
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


def run_host_overhead(running: tuple[int, ...] | None = None, log=None, vllm: bool | None = None) -> dict:
    """vllm: add vLLM's scheduler column (None: where vLLM is installed)."""
    vllm = vllm_available() if vllm is None else vllm
    rows = []
    for n in running or RUNNING:
        if log:
            log(f"[bench host-overhead] {n} running ...")
        row = measure_steps(n)
        if vllm:
            if log:
                log(f"[bench host-overhead] {n} running, vLLM's scheduler ...")
            v = measure_vllm_scheduler(n)
            row["vllm_ms_per_step"] = v["vllm_ms_per_step"]
            row["vllm_steps"] = v["steps"]
            ours, theirs = row["host_ms_per_step"], v["vllm_ms_per_step"]
            row["over_vllm"] = ours / theirs if ours and theirs else None
        rows.append(row)
    return {
        "bench": "host-overhead",
        "backend": "sim (no compute): qwen3-0.6b on h200, inputs built on CPU, events built and dropped",
        "budget": BUDGET,
        "host": {"python": platform.python_version(), "machine": platform.machine(), "cpu": _cpu_name()},
        "vllm": _vllm_version() if vllm else None,
        "rows": rows,
        "inputs": measure_inputs(),
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _vllm_version() -> str | None:
    from kvscope.vllm.inproc.core import vllm_version

    return vllm_version()


def format_table(result: dict) -> str:
    vllm = result.get("vllm") is not None or any("vllm_ms_per_step" in r for r in result["rows"])
    head = f"{'running':>8} {'steps':>6} {'full':>5} {'ms/step':>8} {'us/req':>7} {'mean ms (all)':>14}"
    if vllm:
        head += f" {'vLLM sched ms':>14} {'x vLLM':>7}"
    lines = ["host time per step (CPU, median over steps with all requests decoding)", head]
    for r in result["rows"]:
        ms = "-" if r["host_ms_per_step"] is None else f"{r['host_ms_per_step']:.3f}"
        us = "-" if r["host_us_per_request"] is None else f"{r['host_us_per_request']:.2f}"
        line = (f"{r['running']:>8} {r['steps']:>6} {r['full_decode_steps']:>5} {ms:>8} {us:>7} "
                f"{r['mean_ms_per_step_all']:>14.3f}")
        if vllm:
            v, x = r.get("vllm_ms_per_step"), r.get("over_vllm")
            line += f" {'-' if v is None else f'{v:.3f}':>14} {'-' if x is None else f'{x:.2f}':>7}"
        lines.append(line)
    if vllm:
        lines.append(f"vLLM sched ms: vLLM {result.get('vllm') or ''}'s own scheduler, schedule() + update_from_output() "
                     "alone, on the same requests; x vLLM: kvscope's whole step over it")
    lines += ["", "input building per step (CPU, median)",
              f"{'case':<30} {'tokens':>6} {'per-token loop':>15} {'vectorized':>11} {'speedup':>8}"]
    for r in result["inputs"]:
        lines.append(f"{r['case']:<30} {r['tokens']:>6} {r['old_us']:>12.0f} us {r['new_us']:>8.0f} us "
                     f"{r['speedup']:>7.1f}x")
    return "\n".join(lines)
