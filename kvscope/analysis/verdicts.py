"""The verdict rules: from Signals, a score per bottleneck, and the figures that decided it.

Each rule compares a few signals with thresholds (docs/DIAGNOSE.md lists them). A
rule's score is its strongest signal divided by that signal's threshold, so a score
of 1 means "at the threshold"; scores are capped at ``CAP`` so that one huge figure
does not outrank a structural cause, and ties go to the earlier rule in ``ORDER``.
The bottleneck is the top rule with a score >= 1; if none fires, ``compute_bound``
when the engine is saturated, else ``underloaded``.
"""

from __future__ import annotations

from typing import Callable

import msgspec

from kvscope.analysis.signals import Signals

KV_CAPACITY, MAX_NUM_SEQS, TOKEN_BUDGET = "kv_capacity", "max_num_seqs", "token_budget"
PREFILL_INTERFERENCE, BATCHING_MODE, POLICY_STARVATION = "prefill_interference", "batching_mode", "policy_starvation"
COMPUTE_BOUND, UNDERLOADED = "compute_bound", "underloaded"
BOTTLENECKS = (KV_CAPACITY, MAX_NUM_SEQS, TOKEN_BUDGET, PREFILL_INTERFERENCE, BATCHING_MODE, POLICY_STARVATION,
               COMPUTE_BOUND, UNDERLOADED)
ORDER = (BATCHING_MODE, KV_CAPACITY, MAX_NUM_SEQS, TOKEN_BUDGET, PREFILL_INTERFERENCE, POLICY_STARVATION)
CAP = 5.0

# thresholds (docs/DIAGNOSE.md)
BLOCKED_KV_MIN = 0.10  # head of WAITING blocked on kv_blocks in >= 10% of busy steps
RECOMPUTE_MIN = 0.05  # >= 5% of computed tokens recomputed after preemption
PREEMPT_PER_REQ_MIN = 0.05  # >= 1 kv preemption per 20 requests
KV_FULL = 0.90  # pool use p90 at or above this counts as "near full"
BLOCKED_SEQS_MIN = 0.10
BLOCKED_BUDGET_MIN = 0.20
FIXED_SHARE_MIN = 0.40  # a full step must still be >= 40% fixed cost for a bigger budget to pay
QUEUE_STEPS_MIN = 3.0  # queue p50 >= 3 step times: prefill is waiting, not just the next step
# admission-side verdicts (kv_blocks, max_num_seqs, token budget) need requests that actually wait: queue time p99
# at least the ITL p99 (a waiting user loses more than the worst stall a streaming one sees) and 3 step times
WAIT_OVER_ITL_MIN = 1.0
ITL_RATIO_MIN = 3.0  # ITL p99 >= 3 x p50
ITL_TAIL_PREFILL_MIN = 0.6  # and >= 60% of the tail gaps span a prefill
MODE_QUEUED_MIN = 0.10  # naive/static: requests wait in >= 10% of busy steps
PADDING_MIN = 0.10
OVERTAKEN_MIN = 0.05  # >= 5% of requests passed by a later arrival
WAIT_RATIO_MIN = 3.0  # and those wait >= 3x longer (p99) than the rest
FULL_TOKENS = 0.70  # steps are full: >= 70% of the token budget on average,
FULL_RUNNING = 0.50  # or the batch >= half of max_num_seqs,
FULL_KV = 0.80  # or the KV pool >= 80% used on average,
BACKLOG_MIN = 0.20  # with requests waiting in >= 20% of busy steps (demand above capacity),
FULL_TOKENS_ALONE = 0.90  # unless the steps carry >= 90% of the budget on average


class Evidence(msgspec.Struct, kw_only=True):
    name: str
    value: float | int | None
    threshold: float | int | None
    comparison: str  # ">=", "<", ...
    text: str
    series: str | None = None  # a watched vLLM's: the series the figure came from


class Ruling(msgspec.Struct, kw_only=True):
    bottleneck: str
    score: float
    evidence: list[Evidence]


def _ev(name: str, value, op: str, threshold, text: str) -> Evidence:
    return Evidence(name=name, value=value, threshold=threshold, comparison=op, text=text)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f} ms"


