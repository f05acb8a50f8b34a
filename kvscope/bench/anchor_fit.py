"""Fit the sim's default efficiencies to the published runs: `kvscope bench --backend sim --anchors --fit`.

Each anchor's workload arrives all at once, so the schedule (which requests run in
which step, and each step's batch) does not depend on how long steps take: one sim
run per anchor records every step's four roofline terms at 100% efficiency
(``SimRunner.terms_log``), and the run's time for any efficiencies is the sum of
``StepTerms.time`` over its steps. The fit minimises the squared log error of
throughput over the anchors of the "fit" split, by Nelder-Mead over:

- eff_bw, shared by every engine (kept inside (0, 1));
- overhead_s of the default profile (kvscope's own kind of engine: nano-vllm and its
  forks, engines whose ``profile`` in the anchors file is "default");
- overhead_s of every engine whose ``profile`` is "own" (vLLM).

eff_flops stays at its prior and per_seq_s at 0: these runs (decode-heavy, hundreds
of sequences per step) do not tell them apart from the overhead.
"""

from __future__ import annotations

import math

import numpy as np

from kvscope.bench.anchors import anchor_config, load_anchors, workload_requests


def record(anchor: dict, data: dict) -> dict:
    """Run one anchor once; its steps' terms as an array (weight_mem, linear_comp, kv_mem, attn_comp, comm, seqs)."""
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.serve.driver import ServeOptions, Server

    engine = LLMEngine(anchor_config(anchor, data))
    engine.runner.terms_log = []
    items = workload_requests(data["workloads"][anchor["workload"]], engine.loaded.vocab_size)
    server = Server(engine, ServeOptions(verbose_rejects=False))
    server.run(items)
    terms = np.array([[t.weight_mem, t.linear_comp, t.kv_mem, t.attn_comp, t.comm, t.seqs]
                      for t in engine.runner.terms_log], dtype=float).reshape(-1, 6)
    engine.close()
    return {"terms": terms, "tokens": server.summary().output_tokens}


def run_time(terms: np.ndarray, eff_bw: float, eff_flops: float, overhead_s: float, per_seq_s: float = 0.0) -> float:
    """The same sum as StepTerms.time over every step, vectorised."""
    t = terms
    return float((np.maximum(t[:, 0] / eff_bw, t[:, 1] / eff_flops) + np.maximum(t[:, 2] / eff_bw, t[:, 3] / eff_flops)
                  + t[:, 4] + overhead_s + per_seq_s * t[:, 5]).sum())


def profile_of(engine: str, data: dict) -> str:
    """The overhead group of an engine: "default" or the engine's own name."""
    return "default" if data["engines"][engine].get("profile", "default") == "default" else engine


def fit(path: str | None = None, log=None) -> dict:
    from kvscope.engine.sim.cost import Efficiency

    data = load_anchors(path)
    fit_set = [a for a in data["anchors"] if a["split"] == "fit"]
    if not fit_set:
        raise ValueError("no anchors in the fit split")
    runs = []
    for a in fit_set:
        if log:
            log(f"[fit] recording {a['id']} ...")
        runs.append((a, record(a, data)))
    groups = sorted({profile_of(a["engine"], data) for a, _ in runs}, key=lambda g: (g != "default", g))
    prior = Efficiency()

    def unpack(x: np.ndarray) -> tuple[float, dict[str, float]]:
        return 1.0 / (1.0 + math.exp(-x[0])), {g: math.exp(v) for g, v in zip(groups, x[1:])}

    def loss(x: np.ndarray) -> float:
        eff_bw, overhead = unpack(x)
        total = 0.0
        for a, r in runs:
            t = run_time(r["terms"], eff_bw, prior.eff_flops, overhead[profile_of(a["engine"], data)])
            total += math.log(r["tokens"] / t / a["published"]) ** 2
        return total

    x0 = np.array([math.log(prior.eff_bw / (1 - prior.eff_bw))] + [math.log(prior.overhead_s)] * len(groups))
    x = _nelder_mead(loss, x0)
    eff_bw, overhead = unpack(x)
    errors = {a["id"]: r["tokens"] / run_time(r["terms"], eff_bw, prior.eff_flops,
                                              overhead[profile_of(a["engine"], data)]) / a["published"] - 1
              for a, r in runs}
    return {"eff_bw": eff_bw, "eff_flops": prior.eff_flops, "overhead_s": overhead.get("default"),
            "profiles": {g: {"overhead_s": v} for g, v in overhead.items() if g != "default"},
            "fit_errors": errors, "rms_log_error": math.sqrt(loss(x) / len(runs))}


def _nelder_mead(f, x0: np.ndarray, step: float = 0.3, iters: int = 600, tol: float = 1e-12) -> np.ndarray:
    """Plain Nelder-Mead (reflect, expand, contract, shrink); numpy only, no scipy in the deps."""
    pts = [x0.astype(float)] + [x0 + step * np.eye(len(x0))[i] for i in range(len(x0))]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < tol:
            break
        centre = np.mean(pts[:-1], axis=0)
        refl = centre + (centre - pts[-1])
        fr = f(refl)
        if fr < vals[0]:
            exp = centre + 2 * (centre - pts[-1])
            fe = f(exp)
            pts[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            contr = centre + 0.5 * (pts[-1] - centre)
            fc = f(contr)
            if fc < vals[-1]:
                pts[-1], vals[-1] = contr, fc
            else:
                pts = [pts[0] + 0.5 * (p - pts[0]) for p in pts]
                vals = [f(p) for p in pts]
    return pts[int(np.argmin(vals))]


def print_fit(result: dict) -> None:
    print(f"fitted: eff_bw {result['eff_bw']:.4f}, eff_flops {result['eff_flops']:.2f} (prior, kept), "
          f"overhead_s {result['overhead_s'] * 1e3:.3f} ms (default profile)")
    for name, prof in result["profiles"].items():
        print(f"        {name}: overhead_s {prof['overhead_s'] * 1e3:.3f} ms")
    for aid, err in result["fit_errors"].items():
        print(f"  {aid:36} {err:+7.1%}")
    print(f"rms log error over the fit split: {result['rms_log_error']:.4f}")
