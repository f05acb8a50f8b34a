"""Decode attention alone on the CPU: the in-place paged kernel against the torch reference, side by side.

    python benchmarks/cpu_attention_decode.py [--seqs 24] [--min-len 500] [--max-len 1000] [--dtype bfloat16]
                                         [--heads 16] [--kv-heads 8] [--head-dim 128] [--block-size 16]
                                         [--threads N] [--repeats 30] [--json FILE]

One layer's decode step at Qwen3-0.6B's attention shape by default: every sequence has one new
query over its paged context (block tables shuffled, as a busy pool's are). Both implementations
run on the same case, interleaved, and each time is the median of the repeats. The bytes column
is the K and V that must be read at least once; GB/s is those bytes over the time. Freed memory
is kept for reuse, as the CPU engine keeps it (kvscope/engine/cpu/malloc.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=24)
    p.add_argument("--min-len", type=int, default=500)
    p.add_argument("--max-len", type=int, default=1000)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()

    import torch

    from kvscope.engine.cpu.malloc import keep_freed_memory
    from kvscope.kernels import reference, testing
    from kvscope.kernels.cpu import library as cpu_attention

    keep_freed_memory()  # as the engine does: the reference's gathered copies reuse kept memory
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu_attention.load() is None:
        print("the kernel did not build; nothing to compare")
        return 1
    dtype = getattr(torch, args.dtype)
    rng = random.Random(0)
    lens = [rng.randint(args.min_len, args.max_len) for _ in range(args.seqs)]
    query, k_cache, v_cache, meta = testing.make_case([1] * args.seqs, lens, heads=args.heads,
                                                      kv_heads=args.kv_heads, head_dim=args.head_dim,
                                                      block_size=args.block_size, dtype=dtype)
    scale = args.head_dim ** -0.5
    impls = {"reference (gather + SDPA)": reference.paged_attention,
             "kernel (pages in place)": cpu_attention.paged_attention}
    outs = {name: fn(query, k_cache, v_cache, meta, scale) for name, fn in impls.items()}  # warm-up, plans
    ref, new = outs.values()
    max_diff = (ref.float() - new.float()).abs().max().item()
    times: dict[str, list[float]] = {name: [] for name in impls}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for name, fn in impls.items():
                t0 = time.perf_counter()
                fn(query, k_cache, v_cache, meta, scale)
                times[name].append(time.perf_counter() - t0)
    kv_bytes = 2 * sum(lens) * args.kv_heads * args.head_dim * k_cache.element_size()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"decode attention: {args.seqs} seqs, contexts {min(lens)}-{max(lens)} ({sum(lens)} tokens), "
          f"H={args.heads} KVH={args.kv_heads} D={args.head_dim} block {args.block_size}, {args.dtype}, "
          f"threads={torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}; median of {args.repeats}")
    print(f"{'implementation':<28} {'ms / layer':>10} {'K+V read':>10} {'GB/s':>7}")
    for name, t in med.items():
        print(f"{name:<28} {1e3 * t:10.3f} {kv_bytes / 1e6:8.1f} MB {kv_bytes / t / 1e9:7.1f}")
    speedup = med["reference (gather + SDPA)"] / med["kernel (pages in place)"]
    print(f"kernel speed-up {speedup:.2f}x; max |difference| {max_diff:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "lens": lens, "median_s": med, "times_s": times, "kv_bytes": kv_bytes,
                       "speedup": speedup, "max_abs_diff": max_diff, "threads": torch.get_num_threads(),
                       "load_avg": os.getloadavg()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
