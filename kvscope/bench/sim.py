"""The sim bench: `kvscope bench --backend sim` and the presets `lesson` and `fragmentation`.

The rows have the same JSON shape as the model backend's bench (kvscope/bench/modes.py);
the run is timed on the wall clock too, to report simulated steps per second.
Presets live in kvscope/bench/presets/<name>.json (kvscope/bench/preset.py checks them).
"""

from __future__ import annotations

import math
import platform
import sys
import time
from random import Random

import msgspec

from kvscope import workload as wl
from kvscope.bench.harness import Row, bench_workload, mode_row, model_info, row_config, run_config
from kvscope.bench.preset import load_preset
from kvscope.goodput import NO_SLO, Slo
from kvscope.bench.report import ranking_lines, rows_table
from kvscope.engine.config import MODES, EngineConfig
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.sim import catalog
from kvscope.engine.sim.cost import CostModel


# ---- the four modes on the sim -------------------------------------------------------------
def sim_workload(config: EngineConfig, spec, num_requests: int | None, max_prompt_len: int | None,
                 keep_arrivals: bool = False):
    """The sim bench's requests: all at t=0 unless keep_arrivals (then the workload's own arrival times)."""
    vocab, eos, _ = model_info(config)
    return bench_workload(config, spec, num_requests, vocab, eos, max_prompt_len, at_once=not keep_arrivals)


def sim_row(name: str, engine, server, wall: float) -> Row:
    """One sim bench row: bench's columns plus p50s and the simulator's own speed (also `kvscope race`'s)."""
    steps = engine.scheduler.step_count
    summary = server.summary()
    return mode_row(name, engine, server, ttft_p50_s=summary.ttft_p50_s, itl_p50_s=summary.itl_p50_s,
                    num_blocks=engine.num_blocks, sim_wall_s=wall, sim_steps_per_s=steps / wall if wall else None)


def run_sim_modes(config: EngineConfig, items, modes: list[str], log=print, roofline: bool = False,
                  slo: Slo = NO_SLO) -> list[dict]:
    """The modes' rows; with roofline, each also gets its roofline % from the sim's own cost model: its
    steps priced at the catalog GPU's peaks at 100% efficiency, over the virtual time they took."""
    from kvscope.bench.roofline import Roofline, StepShapes

    rows = []
    for mode in modes:
        log(f"[bench sim] {mode} ...", file=sys.stderr)
        wall = time.perf_counter()
        steps: list[StepShapes] = []
        engine, server = run_config(row_config(config, mode), items, slo=slo,
                                    before_run=(lambda e: steps.append(StepShapes(e.runner))) if roofline else None)
        row = sim_row(mode, engine, server, time.perf_counter() - wall)
        if roofline:
            row.extra.update(Roofline.of_sim(engine.backend.cost).extra(steps[0].shapes, row.duration_s))
        rows.append(row.to_dict())
    return rows


def run_sim_bench(config: EngineConfig, spec, *, num_requests: int | None = None, modes: list[str] | None = None,
                  max_prompt_len: int | None = None, log=print, roofline: bool = False, slo: Slo = NO_SLO) -> dict:
    modes = modes or list(MODES)
    items = sim_workload(config, spec, num_requests, max_prompt_len)
    wall = time.perf_counter()
    rows = run_sim_modes(config, items, modes, log, roofline=roofline, slo=slo)
    wall = time.perf_counter() - wall
    hello = LLMEngine(config).hello().config.as_dict()
    steps = sum(r["steps"] for r in rows)
    return {
        "workload": spec.name,
        "model": config.model,
        "device": hello["device"],
        "num_requests": len(items),
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_prompt_len": max_prompt_len,
        "host": {"python": platform.python_version()},
        "backend": "sim",
        "sim": {k: hello[k] for k in ("gpu", "sim_model", "tp", "kv_cache_dtype", "weight_dtype",
                                      "gpu_memory_utilization", "sim_efficiency", "num_blocks", "max_model_len")},
        "sim_speed": {"steps": steps, "wall_s": wall, "steps_per_s": steps / wall if wall else None},
        "rows": rows,
    }


