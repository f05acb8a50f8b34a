"""Where a real-size step's time goes on a CPU, op by op, against the roofline of the same steps.

    python benchmarks/profile_realsize.py [--model qwen3-0.6b-shape] [--workload realsize] [--num-requests 8]
                                     [--max-num-seqs N] [--dtype auto] [--quantization auto]
                                     [--cpu-threads N] [--json FILE]

Serves a workload (`realsize` by default; all at t=0, chunked) through one engine under torch.profiler and
prints: the wall time, the time inside torch ops grouped by kind (GEMMs, attention, KV gather and
write, sampling, the rest), the host time outside any op (Python: scheduling, input building,
the model's per-layer code), and the roofline time of the same steps at this machine's measured
peaks (kvscope/bench/roofline.py). Each group's share says where an optimisation would pay.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GROUPS = (  # first match wins: (group, substrings of the op name)
    ("gemm (linear layers, lm_head)", ("aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear",
                                       "mkldnn::_linear_pointwise", "kvscope::gguf_linear",
                                       "kvscope::amx_linear", "kvscope::dpbf16_linear")),
    ("attention (sdpa, paged kernel)", ("scaled_dot_product", "_flash_attention", "aten::_softmax", "aten::baddbmm",
                                        "kvscope::paged_decode_attention")),
    ("kv gather / write", ("aten::index_select", "aten::index_copy", "aten::gather", "aten::index",
                           "kvscope::write_kv")),
    ("sampling (argmax, softmax, topk)", ("aten::argmax", "aten::topk", "aten::sort", "aten::multinomial")),
    ("elementwise (norms, rope, silu, add)", ("aten::mul", "aten::add", "aten::silu", "aten::rsqrt", "aten::pow",
                                              "aten::mean", "aten::neg", "aten::cat", "aten::cos", "aten::sin",
                                              "kvscope::rms_norm", "kvscope::rope_")),
    ("copies / casts", ("aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous")),
)


LAYER_LOOP = "kvscope::decode_layers"  # a decode step's layers in one C++ call: its ops are grouped one by one


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "other ops"


def main() -> int:
    from kvscope.engine.config import QUANTIZATIONS
    from kvscope.workload.presets import PRESET_NAMES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b-shape")
    p.add_argument("--workload", default="realsize", choices=PRESET_NAMES, help="a workload preset (as kvscope bench's)")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, help="requests decoding at once (the engine's default if left out)")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATIONS, help="as kvscope bench's --quantization")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--cpu-threads", type=int)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--top", type=int, default=0, metavar="N", help="also list the N ops that took longest")
    args = p.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvscope.bench import roofline
    from kvscope.bench.harness import bench_workload, model_info, warm_up
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.sampling_params import SamplingParams
    from kvscope.engine.sim.catalog import CATALOG_DTYPES, shape_of_hf_config

    seqs = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
    config = EngineConfig(model=args.model, device="cpu", dtype=args.dtype, mode="chunked",
                          cpu_threads=args.cpu_threads, num_blocks=2048, quantization=args.quantization, **seqs)
    vocab, eos, _ = model_info(config)
    items = bench_workload(config, args.workload, args.num_requests, vocab, eos, None)
    engine = LLMEngine(replace(config))
    warm_up(engine)
    steps = roofline.StepShapes(engine.runner)
    shape = shape_of_hf_config(engine.loaded.model.config, CATALOG_DTYPES[engine.dtype])
    for it in items:
        engine.add_request(it.prompt, SamplingParams(max_tokens=it.max_tokens, ignore_eos=True))
    # profile only the loop: per-op times (the profiler adds a little per op; the wall time is read without it)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        wall = time.perf_counter() - t0
    peaks = roofline.measure_peaks(shape, engine.backend.torch_dtype, config.max_num_batched_tokens)
    ideal = roofline.Roofline.of(peaks, shape).extra(steps.shapes, wall)

    by_group: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    top_level_s = 0.0
    for evt in prof.events():
        parent = evt.cpu_parent
        if evt.name == LAYER_LOOP and parent is None:  # a container: its ops are counted below, its own time here
            by_group["the C++ layer loop's own time"] += evt.self_cpu_time_total / 1e6
            top_level_s += evt.self_cpu_time_total / 1e6
        elif parent is None or (parent.name == LAYER_LOOP and parent.cpu_parent is None):
            # top-level ops, and the ops a decode step's C++ layer loop called: children are inside them
            by_group[group_of(evt.name)] += evt.cpu_time_total / 1e6
            by_op[evt.name] += evt.cpu_time_total / 1e6
            top_level_s += evt.cpu_time_total / 1e6
    tokens = sum(it.max_tokens for it in items)
    result = {
        "model": args.model, "workload": args.workload, "quantization": engine.backend.quantization or "none",
        "dtype": engine.dtype, "threads": torch.get_num_threads(), "requests": len(items),
        "steps": len(steps.shapes), "output_tokens": tokens, "wall_s": wall, "profiled_ops_s": top_level_s,
        "host_outside_ops_s": max(0.0, wall - top_level_s), "groups_s": dict(by_group),
        "roofline_s": ideal["roofline_s"], "roofline_pct": ideal["roofline_pct"], "peaks": peaks.to_dict(),
        "load_avg": os.getloadavg(),
    }
    print(f"{args.model} {args.workload} {engine.dtype} quantization={result['quantization']} "
          f"threads={result['threads']} requests={len(items)} steps={len(steps.shapes)} "
          f"load={result['load_avg'][0]:.1f}")
    print(peaks.line())
    print(f"wall {wall:.2f} s ({tokens / wall:.1f} out tok/s), roofline {ideal['roofline_s']:.2f} s "
          f"= {ideal['roofline_pct']:.1f}% of wall")
    for group, s in sorted([*by_group.items(), ("host outside ops (python)", result["host_outside_ops_s"])],
                           key=lambda kv: -kv[1]):
        print(f"  {group:<40} {s:8.2f} s  {100 * s / wall:5.1f}%")
    if args.top:
        print(f"the {args.top} longest ops:")
        for name, s in sorted(by_op.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {name[:48]:<48} {s:8.2f} s  {100 * s / wall:5.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
