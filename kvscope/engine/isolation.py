"""One request's failure ends that request only: the others in its step go on, token-exact.

A row that cannot be sampled is reported by the runner (`runner.failures`). A forward that
raises (building the inputs or running the model) cannot say which request broke it, so
the step's sequences are run again in halves until the failing ones are found alone; KV
writes are idempotent (the same tokens at the same positions), so re-running a sequence
computes exactly what the failed step would have. Each failing request then finishes
with reason "error" and its message in `Request.error`.
"""

from __future__ import annotations

from kvscope.engine.sched.output import SchedulerOutput
from kvscope.protocol.events import FINISH_ERROR

MAX_ERROR_CHARS = 500  # a message kept for the client (an exception text can be huge)


def describe(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def run_isolated(runner, out: SchedulerOutput, params) -> tuple[dict[int, int], dict[int, str]]:
    """runner.run(out), with failures pinned on requests instead of raised: (sampled, failures)."""
    try:
        sampled = runner.run(out, params)
    except Exception as e:  # noqa: BLE001 - isolate it below
        return _bisect(runner, out, params, describe(e))
    return sampled, dict(getattr(runner, "failures", None) or {})


def _bisect(runner, out: SchedulerOutput, params, why: str) -> tuple[dict[int, int], dict[int, str]]:
    seqs = out.seqs
    if len(seqs) <= 1:
        return {}, {s.req_id: f"the model step failed: {why}" for s in seqs}
    sampled: dict[int, int] = {}
    failures: dict[int, str] = {}
    half = len(seqs) // 2
    for part in (seqs[:half], seqs[half:]):
        sub = _subset(out, part)
        try:
            sampled.update(runner.run(sub, params))
            failures.update(getattr(runner, "failures", None) or {})
        except Exception as e:  # noqa: BLE001
            more_sampled, more_failed = _bisect(runner, sub, params, describe(e))
            sampled.update(more_sampled)
            failures.update(more_failed)
    return sampled, failures


def _subset(out: SchedulerOutput, seqs) -> SchedulerOutput:
    """The same step with only these sequences (no padding rows, block copies already applied); a decode
    goes in as the general ScheduledSeq it is (the column batch is a scheduler fast path only)."""
    return SchedulerOutput(out.step, out.budget, seqs=list(seqs))


def end_failed(sched, out: SchedulerOutput, failures: dict[int, str], now: float) -> list:
    """Unschedule and end each failed request (reason "error"); returns them."""
    ended = []
    for req_id, why in failures.items():
        out.drop(req_id)  # update() must not look for its token
        req = sched.abort(req_id, now, FINISH_ERROR)
        if req is not None:
            req.error = why
            ended.append(req)
    return ended
