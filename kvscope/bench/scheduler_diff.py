"""kvscope's scheduler against vLLM's own, decision by decision, on the same requests and flags.

Both run in kvscope's engine (``--scheduler kvscope`` and ``--scheduler vllm``) over the same model,
with requests arriving at the same step numbers. A step is *identical* when both scheduled the same
tokens for the same requests, preempted the same victims and hold the same number of KV blocks.
``python -m kvscope.bench.scheduler_diff`` prints the share of identical steps per workload
(docs/VLLM_SCHEDULER.md).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvscope.engine.config import EngineConfig
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
    name: str
    settings: dict
    arrivals: list[tuple[int, list[int], int]]  # (step, prompt, max_tokens)


@dataclass(frozen=True)
class StepDecision:
    tokens: dict[int, int]  # request -> tokens scheduled
    victims: tuple[int, ...]
    blocks: int  # KV blocks in use after the step

    def differs(self, other: StepDecision) -> list[str]:
        out = []
        if self.tokens != other.tokens:
            out.append("tokens")
        if self.victims != other.victims:
            out.append("victims")
        if self.blocks != other.blocks:
            out.append("blocks")
        return out


@dataclass
class Comparison:
    workload: str
    steps: tuple[int, int]  # (kvscope, vllm)
    identical: int
    first_difference: tuple[int, list[str]] | None = None
    kinds: dict[str, int] = field(default_factory=dict)

    @property
    def share(self) -> float:
        return self.identical / max(self.steps)


class _Sink:
    def __init__(self) -> None:
        self.steps: list = []

    def publish(self, event) -> None:
        if getattr(event, "type", "") == "step" or type(event).__name__ == "StepEvent":
            self.steps.append(event)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


def workloads(seed: int = 0) -> list[Workload]:
    rng = random.Random(seed)
    system = _tokens(rng, 48)
    return [
        Workload("steady chat", dict(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=128),
                 [(2 * i, _tokens(rng, rng.randrange(20, 60)), 16) for i in range(12)]),
        Workload("bursts that preempt", dict(num_blocks=14, max_num_seqs=8, max_num_batched_tokens=96),
                 [(0 if i < 6 else 20, _tokens(rng, rng.randrange(30, 50)), 20) for i in range(10)]),
        Workload("shared prefixes", dict(num_blocks=48, max_num_seqs=8, max_num_batched_tokens=96, prefix_caching=True),
                 [(3 * i, system + _tokens(rng, rng.randrange(5, 20)), 12) for i in range(8)]),
        Workload("long prompts, small budget", dict(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=32),
                 [(0, _tokens(rng, rng.randrange(150, 300)), 8) for _ in range(3)]
                 + [(i, _tokens(rng, rng.randrange(5, 15)), 8) for i in range(1, 5)]),
    ]


def run_steps(scheduler: str, w: Workload, model: str = "tiny", extra_blocks: int = 0) -> list[StepDecision]:
    """The decisions of one scheduler on workload ``w`` (greedy, float32 on the CPU)."""
    sink = _Sink()
    settings = dict(w.settings, num_blocks=w.settings["num_blocks"] + extra_blocks)
    config = EngineConfig(model=model, device="cpu", dtype="float32", scheduler=scheduler, **settings)
    engine = LLMEngine(config, sink=sink)
    pending = sorted(w.arrivals, key=lambda a: a[0])
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prompt, max_tokens = pending.pop(0)
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        engine.step()
        step += 1
    return [StepDecision({b.req: b.tokens for b in s.batch}, tuple(sorted(p.req for p in s.preemptions)), s.kv.used)
            for s in sink.steps]


def compare(w: Workload, model: str = "tiny", null_block: bool = False) -> Comparison:
    """``null_block``: give vLLM one block more, its null block, so both hold the same usable blocks."""
    ours, theirs = run_steps("kvscope", w, model), run_steps("vllm", w, model, extra_blocks=int(null_block))
    result = Comparison(w.name, (len(ours), len(theirs)), 0)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        diff = a.differs(b)
        if not diff:
            result.identical += 1
            continue
        for kind in diff:
            result.kinds[kind] = result.kinds.get(kind, 0) + 1
        if result.first_difference is None:
            result.first_difference = (i + 1, diff)
    return result


def main() -> None:
    print("| workload | vLLM's pool | steps (kvscope / vLLM) | identical steps | first difference (step: what) |")
    print("|---|---|---|---|---|")
    for w in workloads():
        for null_block in (False, True):
            c = compare(w, null_block=null_block)
            first = f"{c.first_difference[0]}: {', '.join(c.first_difference[1])}" if c.first_difference else "none"
            pool = "--num-blocks + 1 (its null block)" if null_block else "--num-blocks"
            print(f"| {c.workload} | {pool} | {c.steps[0]} / {c.steps[1]} | {c.identical} ({c.share:.0%}) | {first} |")


if __name__ == "__main__":
    main()
