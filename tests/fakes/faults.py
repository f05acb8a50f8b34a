"""Faults injected into one request of a real engine: a sampler that cannot sample it, a forward
that raises whenever it is in the batch. Everything else about the engine is real."""

from __future__ import annotations

from kvscope.engine.worker.sampler import Sampler


class FaultySampler(Sampler):
    """Raises while sampling the rows of the given requests (they must be non-greedy to get here)."""

    def __init__(self, seed: int, fail_req_ids: set[int]) -> None:
        super().__init__(seed)
        self.fail_req_ids = fail_req_ids

    def _sample_row(self, req_id, logits, p, banned):
        if req_id in self.fail_req_ids:
            raise RuntimeError(f"injected sampler fault for request {req_id}")
        return super()._sample_row(req_id, logits, p, banned)


def fail_forward_for(runner, fail_req_ids: set[int]) -> list[int]:
    """Make runner's forward raise whenever one of fail_req_ids is in the step; returns a list that
    records the size of every forward that ran (failed ones included)."""
    sizes: list[int] = []
    forward = runner._forward

    def faulty(out):
        sizes.append(out.num_seqs)
        if any(s.req_id in fail_req_ids for s in out.seqs):
            raise RuntimeError("injected forward fault")
        return forward(out)

    runner._forward = faulty
    return sizes
