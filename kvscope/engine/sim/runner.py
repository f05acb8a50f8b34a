"""SimRunner: the ModelRunner stand-in. Same run() interface; it prices the step and moves the clock.

Tokens are fake but deterministic: a hash of (request, position), never the EOS id,
so generation ends only at max_tokens (or max_model_len) as with ignore_eos.
"""

from __future__ import annotations

from types import SimpleNamespace

from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.scheduler_output import SchedulerOutput
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
        s = StepShape()
        for seq in out.seqs:
            s.add(len(seq.token_ids), seq.start_pos, seq.sample)
        for n in out.pad_rows:
            s.add(n, 0, False)
        return s

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
        return {s.req_id: self.token(s.req_id, s.start_pos + len(s.token_ids))
                for s in out.seqs if s.sample}
