"""`kvscope bench --backend sim --anchors`: the sim against published runs of real engines.

kvscope/bench/anchors.json lists runs that real engines published (GPU, model, engine and
version, workload, figure, source). Each anchor's workload is rebuilt request for
request and served by kvscope's scheduler on the sim with that engine's scheduler
settings (mode, block size, budgets) and its efficiency profile
(``kvscope.engine.sim.cost.ENGINE_PROFILES``); the table is sim, published and
error. docs/SIM.md has the table, the fit/validate split and what the sim leaves out;
kvscope/bench/anchor_fit.py fits the defaults to the "fit" split.
"""

from __future__ import annotations

import json
import math
import os
import sys
from random import Random

from kvscope.errors import KvscopeError

ANCHORS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "anchors.json")  # package data
SPLITS = ("fit", "validate")
GENERATORS = ("nano-vllm-bench", "uniform")  # uniform: lengths uniform in [lo, hi] from kvscope's own seeded RNG
MAX_FILE_BYTES = 1 << 20
_ANCHOR_KEYS = ("id", "gpu", "model", "engine", "engine_version", "workload", "metric", "published", "split", "source")
_ENGINE_KEYS = ("mode", "block_size", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization")


# ---- the file -------------------------------------------------------------------------------
def load_anchors(path: str | None = None) -> dict:
    """Read and check an anchors file; a KvscopeError (one line) for anything malformed."""
    path = path or ANCHORS_PATH
    try:
        if os.path.getsize(path) > MAX_FILE_BYTES:
            raise KvscopeError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise KvscopeError(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise KvscopeError(f"invalid JSON in {path}: {e}") from None
    check_anchors(data, path)
    return data


def check_anchors(data, where: str = "anchors") -> None:
    from kvscope.engine.config import MODES
    from kvscope.engine.sim import catalog

    def fail(msg: str) -> None:
        raise KvscopeError(f"{where}: {msg}")

    if not isinstance(data, dict):
        fail("not a JSON object")
    workloads, engines, anchors = data.get("workloads"), data.get("engines"), data.get("anchors")
    if not isinstance(workloads, dict) or not isinstance(engines, dict) or not isinstance(anchors, list):
        fail("needs 'workloads' and 'engines' objects and an 'anchors' list")
    for name, wl in workloads.items():
        if not isinstance(wl, dict) or wl.get("generator") not in GENERATORS:
            fail(f"workload {name!r}: generator must be one of {', '.join(GENERATORS)}")
        for key in ("num_seqs", "seed"):
            if not _is_int(wl.get(key), 0, 100_000):
                fail(f"workload {name!r}: {key} must be an integer")
        for key in ("input_len", "output_len"):
            v = wl.get(key)
            if not (isinstance(v, list) and len(v) == 2 and all(_is_int(x, 1, 1 << 20) for x in v) and v[0] <= v[1]):
                fail(f"workload {name!r}: {key} must be [lo, hi] with 1 <= lo <= hi")
    for name, eng in engines.items():
        if not isinstance(eng, dict) or any(k not in eng for k in _ENGINE_KEYS):
            fail(f"engine {name!r}: needs {', '.join(_ENGINE_KEYS)}")
        if eng["mode"] not in MODES:
            fail(f"engine {name!r}: unknown mode {eng['mode']!r}")
        if eng.get("profile", "default") not in ("default", "own"):
            fail(f"engine {name!r}: profile must be 'default' or 'own'")
        for key in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if not _is_int(eng[key], 1, 1 << 24):
                fail(f"engine {name!r}: {key} must be a positive integer")
        gmu = eng["gpu_memory_utilization"]
        if isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not 0 < gmu <= 1:
            fail(f"engine {name!r}: gpu_memory_utilization must be in (0, 1]")
    seen = set()
    for i, a in enumerate(anchors):
        if not isinstance(a, dict) or any(k not in a for k in _ANCHOR_KEYS):
            fail(f"anchor {i}: needs {', '.join(_ANCHOR_KEYS)}")
        if a["id"] in seen:
            fail(f"anchor {a['id']!r} listed twice")
        seen.add(a["id"])
        if a["workload"] not in workloads or a["engine"] not in engines:
            fail(f"anchor {a['id']!r}: unknown workload or engine")
        if a["split"] not in SPLITS or a["metric"] != "output_tok_per_s":
            fail(f"anchor {a['id']!r}: split must be fit or validate, metric output_tok_per_s")
        if isinstance(a["published"], bool) or not isinstance(a["published"], (int, float)) or not a["published"] > 0:
            fail(f"anchor {a['id']!r}: published must be a positive number")
        if not isinstance(a["source"], str) or "http" not in a["source"]:
            fail(f"anchor {a['id']!r}: source must cite a URL")
        try:
            catalog.gpu(a["gpu"])
            catalog.model(a["model"])
        except KvscopeError as e:
            fail(f"anchor {a['id']!r}: {e}")


def _is_int(v, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


# ---- the workload ---------------------------------------------------------------------------
def nano_vllm_bench_lengths(wl: dict) -> tuple[list[int], list[int]]:
    """Prompt and output lengths exactly as nano-vllm's bench.py draws them (Python random, its call order)."""
    rng = Random(wl["seed"])
    (in_lo, in_hi), (out_lo, out_hi), n = wl["input_len"], wl["output_len"], wl["num_seqs"]
    prompts = []
    for _ in range(n):
        length = rng.randint(in_lo, in_hi)
        for _ in range(length):
            rng.randint(0, 10000)  # the token ids: drawn only to keep the sequence of draws
        prompts.append(length)
    return prompts, [rng.randint(out_lo, out_hi) for _ in range(n)]


def uniform_lengths(wl: dict) -> tuple[list[int], list[int]]:
    rng = Random(f"kvscope.anchors.uniform/{wl['seed']}")
    (in_lo, in_hi), (out_lo, out_hi) = wl["input_len"], wl["output_len"]
    pairs = [(rng.randint(in_lo, in_hi), rng.randint(out_lo, out_hi)) for _ in range(wl["num_seqs"])]
    return [p for p, _ in pairs], [o for _, o in pairs]


def workload_requests(wl: dict, vocab_size: int) -> list:
    """All requests at t = 0, random prompt ids (no shared prefixes), EOS ignored."""
    from kvscope.workload import WorkloadRequest

    lengths = nano_vllm_bench_lengths if wl["generator"] == "nano-vllm-bench" else uniform_lengths
    prompts, outputs = lengths(wl)
    rng = Random(f"kvscope.anchors/{wl['seed']}")
    top = min(10_000, vocab_size - 2)
    return [WorkloadRequest(arrival=0.0, prompt=[rng.randint(0, top) for _ in range(p)], max_tokens=o)
            for p, o in zip(prompts, outputs)]


# ---- running ----------------------------------------------------------------------------------
def anchor_config(anchor: dict, data: dict, efficiency: dict | None = None):
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.sim.cost import engine_efficiency

    eng = data["engines"][anchor["engine"]]
    eff = efficiency if efficiency is not None else engine_efficiency(anchor["engine"]).to_dict()
    return EngineConfig(backend="sim", model=anchor["model"], gpu=anchor["gpu"], mode=eng["mode"],
                        block_size=eng["block_size"], max_num_seqs=eng["max_num_seqs"],
                        max_num_batched_tokens=eng["max_num_batched_tokens"],
                        gpu_memory_utilization=eng["gpu_memory_utilization"], sim_efficiency=eff)


def run_anchor(anchor: dict, data: dict, efficiency: dict | None = None) -> dict:
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.serve.driver import ServeOptions, Server

    config = anchor_config(anchor, data, efficiency)
    engine = LLMEngine(config)
    items = workload_requests(data["workloads"][anchor["workload"]], engine.loaded.vocab_size)
    server = Server(engine, ServeOptions(verbose_rejects=False))
    server.run(items)
    summary = server.summary()
    engine.close()
    sim = summary.output_tok_per_s
    return {
        "id": anchor["id"], "gpu": anchor["gpu"], "model": anchor["model"], "engine": anchor["engine"],
        "engine_version": anchor["engine_version"], "split": anchor["split"],
        "published": anchor["published"], "sim": sim, "error": sim / anchor["published"] - 1,
        "output_tokens": summary.output_tokens, "preemptions": engine.num_preemptions,
        "num_blocks": engine.num_blocks, "sim_efficiency": config.sim_efficiency,
    }


def run_anchors(path: str | None = None, efficiency: dict | None = None, splits=SPLITS, log=None) -> dict:
    data = load_anchors(path)
    rows = []
    for a in data["anchors"]:
        if a["split"] in splits:
            if log:
                log(f"[anchors] {a['id']} ...", file=sys.stderr)
            rows.append(run_anchor(a, data, efficiency))
    return {"anchors": path or "kvscope/bench/anchors.json", "rows": rows, "summary": summarize(rows)}


def summarize(rows: list[dict]) -> dict:
    out = {}
    for split in SPLITS:
        errs = [r["error"] for r in rows if r["split"] == split]
        if errs:
            out[split] = {"n": len(errs), "mean_abs_error": sum(map(abs, errs)) / len(errs),
                          "max_abs_error": max(map(abs, errs)),
                          "rms_log_error": math.sqrt(sum(math.log1p(e) ** 2 for e in errs) / len(errs))}
    return out


def print_anchors(result: dict) -> None:
    head = f"{'anchor':36} {'split':8} {'sim tok/s':>10} {'published':>10} {'error':>7}"
    print(head)
    print("-" * len(head))
    for r in result["rows"]:
        print(f"{r['id']:36} {r['split']:8} {r['sim']:10.0f} {r['published']:10.0f} {r['error']:+7.1%}")
    for split, s in result["summary"].items():
        print(f"{split}: {s['n']} runs, mean |error| {s['mean_abs_error']:.1%}, max |error| {s['max_abs_error']:.1%}")