def dur(x: float | None) -> str:
    """A duration in ms under a second, else in s."""
    return "-" if x is None else f"{x:.2f} s" if x >= 1.0 else _ms(x)


def wait_weight(s: Signals) -> float | None:
    """How much requests actually wait, 1 at the threshold: queue time p99 (p50 where only that is known) over the
    larger of the ITL p99 and QUEUE_STEPS_MIN step times. None when no queue time is known (no weighing then)."""
    q = s.queue_p99 if s.queue_p99 is not None else s.queue_p50
    unit = max(WAIT_OVER_ITL_MIN * (s.itl_p99 or 0.0), QUEUE_STEPS_MIN * (s.step_dur_p50 or 0.0))
    if q is None or unit <= 0:
        return None
    return q / unit


def _weighed(score: float, s: Signals) -> float:
    """An admission score held under 0.5 while the queue times are too short to be what hurts: it then neither
    decides nor adds its knob as a runner-up (knobs.with_runners_up takes those >= 0.5), but still shows."""
    w = wait_weight(s)
    return score if w is None or w >= 1.0 else min(score, 0.45 * w)


def _wait_evidence(s: Signals) -> Evidence:
    w = wait_weight(s)
    q = s.queue_p99 if s.queue_p99 is not None else s.queue_p50
    return _ev("wait_weight", None if w is None else round(w, 2), ">=", 1.0,
               f"queue time p99 {dur(q)} against the larger of ITL p99 {dur(s.itl_p99)} and "
               f"{QUEUE_STEPS_MIN:g} step times ({_ms(s.step_dur_p50)} each): "
               + ("unknown, not weighed" if w is None else f"{w:.2f} (under 1: requests barely wait, so admission "
                  "is not what hurts)" if w < 1 else f"{w:.2f}: requests really wait"))


def _kv(s: Signals, cfg: dict) -> Ruling:
    # waiting on blocks counts only when requests really wait; preemptions and recompute hurt on their own
    score = max(_weighed(s.blocked_kv / BLOCKED_KV_MIN, s), s.recompute_frac / RECOMPUTE_MIN,
                s.preempted_per_request / PREEMPT_PER_REQ_MIN)
    return Ruling(bottleneck=KV_CAPACITY, score=score, evidence=[
        _ev("blocked_kv_frac", s.blocked_kv, ">=", BLOCKED_KV_MIN,
            f"head of WAITING blocked on kv_blocks in {_pct(s.blocked_kv)} of busy steps"
            f" (threshold {_pct(BLOCKED_KV_MIN)})"),
        _ev("preemptions_kv", s.preemptions_kv, ">=", round(PREEMPT_PER_REQ_MIN * s.requests, 1),
            f"{s.preemptions_kv:,} preemptions for KV blocks over {s.requests:,} requests"
            f" (threshold 1 per {round(1 / PREEMPT_PER_REQ_MIN)})"),
        _ev("recompute_frac", s.recompute_frac, ">=", RECOMPUTE_MIN,
            f"{_pct(s.recompute_frac)} of computed tokens recomputed (threshold {_pct(RECOMPUTE_MIN)})"),
        _ev("kv_use_p90", s.kv_use_p90, ">=", KV_FULL, f"KV pool {_pct(s.kv_use_p90)} used at p90"),
        _wait_evidence(s),
    ])


def _seqs(s: Signals, cfg: dict) -> Ruling:
    score = _weighed(s.blocked_seqs / BLOCKED_SEQS_MIN, s)
    if cfg.get("mode") == "naive":
        score = 0.0  # naive's one-sequence limit is the mode's, judged by batching_mode
    return Ruling(bottleneck=MAX_NUM_SEQS, score=score, evidence=[
        _ev("blocked_seqs_frac", s.blocked_seqs, ">=", BLOCKED_SEQS_MIN,
            f"head of WAITING blocked on max_num_seqs in {_pct(s.blocked_seqs)} of busy steps"
            f" (threshold {_pct(BLOCKED_SEQS_MIN)})"),
        _ev("running_max", s.running_max, "==", cfg.get("max_num_seqs"),
            f"batch reached {s.running_max} sequences (max_num_seqs {cfg.get('max_num_seqs')})"),
        _ev("kv_use_p90", s.kv_use_p90, "<", KV_FULL, f"KV pool only {_pct(s.kv_use_p90)} used at p90"),
        _wait_evidence(s),
    ])


