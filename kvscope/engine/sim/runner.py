"""SimRunner: the ModelRunner stand-in. Same run() interface; it prices the step and moves the clock.

Tokens are fake but deterministic: a hash of (request, position), never the EOS id,
so generation ends only at max_tokens (or max_model_len) as with ignore_eos.
"""

from __future__ import annotations

from types import SimpleNamespace

from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.sched.output import SchedulerOutput
from kvscope.engine.sim.cost import CostModel, StepShape


class SimRunner:
    ops = SimpleNamespace(name="sim-cost-model")

    def __init__(self, cost: CostModel, clock, vocab_size: int, eos_token_id: int) -> None:
        self.cost = cost
        self.clock = clock
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.steps = 0
        self.busy_s = 0.0  # virtual time spent computing
        self.terms_log: list | None = None  # set to a list to keep every step's StepTerms (anchor fitting)

    @staticmethod
    def shape(out: SchedulerOutput) -> StepShape:
        # StepShape.add, summed inline: this runs over every scheduled sequence every step
        d = out.decodes
        positions = sum(d.positions)
        tokens = sampled = len(d)
        kv_tokens = pairs = positions + len(d)  # one token at position p: p + 1 keys, p + 1 pairs
        for seq in out.other_seqs:
            n = len(seq.token_ids)
            start = seq.start_pos
            tokens += n
            sampled += seq.sample
            kv_tokens += start + n
            pairs += n * start + n * (n + 1) // 2
        for n in out.pad_rows:
            tokens += n
            kv_tokens += n
            pairs += n * (n + 1) // 2
        return StepShape(tokens=tokens, sampled=sampled, kv_tokens=kv_tokens, pairs=pairs,
                         seqs=out.num_seqs + len(out.pad_rows))

    def token(self, req_id: int, pos: int) -> int:
        t = (req_id * 1_000_003 + pos * 7_919 + 12_345) % (self.vocab_size - 1)
        return t if t < self.eos_token_id else t + 1  # skip the EOS id

    def run(self, out: SchedulerOutput, params: dict[int, SamplingParams]) -> dict[int, int]:
        if out.is_empty:
            return {}
        shape = self.shape(out)
        dt = self.cost.step_time(shape)
        if self.terms_log is not None and shape.tokens:
            self.terms_log.append(self.cost.terms(shape))
        self.steps += 1
        self.busy_s += dt
        self.clock.advance(dt)
        # self.token(), inline
        mod, eos = self.vocab_size - 1, self.eos_token_id
        sampled = {}
        for r, p in zip(out.decodes.req_ids, out.decodes.positions):
            t = (r * 1_000_003 + (p + 1) * 7_919 + 12_345) % mod
            sampled[r] = t if t < eos else t + 1
        for s in out.other_seqs:
            if s.sample:
                t = (s.req_id * 1_000_003 + (s.start_pos + len(s.token_ids)) * 7_919 + 12_345) % mod
                sampled[s.req_id] = t if t < eos else t + 1
        return sampled
