"""`kvscope diagnose` for a watched vLLM: a recording (`kvscope record --vllm`) or the live view's state.

vllm_signals reads the scrapes into the same Signals the engine traces give; the verdict
is then kvscope.analysis.verdicts' own rules, the knobs vllm_knobs' (vLLM's flags), and
the result the same ``Diagnosis`` the text report, the JSON and the TUI's diagnosis
screen already render. Only the evidence differs: it names vLLM's series.

The what-if (``what_if=True``) needs the model in the sim catalog (the ``model_name``
label or ``--model``) and the GPU (``--gpu``): it replays a workload shaped like the
observed one (the arrival rate; prompt and output lengths drawn from vLLM's
own length histograms) through the sim, with vLLM's settings, and once per knob.
"""

from __future__ import annotations

import math
import os
import random
from typing import Iterable

from kvscope.vllm.watch.cache import CacheView
from kvscope.analysis.vllm_knobs import CHUNKED_BUDGET, MEASURE_NEXT, choose
from kvscope.vllm.watch.metrics import Scrape
from kvscope.vllm.diagnose.signals import DEFAULT_POLICY, VLLM_SCHEDULING_POLICIES, Reading, VllmFlags, read
from kvscope.analysis import verdicts as V
from kvscope.analysis.diagnose import Diagnosis, NoSteps, Runner, _config_line
from kvscope.analysis.figures import RunFigures
from kvscope.analysis.knobs import Knob
from kvscope.protocol.events import VllmKvEvent, VllmMetricsEvent, VllmSnapshotEvent

MIN_INTERVALS = 8  # fewer busy scrape intervals than this: too little to judge
WHATIF_REQUESTS = 200  # requests one what-if replay runs (the observed rate, vLLM's length histograms)
WHATIF_SEED = 0
# `vllm serve`'s --max-num-seqs on a >= 70 GiB GPU (vllm 0.33 engine/arg_utils.py): the what-if's value when the
# running count only gave a lower bound
SERVE_MAX_NUM_SEQS = 1024
# vLLM flag -> the sim's (kvscope.analysis.predict.FLAG_KEYS) and how its value translates
SIM_FLAGS = {"--max-num-seqs": ("--max-num-seqs", None), "--max-num-batched-tokens": ("--max-num-batched-tokens", None),
             "--gpu-memory-utilization": ("--gpu-memory-utilization", None),
             "--kv-cache-dtype": ("--kv-cache-dtype", None), "--tensor-parallel-size": ("--tp", None),
             "--enable-chunked-prefill": ("--mode", lambda on: "chunked" if on else "continuous"),
             "--scheduling-policy": ("--policy", None),
             "--long-prefill-token-threshold": ("--long-prefill-token-threshold", None)}
# prefix caching: the replayed prompts share nothing


def judge_reading(r: Reading, source: str, window: int | None = None) -> Diagnosis:
    """The verdict over a Reading (no what-if)."""
    s = r.signals
    if s.steps == 0:
        raise NoSteps(f"{source}: fewer than two scrapes of vLLM's /metrics: nothing to diagnose")
    cannot = list(r.cannot)
    if s.busy_steps < MIN_INTERVALS:
        cannot.insert(0, f"only {s.busy_steps} busy scrape intervals: too few to judge reliably")
    top, rest = V.rule(s, r.config)
    knobs, refusals = choose(top.bottleneck, rest, r.config, s)

    def evidence(bottleneck: str):
        return r.evidence.get(bottleneck) or r.evidence["saturation"]

    f = r.figures
    return Diagnosis(
        source=source, backend="vllm", config=_config_line(r.config), steps=s.steps, requests=s.requests,
        window=window, bottleneck=top.bottleneck, score=round(top.score, 2), evidence=evidence(top.bottleneck),
        secondary=[Runner(bottleneck=x.bottleneck, score=round(x.score, 2), evidence=evidence(x.bottleneck)[0].text)
                   for x in rest],
        knobs=knobs, measure_next=MEASURE_NEXT[top.bottleneck], refusals=refusals, cannot_judge=cannot,
        trace_figures=RunFigures(**f), signals=s, vllm=r.facts)


def diagnose_scrapes(scrapes: list[Scrape], *, flags: VllmFlags | None = None, cache: CacheView | None = None,
                     source: str = "vLLM", window: int | None = None, what_if: bool = False) -> Diagnosis:
    if window is not None:
        scrapes = scrapes[-(window + 1):]  # N intervals need N + 1 scrapes
    flags = flags or VllmFlags()
    r = read(scrapes, flags, cache)
    d = judge_reading(r, source, window)
    if what_if:
        d.what_if = predict(r, flags, d.knobs)
    return d