def run_lesson(preset: dict, overrides: dict | None = None, log=print, slo: Slo = NO_SLO) -> dict:
    config = EngineConfig(**{**preset["engine"], **(overrides or {})})
    spec = wl.parse_spec(preset["workload"])
    result = run_sim_bench(config, spec, modes=preset.get("modes"), log=log, slo=slo)
    result["preset"] = "lesson"
    result["reference"] = preset.get("reference")
    result["comparison"] = compare_to_reference(result["rows"], preset.get("reference") or {})
    return result


def compare_to_reference(rows: list[dict], ref: dict) -> dict:
    """Mode ratios, the sim's against the lesson's (the ratios are what the sim must reproduce)."""
    by = {r["name"]: r for r in rows}
    out: dict = {"throughput_ratios": {}, "itl_p99_ratio": None, "ordering_sim": None, "ordering_ref": None}
    tps = ref.get("output_tok_per_s", {})
    for a, b in (("chunked", "continuous"), ("continuous", "naive"), ("chunked", "naive")):
        if a in by and b in by and a in tps and b in tps and by[b]["output_tok_per_s"]:
            sim = by[a]["output_tok_per_s"] / by[b]["output_tok_per_s"]
            lesson = tps[a] / tps[b]
            out["throughput_ratios"][f"{a}/{b}"] = {"sim": sim, "lesson": lesson, "rel_diff": sim / lesson - 1}
    itl = ref.get("itl_p99_s", {})
    if all(m in by and by[m]["itl_p99_s"] for m in ("continuous", "chunked")) and itl:
        sim = by["continuous"]["itl_p99_s"] / by["chunked"]["itl_p99_s"]
        lesson = itl["continuous"] / itl["chunked"]
        out["itl_p99_ratio"] = {"continuous/chunked": {"sim": sim, "lesson": lesson, "rel_diff": sim / lesson - 1}}
    ranked = [m for m in tps if m in by]
    out["ordering_ref"] = sorted(ranked, key=lambda m: tps[m])
    out["ordering_sim"] = sorted(ranked, key=lambda m: by[m]["output_tok_per_s"])
    return out


def print_comparison(result: dict) -> None:
    comp = result.get("comparison")
    if not comp:
        return
    print("\nagainst the lesson's figures (ratios between modes):")
    for name, r in comp["throughput_ratios"].items():
        print(f"  tok/s {name:22} sim {r['sim']:6.2f}x   lesson {r['lesson']:5.2f}x   ({r['rel_diff']:+.0%})")
    if comp["itl_p99_ratio"]:
        for name, r in comp["itl_p99_ratio"].items():
            print(f"  ITL p99 {name:20} sim {r['sim']:6.2f}x   lesson {r['lesson']:5.2f}x   ({r['rel_diff']:+.0%})")
    same = comp["ordering_sim"] == comp["ordering_ref"]
    print(f"  ordering (slowest first): sim {' < '.join(comp['ordering_sim'])}"
          f" {'(same as the lesson)' if same else '; lesson ' + ' < '.join(comp['ordering_ref'])}")
    s = result["sim"]
    print(f"  KV: {s['num_blocks']} blocks x 16 tokens ({s['kv_cache_dtype']}) on {s['gpu']} x{s['tp']}, "
          f"max_model_len {s['max_model_len']}")


def print_speed(result: dict) -> None:
    sp = result["sim_speed"]
    virtual = sum(r["duration_s"] for r in result["rows"])
    print(f"\nsim speed: {sp['steps']} steps in {sp['wall_s']:.2f} s wall = {sp['steps_per_s']:.0f} simulated "
          f"steps/s; {virtual:.0f} s of simulated serving ({virtual / sp['wall_s']:.0f}x real time)")


