"""Fills each knob's baseline and predicted figures by re-running the trace's requests in the sim.

A sim trace replays with its own settings (deterministic: the baseline should equal
the trace). A model-backend trace is calibrated first (kvscope.analysis.calibrate
fits the sim's efficiencies to its steps), and the report says so. A long trace
replays its first requests only, as many as fit ``MAX_WHATIF_STEPS`` sim steps, so
a 160k-step trace still answers in seconds; the report names how many.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvscope.analysis.figures import RunFigures
from kvscope.goodput import NO_SLO, Slo
from kvscope.analysis.knobs import Knob
from kvscope.analysis.whatif import ReplayRequest, TraceRequests, run_sim, sim_settings

MAX_WHATIF_STEPS = 20_000  # sim steps one replay may plan for (estimated from the trace's steps per request)
RUNAWAY_FACTOR = 6  # a replay stops after this many times the trace's steps per request
BUILTIN_POLICIES = ("fcfs", "sjf", "priority")
FLAG_KEYS = {"--max-num-seqs": "max_num_seqs", "--max-num-batched-tokens": "max_num_batched_tokens",
             "--num-blocks": "num_blocks", "--gpu-memory-utilization": "gpu_memory_utilization",
             "--mode": "mode", "--policy": "policy", "--preemption": "preemption",
             "--prefix-caching": "prefix_caching", "--kv-cache-dtype": "kv_cache_dtype", "--tp": "tp",
             "--long-prefill-token-threshold": "long_prefill_token_threshold"}  # vLLM's scheduler only
RESIZES = ("--gpu-memory-utilization", "--kv-cache-dtype", "--tp")  # knobs that change how many blocks fit


class WhatIf(msgspec.Struct, kw_only=True):
    ran: bool
    note: str
    calibrated: bool = False
    calibration: dict | None = None  # fitted efficiencies, fit quality
    caution: str = ""  # why the predictions deserve less trust than usual (a loose calibration), or ""
    requests: int = 0  # requests replayed
    of_requests: int = 0  # requests in the trace
    trace: RunFigures | None = None  # the trace's own figures over the replayed requests
    baseline: RunFigures | None = None  # the sim's, with the trace's settings
    sim_steps: int = 0
    wall_s: float = 0.0


def _auto_blocks(settings: dict) -> int:
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.kv.budget import num_blocks_for
    from kvscope.engine.sim.backend import SimBackend

    cfg = EngineConfig(**{**settings, "num_blocks": None})
    cfg.validate()
    sim = SimBackend(cfg)
    return num_blocks_for(sim.kv_budget(), sim.kv_block_bytes(cfg.block_size))


def apply_knob(settings: dict, knob: Knob) -> dict:
    key = FLAG_KEYS.get(knob.flag)
    if key is None:
        raise ValueError(f"no what-if for {knob.flag}")
    new = {**settings, key: knob.to}
    if knob.flag in RESIZES and settings.get("num_blocks"):
        # the trace's pool scaled by what the new setting fits against the old (kept if it was set by hand)
        new["num_blocks"] = max(1, round(settings["num_blocks"] * _auto_blocks(new) / _auto_blocks(settings)))
    return new


def _pool_set_by_hand(knobs: list[Knob], settings: dict) -> None:
    """A sim trace whose pool is not what its memory settings give had --num-blocks set by hand, which
    overrides --gpu-memory-utilization: turn that knob into --num-blocks with the blocks it would add."""
    if settings.get("backend") != "sim" or not settings.get("num_blocks"):
        return
    for i, k in enumerate(knobs):
        if k.flag != "--gpu-memory-utilization":
            continue
        try:
            auto = _auto_blocks(settings)
            if auto == settings["num_blocks"]:
                return
            more = apply_knob(settings, k)["num_blocks"]
        except ValueError:  # sizing failed (e.g. the model does not fit): keep the knob as it is
            return
        if more > settings["num_blocks"]:
            knobs[i] = Knob(flag="--num-blocks", from_=settings["num_blocks"], to=more,
                            why=f"the pool was set by hand (--num-blocks); {k.why}, as {k.flag} {k.to} would give")


def _calibrate(tr: TraceRequests, config: dict, steps: list) -> tuple[dict, dict]:
    from kvscope.analysis import calibrate as C
    from kvscope.engine.sim import catalog
    from kvscope.engine.sim.cost import CostModel

    gpu, model = C.resolve_names(config, None, None)
    data = C.TraceData(config, steps, list(tr.requests.values()))
    f = C.fit(data, CostModel(catalog.gpu(gpu), catalog.model(model)))
    eff = {k: float(v) for k, v in f.efficiency.to_dict().items()}
    settings = sim_settings(config, backend_model=model, gpu=gpu, efficiency=eff)
    info = {"gpu": gpu, "model": model, "efficiency": eff, "steps": int(f.steps_used),
            "mean_abs_rel_err": float(f.mean_abs_rel), "r2": float(f.r2)}
    return settings, info


def predict(tr: TraceRequests, config: dict, knobs: list[Knob], trace_steps: int, calib_steps: list | None,
            slo: Slo = NO_SLO) -> WhatIf:
    """Run baseline and one replay per knob; fills knob.baseline / knob.predicted in place."""
    from kvscope.errors import KvscopeError

    n = len(tr.requests)
    if n == 0:
        return WhatIf(ran=False, note="no requests in the trace: nothing to replay")
    policy = config.get("policy")
    if policy not in BUILTIN_POLICIES:
        return WhatIf(ran=False, note=f"policy {policy!r} is not built in; a trace never names code to import, "
                                      "so the what-if does not run it")
    calibrated, calibration = False, None
    try:
        if config.get("backend") == "sim":
            settings = sim_settings(config)
        else:
            settings, calibration = _calibrate(tr, config, calib_steps or [])
            calibrated = True
    except (ValueError, KvscopeError) as e:
        return WhatIf(ran=False, note=f"cannot calibrate the sim to this trace: {e}")
    per_req = max(1.0, trace_steps / n)
    count = n if trace_steps <= MAX_WHATIF_STEPS else max(1, int(MAX_WHATIF_STEPS / per_req))
    reqs: list[ReplayRequest] = tr.replay_requests(0, count)
    cap = int(RUNAWAY_FACTOR * per_req * count) + 1000
    try:
        base = run_sim(reqs, settings, max_steps=cap, slo=slo)
    except KvscopeError as e:
        return WhatIf(ran=False, note=f"the sim cannot run this trace's settings: {e}")
    steps, wall = base.steps, base.wall_s
    _pool_set_by_hand(knobs, settings)
    for k in knobs:
        k.baseline = base.figures
        try:
            run = run_sim(reqs, apply_knob(settings, k), max_steps=cap, slo=slo)
        except (ValueError, KvscopeError):
            continue  # no prediction for this knob (e.g. the model no longer fits)
        k.predicted = run.figures
        steps += run.steps
        wall += run.wall_s
    what = "sim trace replayed with its own settings" if not calibrated else (
        f"model-backend trace: calibrated the sim ({calibration['model']} on {calibration['gpu']}, "
        f"step-time error {calibration['mean_abs_rel_err']:.0%}) before replaying")
    part = f"all {n} requests" if count == n else f"the first {count} of {n} requests (to bound the replay)"
    caution = ""
    if calibration is not None:
        from kvscope.analysis.calibrate import fit_caution

        caution = fit_caution(calibration["mean_abs_rel_err"], calibration["r2"])
    return WhatIf(ran=True, note=f"{what}; replayed {part}", calibrated=calibrated, calibration=calibration,
                  caution=caution,
                  requests=count, of_requests=n, trace=tr.figures({r.req for r in reqs}, slo), baseline=base.figures,
                  sim_steps=steps, wall_s=wall)


def knob_settings(config: dict, knob: Knob) -> dict[str, Any]:
    """EngineConfig settings of the trace with one knob applied (for a real re-run)."""
    return apply_knob(sim_settings(config), knob)
