"""`kvscope calibrate TRACE`: fit the cost model's efficiencies and overhead to a real engine's steps.

Each StepEvent says what the step ran (prefill chunks and decodes, their start
positions, which rows sampled). The cost model turns that into four roofline terms at
100% efficiency; the fit finds

    period = max(Wm*u, Lc*v) + max(Km*u, Ac*v) + overhead + per_seq*seqs

with u = 1/eff_bw and v = 1/eff_flops, by least squares over the steps. The target is
a step's *period* (its start to the next step's start) while the engine had work
left, so host time outside the forward (events, the serve loop) is billed too, as it
was in the measured run. The two maxima make the model piecewise linear: for a fixed
ratio r = v/u it is linear in (u, overhead, per_seq), so a search over r with a linear
solve at each point finds the least-squares optimum.

Validation replays the trace's own workload (arrivals, prompt lengths, max_tokens)
through the sim with the fitted parameters and compares throughput and TTFT p50.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvscope.errors import KvscopeError
from kvscope.engine.errors import RequestRejected
from kvscope.engine.sim import catalog
from kvscope.engine.sim.cost import CostModel, Efficiency, StepShape
from kvscope.protocol.events import RequestEvent, StepEvent

TRIM_FRACTION = 0.0  # plain least squares: a stalled step (GC, a busy host) cost the measured run time too
LOOSE_FIT = 0.5  # mean |step-time error| above which a fit is called loose (CPU traces here: 11% to 28%)


@dataclass
class TraceData:
    config: dict
    steps: list[StepEvent]
    requests: list[RequestEvent]


def read_trace(path: str) -> TraceData:
    from kvscope.traces.reader import engine_trace

    reader = engine_trace(path, "calibrate")
    steps, requests = [], []
    for ev in reader:
        if isinstance(ev, StepEvent):
            steps.append(ev)
        elif isinstance(ev, RequestEvent):
            requests.append(ev)
    if not steps:
        raise KvscopeError(f"{path}: the trace holds no steps; nothing to calibrate")
    if not requests:  # throughput and TTFT are measured from the requests' arrivals
        raise KvscopeError(f"{path}: the trace holds no request events (a recording that began mid-run has "
                           "only snapshots of its requests); calibration needs a run recorded from its start")
    return TraceData(reader.hello.config.as_dict(), steps, requests)


def step_shape(ev: StepEvent) -> StepShape:
    sampled = set(ev.sampled)
    s = StepShape()
    for b in ev.batch:
        s.add(b.tokens, b.start, b.req in sampled)
    if ev.padding:
        s.add(ev.padding, 0, False)
    return s


MAX_STEP_S = 3600.0  # a step period longer than an hour is not an engine step (a damaged or crafted trace)


def busy_periods(steps: list[StepEvent]) -> list[tuple[StepEvent, float]]:
    """(step, seconds until the next step) for steps after which the engine still had work."""
    out = []
    for ev, nxt in zip(steps, steps[1:]):
        period = nxt.t - ev.t
        # a step that took no time, or more than MAX_STEP_S (a trace's times are any finite float, and
        # squaring 1e308 overflows the fit), says nothing about the cost model: left out
        if (ev.running or ev.waiting or ev.preempted) and ev.batch and 0.0 < period <= MAX_STEP_S:
            out.append((ev, period))
    return out


def _str_or_none(v) -> str | None:
    return v if isinstance(v, str) else None


def _short(v) -> str:
    """A value from a trace, for an error line: never longer than a line."""
    text = repr(v) if isinstance(v, (str, int, float, type(None))) else f"<{type(v).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def resolve_names(config: dict, gpu: str | None, model: str | None) -> tuple[str, str]:
    if gpu is None:
        sim = config.get("backend") == "sim"
        gpu = (config.get("gpu") if sim else None) or ("cpu" if str(config.get("device", "")).startswith("cpu")
                                                       else catalog.gpu_from_device_name(_str_or_none(config.get("device_name"))))
        if not isinstance(gpu, str):
            raise KvscopeError(f"the trace ran on {_short(config.get('device'))}; name its GPU with --gpu "
                             f"({', '.join(catalog.GPUS)})")
    if model is None:
        named = config.get("sim_model") or config.get("model", "")
        model = catalog.catalog_name(named)  # a catalog name, a hub name, or a checkpoint path of a catalog shape
        if model is None:
            raise KvscopeError(f"model {_short(named)} is not in the sim catalog; name its shape with --sim-model "
                             f"({', '.join(catalog.MODELS)})")
    return gpu, model


@dataclass
class Fit:
    efficiency: Efficiency
    steps_used: int
    rms_s: float
    mean_abs_rel: float  # mean |predicted - measured| / measured over the steps used
    r2: float


def fit_caution(mean_abs_rel_err: float, r2: float) -> str:
    """A line that says so when the fitted cost model explains the measured steps poorly, else ""."""
    if not mean_abs_rel_err > LOOSE_FIT:
        return ""
    return (f"the fit is loose (step-time error {mean_abs_rel_err:.0%}, R^2 {r2:.2f}): the trace's step times follow "
            "the work in its steps only roughly, as when the host is busy with other work while it records; "
            "trust the predictions' direction more than their size")


def _solve(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Least squares with every coefficient >= 0 (a column whose coefficient goes negative is dropped)."""
    cols = list(range(X.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
        if (coef >= 0).all() or len(cols) == 1:
            full = np.zeros(X.shape[1])
            full[cols] = np.maximum(coef, 0)
            r = y - X @ full
            return full, float(r @ r)
        cols.pop(int(np.argmin(coef)))


def fit_terms(T: np.ndarray, y: np.ndarray, fit_per_seq: bool = True) -> tuple[Efficiency, np.ndarray]:
    """T: rows of (weight_mem, linear_comp, kv_mem, attn_comp, comm, seqs); y: measured seconds."""
    wm, lc, km, ac, comm, seqs = T.T
    target = y - comm
    ones = np.ones_like(y)

    def at(log_r: float):
        r = math.exp(log_r)
        g = np.maximum(wm, r * lc) + np.maximum(km, r * ac)
        X = np.column_stack([g, ones, seqs] if fit_per_seq else [g, ones])
        coef, sse = _solve(X, target)
        return sse, coef

    grid = np.linspace(math.log(1e-4), math.log(1e4), 161)
    best = min(grid, key=lambda lr: at(lr)[0])
    lo, hi = best - 0.06, best + 0.06
    for _ in range(40):  # golden-section refinement around the best grid point
        a, b = lo + 0.382 * (hi - lo), lo + 0.618 * (hi - lo)
        if at(a)[0] < at(b)[0]:
            hi = b
        else:
            lo = a
    log_r = (lo + hi) / 2
    _, coef = at(log_r)
    u = coef[0]
    if u <= 0:
        raise KvscopeError("the step times do not grow with the work in the steps; cannot fit efficiencies")
    eff = Efficiency(eff_bw=1 / u, eff_flops=1 / (u * math.exp(log_r)), overhead_s=float(coef[1]),
                     per_seq_s=float(coef[2]) if fit_per_seq else 0.0)
    pred = np.array([_predict(row, eff) for row in T])
    return eff, pred


def _predict(row, eff: Efficiency) -> float:
    wm, lc, km, ac, comm, seqs = row
    return (max(wm / eff.eff_bw, lc / eff.eff_flops) + max(km / eff.eff_bw, ac / eff.eff_flops)
            + comm + eff.overhead_s + eff.per_seq_s * seqs)


def fit(data: TraceData, cost: CostModel, fit_per_seq: bool = True) -> Fit:
    pairs = busy_periods(data.steps)
    if len(pairs) < 8:
        raise KvscopeError(f"the trace has only {len(pairs)} busy steps; calibration needs more")
    rows = []
    for ev, _ in pairs:
        t = cost.terms(step_shape(ev))
        rows.append((t.weight_mem, t.linear_comp, t.kv_mem, t.attn_comp, t.comm, t.seqs))
    T = np.array(rows, dtype=float)
    y = np.array([p for _, p in pairs], dtype=float)
    eff, pred = fit_terms(T, y, fit_per_seq)
    keep = np.abs(y - pred) <= np.quantile(np.abs(y - pred), 1 - TRIM_FRACTION)
    T, y = T[keep], y[keep]
    eff, pred = fit_terms(T, y, fit_per_seq)
    res = y - pred
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return Fit(eff, len(y), float(np.sqrt((res ** 2).mean())), float(np.mean(np.abs(res) / y)),
               1 - float((res ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0)


# ---- validation: replay the trace's workload through the sim -----------------------------------
@dataclass
class RunStats:
    output_tokens: int
    duration_s: float
    output_tok_per_s: float
    ttft_p50_s: float | None
    ttft_mean_s: float | None
    steps: int


def run_stats(steps: list[StepEvent], requests: list[RequestEvent], t_end: float | None = None) -> RunStats:
    """Throughput and TTFT of the steps that start before t_end (default: all)."""
    from kvscope.engine.metrics import mean, percentile

    if t_end is not None:
        steps = [s for s in steps if s.t < t_end]
    if not steps:  # the sim served none of the trace's requests in its span (their numbers are not trusted)
        return RunStats(0, 0.0, 0.0, None, None, 0)
    t0 = min(r.arrival for r in requests)
    end = steps[-1].t + steps[-1].dur
    tokens = sum(len(s.sampled) for s in steps)
    ttft = [f.ttft for s in steps for f in s.first_tokens]
    span = end - t0
    return RunStats(tokens, span, tokens / span if span > 0 else 0.0, percentile(ttft, 50), mean(ttft), len(steps))


class ListSink:
    def __init__(self) -> None:
        self.events: list = []

    def publish(self, event) -> None:
        self.events.append(event)


def sim_config(data: TraceData, gpu: str, model: str, eff: Efficiency):
    from kvscope.engine.config import EngineConfig

    c = data.config
    keys = ("mode", "block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
            "seed", "preemption")
    settings = {k: c[k] for k in keys if k in c}
    return EngineConfig(backend="sim", model=model, gpu=gpu, sim_efficiency=eff.to_dict(), **settings)


def replay(data: TraceData, config, t_end: float) -> tuple[list[StepEvent], float, int]:
    """Run the trace's requests (same arrivals and lengths) through a sim engine until virtual t_end.

    Returns the sim's step events, the wall seconds it took, and its step count."""
    import time

    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.sampling_params import SamplingParams

    sink = ListSink()
    engine = LLMEngine(config, sink=sink)
    vocab = engine.loaded.vocab_size - 1
    reqs = sorted(data.requests, key=lambda r: r.arrival)
    wall = time.perf_counter()
    i = 0
    while True:
        now = engine.now()
        while i < len(reqs) and reqs[i].arrival <= now:
            r = reqs[i]
            i += 1
            if not 1 <= r.prompt_len < engine.max_model_len:  # checked before building the prompt
                continue  # the sim engine could not serve it either (the trace's numbers are not trusted)
            prompt = [(r.req * 131 + k * 7) % vocab for k in range(r.prompt_len)]
            try:
                engine.add_request(prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True), r.priority,
                                   arrival=r.arrival)
            except RequestRejected:
                continue
        if now >= t_end:
            break
        if engine.has_unfinished():
            engine.step()
        elif i < len(reqs):
            engine.clock.sleep_until(reqs[i].arrival)
        else:
            break
    wall = time.perf_counter() - wall
    engine.close()
    return [e for e in sink.events if isinstance(e, StepEvent)], wall, engine.scheduler.step_count


def _err(a, b):
    return None if a is None or b is None or b == 0 else (a - b) / b


def validate(data: TraceData, gpu: str, model: str, eff: Efficiency) -> dict:
    """Replay a trace's workload with the given parameters; measured vs simulated throughput and TTFT p50."""
    measured = run_stats(data.steps, data.requests)
    t_end = data.steps[-1].t + data.steps[-1].dur
    sim_steps, wall, nsteps = replay(data, sim_config(data, gpu, model, eff), t_end)
    simulated = run_stats(sim_steps, data.requests, t_end)
    return {
        "measured": measured.__dict__,
        "simulated": simulated.__dict__,
        "error": {"output_tok_per_s": _err(simulated.output_tok_per_s, measured.output_tok_per_s),
                  "ttft_p50_s": _err(simulated.ttft_p50_s, measured.ttft_p50_s)},
        "sim_speed": {"steps": nsteps, "wall_s": wall, "steps_per_s": nsteps / wall if wall > 0 else None,
                      "virtual_over_wall": t_end / wall if wall > 0 else None},
    }


def calibrate(path: str, gpu: str | None = None, model: str | None = None, fit_per_seq: bool = True,
              validate_paths: list[str] | None = None) -> dict:
    """Fit on path, validate by replaying path (in-sample) and any other traces of the same engine setup."""
    data = read_trace(path)
    gpu, model = resolve_names(data.config, gpu, model)
    cost = CostModel(catalog.gpu(gpu), catalog.model(model))
    f = fit(data, cost, fit_per_seq)
    own = validate(data, gpu, model, f.efficiency)
    return {
        "trace": path,
        "gpu": gpu,
        "model": model,
        "efficiency": f.efficiency.to_dict(),
        "fit": {"steps": f.steps_used, "rms_s": f.rms_s, "mean_abs_rel_err": f.mean_abs_rel, "r2": f.r2},
        **own,
        "held_out": {p: validate(read_trace(p), gpu, model, f.efficiency) for p in validate_paths or []},
    }


def format_report(r: dict) -> str:
    e, f, m, s = r["efficiency"], r["fit"], r["measured"], r["simulated"]

    def ms(x):
        return "-" if x is None else f"{x * 1000:.1f} ms"

    def pct(x):
        return "-" if x is None else f"{x * 100:+.1f}%"

    lines = [
        f"calibrated {r['model']} on {r['gpu']} from {r['trace']}",
        f"  eff_bw {e['eff_bw']:.4g}  eff_flops {e['eff_flops']:.4g}  overhead {e['overhead_s'] * 1000:.3f} ms"
        f"  per_seq {e['per_seq_s'] * 1e6:.1f} us",
        f"  fit over {f['steps']} busy steps: rms {f['rms_s'] * 1000:.2f} ms, mean |err| {f['mean_abs_rel_err']:.1%},"
        f" R^2 {f['r2']:.3f}",
        "",
        f"  {'':12}{'measured':>12}{'sim':>12}{'error':>9}",
        f"  {'out tok/s':12}{m['output_tok_per_s']:>12.1f}{s['output_tok_per_s']:>12.1f}"
        f"{pct(r['error']['output_tok_per_s']):>9}",
        f"  {'TTFT p50':12}{ms(m['ttft_p50_s']):>12}{ms(s['ttft_p50_s']):>12}{pct(r['error']['ttft_p50_s']):>9}",
        f"  {'steps':12}{m['steps']:>12}{s['steps']:>12}",
        "",
        f"  sim: {r['sim_speed']['steps']} steps in {r['sim_speed']['wall_s']:.2f} s wall = "
        f"{r['sim_speed']['steps_per_s'] or 0:.0f} steps/s, {r['sim_speed']['virtual_over_wall'] or 0:.0f}x real time",
    ]
    caution = fit_caution(f["mean_abs_rel_err"], f["r2"])
    if caution:
        lines[3:3] = [f"  {caution}"]
    if s["steps"] == 0:
        lines.insert(-2, "  the sim ran no step in the trace's span: it could serve none of the requests as recorded "
                         "(lengths, limits or priorities out of range, or arrivals after the end)")
    for p, v in r.get("held_out", {}).items():
        hm, hs = v["measured"], v["simulated"]
        lines += ["", f"  held out: {p}",
                  f"  {'out tok/s':12}{hm['output_tok_per_s']:>12.1f}{hs['output_tok_per_s']:>12.1f}"
                  f"{pct(v['error']['output_tok_per_s']):>9}",
                  f"  {'TTFT p50':12}{ms(hm['ttft_p50_s']):>12}{ms(hs['ttft_p50_s']):>12}"
                  f"{pct(v['error']['ttft_p50_s']):>9}"]
    return "\n".join(lines)