# ---- fragmentation: reserved vs paged KV --------------------------------------------------
def run_fragmentation(preset: dict) -> dict:
    dist = wl.LengthDist(**preset["output_len"])
    rng = Random(f"kvscope.fragmentation/{preset.get('seed', 0)}")
    n = preset["num_requests"]
    prompt = preset.get("prompt_tokens", 0)
    lengths = [prompt + dist.sample(rng) for _ in range(n)]
    reserve, bs = preset["reserve_tokens"], preset["block_size"]
    used = sum(lengths)
    reserved_slots = sum(max(reserve, length) for length in lengths)
    paged_slots = sum(math.ceil(length / bs) * bs for length in lengths)
    mean_len = used / n
    std = math.sqrt(sum((x - mean_len) ** 2 for x in lengths) / n)
    result = {
        "preset": "fragmentation",
        "num_requests": n,
        "tokens_mean": mean_len,
        "tokens_std": std,
        "tokens_max": max(lengths),
        "reserve_tokens": reserve,
        "block_size": bs,
        "reserved": {"slots": reserved_slots, "waste": 1 - used / reserved_slots},
        "paged": {"slots": paged_slots, "waste": 1 - used / paged_slots,
                  "waste_tokens_per_request": (paged_slots - used) / n},
    }
    sim = preset.get("sim")
    if sim:
        shape = catalog.model(sim["model"])
        per_token = CostModel(catalog.gpu("h100-sxm5"), shape, kv_dtype=sim.get("kv_cache_dtype")).kv_bytes_per_token
        budget = preset.get("kv_budget_gib", 40) * catalog.GiB
        capacity = int(budget // per_token)
        result["bytes"] = {
            "model": shape.name, "kv_cache_dtype": sim.get("kv_cache_dtype"),
            "kv_bytes_per_token": per_token,
            "reserved_gib_per_request": reserve * per_token / catalog.GiB,
            "reserved_total_gib": reserved_slots * per_token / catalog.GiB,
            "paged_total_gib": paged_slots * per_token / catalog.GiB,
            "used_total_gib": used * per_token / catalog.GiB,
            "kv_budget_gib": budget / catalog.GiB,
            "concurrent_reserved": capacity // reserve,
            "concurrent_paged_mean": int(capacity // (paged_slots / n)),
        }
    return result


def print_fragmentation(r: dict) -> None:
    print(f"fragmentation: {r['num_requests']} requests, tokens mean {r['tokens_mean']:.0f} std "
          f"{r['tokens_std']:.0f} max {r['tokens_max']}")
    print(f"  reserve {r['reserve_tokens']} tokens per request: {r['reserved']['waste']:.1%} of reserved KV unused")
    print(f"  paged, {r['block_size']}-token blocks:        {r['paged']['waste']:.2%} unused "
          f"({r['paged']['waste_tokens_per_request']:.1f} tokens per request, the last block's tail)")
    b = r.get("bytes")
    if b:
        print(f"  {b['model']} KV ({b['kv_cache_dtype']}): {b['kv_bytes_per_token'] / 1024:.0f} KiB/token, "
              f"{b['reserved_gib_per_request']:.2f} GiB reserved per request; all {r['num_requests']}: "
              f"reserved {b['reserved_total_gib']:.0f} GiB vs paged {b['paged_total_gib']:.0f} GiB "
              f"(used {b['used_total_gib']:.0f} GiB)")
        print(f"  in {b['kv_budget_gib']:.0f} GiB of KV: {b['concurrent_reserved']} requests at once reserved vs "
              f"~{b['concurrent_paged_mean']} paged")


# ---- presets ---------------------------------------------------------------------------------
def run_preset(name: str, overrides: dict | None = None, log=print, slo: Slo = NO_SLO) -> dict:
    """`kvscope bench --preset NAME`: lesson (the four modes against the lesson's figures) or
    fragmentation (reserved vs paged KV, no engine run). overrides: engine settings given on the command line."""
    preset = load_preset(name)
    if preset.kind == "fragmentation":
        return run_fragmentation(msgspec.to_builtins(preset.data))
    return run_lesson(msgspec.to_builtins(preset.data), overrides, log, slo=slo)


def print_result(result: dict) -> None:
    if result.get("preset") == "fragmentation":
        print_fragmentation(result)
        return
    print(rows_table(result))
    for line in ranking_lines(result):
        print(line)
    print_comparison(result)
    print_speed(result)