def diagnose_state(state, flags: VllmFlags | None = None, *, source: str = "live vLLM") -> Diagnosis:
    """The TUI's hook: the Diagnosis of a vLLM view's state (adapters.vllm_source.VllmState, live or a replay's),
    over the scrapes its metrics window holds. Never runs the what-if. Raises NoSteps before two scrapes."""
    return diagnose_scrapes(list(state.metrics.scrapes), flags=flags, cache=state.cache, source=source)


def recording(events: Iterable) -> tuple[list[Scrape], CacheView, float]:
    """Every scrape (oldest first) and the cache view a recording's events rebuild."""
    from kvscope.vllm.watch.trace import batch_from, cache_from, scrape_from

    scrapes: list[Scrape] = []
    cache = CacheView()
    wall = 0.0
    for ev in events:
        t = type(ev)
        if t is VllmMetricsEvent:
            if ev.error is None:
                scrapes.append(scrape_from(ev, wall))
        elif t is VllmKvEvent:
            cache.apply(batch_from(ev))
        elif t is VllmSnapshotEvent:
            if cache.batches != ev.batches or cache.cached_blocks != len(ev.blocks):
                cache = cache_from(ev)  # events were lost before this chunk: the snapshot is the truth
        elif getattr(ev, "type", None) == "hello":
            wall = ev.wall_start
    return scrapes, cache, wall


def diagnose_vllm_trace(path: str | os.PathLike, *, flags: VllmFlags | None = None, window: int | None = None,
                        what_if: bool = True) -> Diagnosis:
    from kvscope.traces.reader import TraceReader

    reader = TraceReader(path)
    scrapes, cache, _ = recording(reader)
    d = diagnose_scrapes(scrapes, flags=flags, cache=cache, source=os.fspath(path), window=window, what_if=what_if)
    if reader.warnings:
        d.cannot_judge.insert(0, f"{reader.warnings[0]}: diagnosed the {len(scrapes)} scrapes before it")
    return d


# ---- what-if --------------------------------------------------------------------------------------
def _draw(buckets: list[tuple[float, float]], n: int, rng: random.Random, floor: int = 1) -> list[int] | None:
    """n lengths drawn from a cumulative histogram, uniform inside each bucket (the +Inf one is left out)."""
    finite = [(le, c) for le, c in buckets if not math.isinf(le)]
    if not finite or finite[-1][1] <= 0:
        return None
    edges, weights, lo, prev = [], [], 0.0, 0.0
    for le, c in finite:
        if c > prev:
            edges.append((lo, le))
            weights.append(c - prev)
        lo, prev = le, c
    out = []
    for a, b in rng.choices(edges, weights, k=n):
        out.append(max(floor, int(rng.uniform(max(a, floor - 1), b)) + 1))
    return out


def workload(r: Reading, n: int = WHATIF_REQUESTS, seed: int = WHATIF_SEED):
    """ReplayRequests shaped like the observed run: Poisson arrivals at its arrival rate, lengths
    from vllm:request_prompt_tokens and vllm:request_generation_tokens. None when a histogram is missing."""
    from kvscope.analysis.whatif import ReplayRequest

    rate = r.facts.request_rate
    rng = random.Random(seed)
    prompts = _draw(r.prompt_buckets, n, rng)
    outputs = _draw(r.gen_buckets, n, rng)
    if not rate or prompts is None or outputs is None:
        return None
    t, reqs = 0.0, []
    for i in range(n):
        reqs.append(ReplayRequest(i, t, prompts[i], outputs[i]))
        t += rng.expovariate(rate)
    return reqs


def _sim_policy(vllm_policy) -> str:
    """The sim's policy for a vLLM one: the same name (vLLM's fcfs and priority are kvscope built-ins too). Anything
    else never reaches load_policy, which would read "module:Class" as code to import."""
    return vllm_policy if vllm_policy in VLLM_SCHEDULING_POLICIES else DEFAULT_POLICY