def _budget(s: Signals, cfg: dict) -> Ruling:
    score = s.blocked_budget / BLOCKED_BUDGET_MIN
    queue_steps = (s.queue_p50 or 0.0) / s.step_dur_p50 if s.step_dur_p50 else 0.0
    if s.fixed_share is not None and s.fixed_share < FIXED_SHARE_MIN:
        score = min(score, 0.9 * s.fixed_share / FIXED_SHARE_MIN)  # steps at the roofline: budget is no lever
    if queue_steps < QUEUE_STEPS_MIN:
        score = min(score, 0.9 * queue_steps / QUEUE_STEPS_MIN)
    score = _weighed(score, s)
    if s.kv_use_p90 >= KV_FULL:
        score *= 0.5
    share = "-" if s.fixed_share is None else _pct(s.fixed_share)
    return Ruling(bottleneck=TOKEN_BUDGET, score=score, evidence=[
        _ev("blocked_budget_frac", s.blocked_budget, ">=", BLOCKED_BUDGET_MIN,
            f"head of WAITING blocked on the token budget in {_pct(s.blocked_budget)} of busy steps"
            f" (threshold {_pct(BLOCKED_BUDGET_MIN)})"),
        _ev("queue_p50_steps", round(queue_steps, 1), ">=", QUEUE_STEPS_MIN,
            f"queue time p50 {_ms(s.queue_p50)} = {queue_steps:.1f} step times (threshold {QUEUE_STEPS_MIN:g})"),
        _ev("fixed_share", s.fixed_share, ">=", FIXED_SHARE_MIN,
            f"{share} of a full step's time is fixed cost, so bigger steps amortize it"
            f" (threshold {_pct(FIXED_SHARE_MIN)})"),
        _ev("kv_use_p90", s.kv_use_p90, "<", KV_FULL, f"KV pool {_pct(s.kv_use_p90)} used at p90"),
        _wait_evidence(s),
    ])


def _prefill(s: Signals, cfg: dict) -> Ruling:
    ratio = (s.itl_p99 / s.itl_p50) if s.itl_p99 and s.itl_p50 else 0.0
    share = s.itl_tail_prefill_share or 0.0
    score = min(ratio / ITL_RATIO_MIN, share / ITL_TAIL_PREFILL_MIN) if share else 0.0
    if cfg.get("mode") in ("naive", "static"):
        score = 0.0
    return Ruling(bottleneck=PREFILL_INTERFERENCE, score=score, evidence=[
        _ev("itl_p99_over_p50", round(ratio, 2), ">=", ITL_RATIO_MIN,
            f"ITL p99 {_ms(s.itl_p99)} = {ratio:.1f}x p50 {_ms(s.itl_p50)} (threshold {ITL_RATIO_MIN:g}x)"),
        _ev("itl_tail_prefill_share", s.itl_tail_prefill_share, ">=", ITL_TAIL_PREFILL_MIN,
            f"{_pct(share)} of the ITL gaps above p99 span a step that ran prefill"
            f" (threshold {_pct(ITL_TAIL_PREFILL_MIN)})"),
        _ev("prefill_step_dur_p99", s.prefill_step_dur_p99, ">", s.decode_step_dur_p99,
            f"steps with prefill take {_ms(s.prefill_step_dur_p99)} at p99, decode-only steps"
            f" {_ms(s.decode_step_dur_p99)}"),
    ])


def _mode(s: Signals, cfg: dict) -> Ruling:
    mode = cfg.get("mode")
    score = 0.0
    if mode in ("naive", "static"):
        score = max(s.queued_frac / MODE_QUEUED_MIN, s.padding_frac / PADDING_MIN) * CAP
    what = "one sequence at a time" if mode == "naive" else "batches that admit only when the last one ends"
    return Ruling(bottleneck=BATCHING_MODE, score=score, evidence=[
        _ev("mode", None, "in", None, f"mode {mode}: {what}"),
        _ev("queued_frac", s.queued_frac, ">=", MODE_QUEUED_MIN,
            f"requests waiting in {_pct(s.queued_frac)} of busy steps (threshold {_pct(MODE_QUEUED_MIN)})"),
        _ev("padding_frac", s.padding_frac, ">=", PADDING_MIN,
            f"{_pct(s.padding_frac)} of computed tokens are padding (threshold {_pct(PADDING_MIN)})"),
    ])


