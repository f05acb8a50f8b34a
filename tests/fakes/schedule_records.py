"""Step records of seeded workloads on the sim backend, to prove a scheduler change keeps the schedule.

`python tests/fakes/schedule_records.py OUT.json.gz` records every case below on the tree it runs
in; tests/test_engine_schedule_frozen.py replays the same cases on the current tree and compares
every step with the records captured from commit 71b425a (before the host-overhead work).

Only the public engine API is used, and nothing depends on time: requests are added at given
step numbers (not at clock times), num_blocks and max_model_len are fixed, and the sim's tokens
are a function of (request, position). So the records depend on scheduling logic alone, not on
the sim's cost model. Each step keeps its batch as flat ints (small cases) and a digest of the
rest of the step event: queues, admission verdict, preemptions, block deltas, sampled and
finished requests, KV counters, prefix hits and swaps (times left out).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import sys

# name, engine settings, workload: (requests, arrival steps spread, prompt range, output range,
# shared prefix tokens (0: none), priority levels)
CASES: list[tuple[str, dict, dict]] = [
    ("chunked-fcfs-tight", dict(mode="chunked", num_blocks=96, max_num_seqs=12, max_num_batched_tokens=96),
     dict(n=40, spread=60, prompt=(4, 200), output=(1, 60))),
    ("continuous-fcfs-tight", dict(mode="continuous", num_blocks=96, max_num_seqs=12, max_num_batched_tokens=256),
     dict(n=40, spread=60, prompt=(4, 200), output=(1, 60))),
    ("naive", dict(mode="naive", num_blocks=64, max_num_batched_tokens=64),
     dict(n=12, spread=20, prompt=(4, 150), output=(1, 20))),
    ("static", dict(mode="static", num_blocks=120, max_num_seqs=8, max_num_batched_tokens=512),
     dict(n=30, spread=40, prompt=(4, 120), output=(1, 50))),
    ("chunked-sjf", dict(mode="chunked", policy="sjf", num_blocks=80, max_num_seqs=10, max_num_batched_tokens=64),
     dict(n=36, spread=50, prompt=(4, 160), output=(1, 60))),
    ("chunked-priority", dict(mode="chunked", policy="priority", num_blocks=80, max_num_seqs=6,
                              max_num_batched_tokens=128),
     dict(n=36, spread=50, prompt=(4, 160), output=(1, 60), priorities=(0, 1, 2))),
    ("continuous-priority-swap", dict(mode="continuous", policy="priority", preemption="swap", swap_space=0.03,
                                      num_blocks=70, max_num_seqs=8, max_num_batched_tokens=256),
     dict(n=30, spread=40, prompt=(4, 160), output=(1, 60), priorities=(0, 3))),
    ("chunked-prefix", dict(mode="chunked", prefix_caching=True, num_blocks=90, max_num_seqs=10,
                            max_num_batched_tokens=80),
     dict(n=40, spread=60, prompt=(1, 90), output=(1, 50), shared=70, repeat=0.3)),
    ("chunked-prefix-swap", dict(mode="chunked", prefix_caching=True, preemption="swap", swap_space=0.02,
                                 num_blocks=60, max_num_seqs=12, max_num_batched_tokens=100, block_size=8),
     dict(n=40, spread=40, prompt=(1, 120), output=(1, 60), shared=40, repeat=0.2)),
    ("chunked-swap-bs32", dict(mode="chunked", preemption="swap", swap_space=0.04, num_blocks=30, block_size=32,
                               max_num_seqs=16, max_num_batched_tokens=200),
     dict(n=40, spread=30, prompt=(4, 200), output=(1, 80))),
    ("continuous-max-model-len", dict(mode="continuous", num_blocks=200, max_model_len=96, max_num_seqs=16,
                                      max_num_batched_tokens=200),
     dict(n=30, spread=20, prompt=(4, 90), output=(1, 90))),
    # the host-overhead shape, smaller: many running decodes, everything at step 0
    ("chunked-wide", dict(mode="chunked", num_blocks=4000, max_num_seqs=96, max_num_batched_tokens=1024),
     dict(n=200, spread=0, prompt=(16, 300), output=(8, 160), digest_batch=True)),
]

MODEL = dict(backend="sim", model="qwen3-0.6b", gpu="h200", seed=0)


def workload(spec: dict, vocab: int, seed: int) -> list[tuple[int, list[int], int, int]]:
    """(arrival step, prompt, max_tokens, priority), sorted by arrival step."""
    rng = random.Random(f"schedule-records/{seed}")
    shared = [rng.randrange(1, vocab - 1) for _ in range(spec.get("shared", 0))]
    out = []
    for _ in range(spec["n"]):
        prompt = [rng.randrange(1, vocab - 1) for _ in range(rng.randint(*spec["prompt"]))]
        if shared and rng.random() < 0.8:
            prompt = shared + prompt
        if out and rng.random() < spec.get("repeat", 0.0):
            # a whole earlier prompt, cut to full blocks: its last cached block is copied on write
            again = rng.choice(out)[1]
            prompt = list(again[: len(again) // 16 * 16] or again)
        step = rng.randint(0, spec["spread"])
        out.append((step, prompt, rng.randint(*spec["output"]), rng.choice(spec.get("priorities", (0,)))))
    out.sort(key=lambda r: r[0])
    return out


class _Capture:
    def __init__(self) -> None:
        self.steps: list = []

    def publish(self, event) -> None:
        if type(event).__name__ == "StepEvent":
            self.steps.append(event)


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, separators=(",", ":")).encode()).hexdigest()[:16]


def step_record(ev, digest_batch: bool) -> list:
    batch = [x for b in ev.batch for x in (b.req, 0 if b.kind == "prefill" else 1, b.tokens, b.start)]
    kv = ev.kv
    rest = [
        ev.step, ev.budget, ev.padding, list(ev.running), list(ev.waiting), list(ev.preempted), list(ev.swapped),
        [ev.admission.verdict, ev.admission.reason, ev.admission.req],
        [[p.req, p.reason, p.mode] for p in ev.preemptions],
        [[a.block, a.req] for a in ev.alloc], sorted(ev.freed), [[r.block, r.refcount] for r in ev.refs],
        list(ev.sampled), [f.req for f in ev.first_tokens], [i.req for i in ev.itl],
        [[f.req, f.output_len, f.reason] for f in ev.finished],
        [kv.total, kv.used, kv.free, kv.cached, kv.shared, kv.token_slots, kv.tail_waste, kv.reserve_waste,
         kv.hit_tokens, kv.query_tokens, kv.cow_copies, kv.swap_total, kv.swap_used],
        [[h.req, h.tokens, h.blocks] for h in ev.hits], [[s.req, s.direction, s.blocks] for s in ev.swaps],
    ]
    return [_digest(batch) if digest_batch else batch, _digest(rest)]


def run_case(settings: dict, spec: dict, seed: int = 0, keep: list | None = None) -> list[list]:
    """Each step's record; ``keep``: a list that also gets the StepEvents themselves."""
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.sampling_params import SamplingParams

    config = EngineConfig(**{**MODEL, "max_model_len": 4096, **settings})
    engine = LLMEngine(config)
    sink = _Capture()
    engine.attach(sink)
    pending = workload(spec, engine.loaded.vocab_size, seed)
    i = step = 0
    while i < len(pending) or engine.has_unfinished():
        while i < len(pending) and pending[i][0] <= step:
            _, prompt, max_tokens, priority = pending[i]
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority)
            i += 1
        engine.step()
        step += 1
    if keep is not None:
        keep.extend(sink.steps)
    return [step_record(ev, spec.get("digest_batch", False)) for ev in sink.steps]


def record_all() -> dict:
    return {name: run_case(settings, spec) for name, settings, spec in CASES}


if __name__ == "__main__":
    records = record_all()
    with gzip.open(sys.argv[1], "wt", encoding="utf-8") as f:
        json.dump(records, f, separators=(",", ":"))
    print({k: len(v) for k, v in records.items()})