def sim_settings(r: Reading, flags: VllmFlags) -> tuple[dict, str]:
    """The sim's settings for vLLM's, and a note on what it had to assume."""
    cfg = r.config
    settings = {"backend": "sim", "model": cfg["model"], "gpu": flags.gpu, "mode": cfg["mode"],
                "policy": _sim_policy(cfg.get("policy")), "gpu_memory_utilization": cfg.get("gpu_memory_utilization") or 0.9,
                "prefix_caching": False, "tp": cfg.get("tp") or 1}
    for k in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks"):
        if cfg.get(k):
            settings[k] = cfg[k]
    dtype = cfg.get("kv_cache_dtype")
    if dtype and dtype != "auto":
        settings["kv_cache_dtype"] = dtype
    note = ""
    if settings["mode"] == "chunked" and _vllm_scheduler():
        settings["scheduler"] = "vllm"  # vLLM's own scheduler decides the replays (the sim prices the steps)
        note = ", vLLM's own scheduler"
    else:
        note = ", kvscope's scheduler (vLLM's is not installed, or chunked prefill is off)"
    if flags.max_num_seqs is None:
        settings["max_num_seqs"] = max(SERVE_MAX_NUM_SEQS, int(cfg.get("max_num_seqs") or 0))
        note += (f"; max_num_seqs was only inferred, so the replays assume vllm serve's default {SERVE_MAX_NUM_SEQS} "
                "(pass --vllm-max-num-seqs)")
    return settings, note


def _vllm_scheduler() -> bool:
    """Can the sim run vLLM's own scheduler here (vLLM installed: make vllm)?"""
    try:
        from kvscope.vllm.inproc.core import require_vllm

        require_vllm()
        return True
    except Exception:  # noqa: BLE001 - not installed, or it cannot be imported: kvscope's scheduler replays
        return False


def sim_knob(k: Knob) -> Knob | None:
    mapped = SIM_FLAGS.get(k.flag)
    if mapped is None:
        return None
    flag, convert = mapped
    return Knob(flag=flag, from_=k.from_, to=convert(k.to) if convert else k.to, why=k.why)


def predict(r: Reading, flags: VllmFlags, knobs: list[Knob]):
    """Fill knob.baseline / knob.predicted from sim replays; a WhatIf that says why when it cannot run."""
    from kvscope.analysis.predict import WhatIf, apply_knob
    from kvscope.analysis.whatif import run_sim
    from kvscope.errors import KvscopeError
    from kvscope.engine.sim import catalog

    model = r.config.get("model")
    try:
        catalog.model(model or "?")
    except KvscopeError:
        return WhatIf(ran=False, note=f"model {model!r} is not in the sim catalog (give --model NAME from "
                                      f"{', '.join(sorted(catalog.MODELS))}): knobs carry no predictions")
    if not flags.gpu:
        return WhatIf(ran=False, note="no --gpu: the sim needs the GPU vLLM ran on to predict; knobs carry no "
                                      "predictions")
    reqs = workload(r)
    if reqs is None:
        return WhatIf(ran=False, note="no finished requests or no vllm:request_prompt_tokens / "
                                      "vllm:request_generation_tokens histograms: no workload to replay")
    settings, assumed = sim_settings(r, flags)
    cap = 400 * len(reqs) + 10_000
    try:
        base = run_sim(reqs, settings, max_steps=cap)
    except (KvscopeError, ValueError) as e:
        return WhatIf(ran=False, note=f"the sim cannot run vLLM's settings: {e}")
    steps, wall = base.steps, base.wall_s
    for k in knobs:
        k.baseline = base.figures
        sk = sim_knob(k)
        if sk is None:
            continue
        new = apply_knob(settings, sk)
        if k.flag == "--enable-chunked-prefill" and (new.get("max_num_batched_tokens") or 0) > CHUNKED_BUDGET:
            new["max_num_batched_tokens"] = CHUNKED_BUDGET  # the knob's own note: chunks of vLLM's default budget
        try:
            run = run_sim(reqs, new, max_steps=cap)
        except (KvscopeError, ValueError):
            continue
        k.predicted = run.figures
        steps += run.steps
        wall += run.wall_s
    rate = r.facts.request_rate or 0.0
    note = (f"replayed {len(reqs)} requests shaped like the observed run ({rate:.2f} req/s, lengths from "
            f"vllm:request_prompt_tokens and vllm:request_generation_tokens) through the sim ({model} on "
            f"{flags.gpu}, vLLM's settings{assumed})")
    return WhatIf(ran=True, note=note, requests=len(reqs), of_requests=r.signals.requests,
                  trace=RunFigures(**r.figures), baseline=base.figures, sim_steps=steps, wall_s=wall)