def _policy(s: Signals, cfg: dict) -> Ruling:
    ratio = s.wait_ratio or 0.0
    score = min(s.overtaken_frac / OVERTAKEN_MIN, ratio / WAIT_RATIO_MIN) if ratio else 0.0
    return Ruling(bottleneck=POLICY_STARVATION, score=score, evidence=[
        _ev("overtaken_frac", s.overtaken_frac, ">=", OVERTAKEN_MIN,
            f"{_pct(s.overtaken_frac)} of requests were passed by a later arrival under policy"
            f" {cfg.get('policy')} (threshold {_pct(OVERTAKEN_MIN)})"),
        _ev("wait_ratio", None if s.wait_ratio is None else round(s.wait_ratio, 2), ">=", WAIT_RATIO_MIN,
            f"their queue time p99 is {ratio:.1f}x that of the others (threshold {WAIT_RATIO_MIN:g}x)"),
    ])


RULES: dict[str, Callable[[Signals, dict], Ruling]] = {
    BATCHING_MODE: _mode, KV_CAPACITY: _kv, MAX_NUM_SEQS: _seqs, TOKEN_BUDGET: _budget,
    PREFILL_INTERFERENCE: _prefill, POLICY_STARVATION: _policy,
}


def saturation(s: Signals) -> Ruling:
    """No rule fired: compute_bound when the steps are full (the step time is then the roofline's, as the
    sim's cost model or a calibration prices it), else underloaded."""
    full = s.tokens_fill >= FULL_TOKENS or s.running_mean >= FULL_RUNNING or s.kv_use_mean >= FULL_KV
    saturated = (full and s.queued_frac >= BACKLOG_MIN) or s.tokens_fill >= FULL_TOKENS_ALONE
    evidence = [
        _ev("tokens_fill", round(s.tokens_fill, 3), ">=", FULL_TOKENS,
            f"steps carry {_pct(s.tokens_fill)} of the token budget on average (threshold {_pct(FULL_TOKENS)})"),
        _ev("running_mean", round(s.running_mean, 3), ">=", FULL_RUNNING,
            f"batch holds {_pct(s.running_mean)} of max_num_seqs on average (threshold {_pct(FULL_RUNNING)})"),
        _ev("kv_use_mean", round(s.kv_use_mean, 3), ">=", FULL_KV,
            f"KV pool {_pct(s.kv_use_mean)} used on average (threshold {_pct(FULL_KV)})"),
        _ev("queued_frac", round(s.queued_frac, 3), ">=", BACKLOG_MIN,
            f"requests waiting in {_pct(s.queued_frac)} of busy steps (threshold {_pct(BACKLOG_MIN)}),"
            " and no admission rule fired"),
    ]
    if saturated:
        evidence.append(_ev("fixed_share", s.fixed_share, "<", FIXED_SHARE_MIN,
                            f"fixed cost is {'-' if s.fixed_share is None else _pct(s.fixed_share)} of a full step"
                            f" (under {_pct(FIXED_SHARE_MIN)}): its time is the work in it"))
        return Ruling(bottleneck=COMPUTE_BOUND, score=1.0, evidence=evidence)
    return Ruling(bottleneck=UNDERLOADED, score=1.0, evidence=evidence)


def rule(s: Signals, cfg: dict) -> tuple[Ruling, list[Ruling]]:
    """The deciding ruling and the runners-up (score >= 0.3, best first)."""
    rulings = [RULES[name](s, cfg) for name in ORDER]
    for r in rulings:
        r.score = min(CAP, r.score)
    ranked = sorted(rulings, key=lambda r: (-r.score, ORDER.index(r.bottleneck)))
    if ranked[0].score >= 1.0:
        return ranked[0], [r for r in ranked[1:] if r.score >= 0.3]
    return saturation(s), [r for r in ranked if r.score >= 0.3]
