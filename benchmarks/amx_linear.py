"""A decode step's bf16 linear layers on AMX tiles (kvscope::amx_linear) or AVX-512 BF16 (kvscope::dpbf16_linear)
against oneDNN's own call, same packed weights.

    python benchmarks/amx_linear.py [--model qwen3-0.6b-shape] [--rows 1,8,16,24,32] [--threads N]
                               [--kernel amx|dpbf16] [--repeats 10] [--json FILE]

A pass is every layer's q/k/v, o, gate/up and down GEMM and then the lm_head, on `--rows` rows
of input, as a decode step runs them (attention and norms left out), with random weights of the
model's shapes packed by cpu_linear.py: together they are far larger than the last-level cache,
so each pass reads them from memory. For each row count the two calls alternate on the same
packed weights (A B A B ...); each time is the median of the repeats, GB/s the weights' bytes over
it. The products are checked equal, bit for bit, before timing. --kernel: amx (a CPU with AMX) or
dpbf16 (AVX-512 BF16 without AMX, K summed in oneDNN's blocks as cpu_linear.use_dpbf16 finds them);
by default whichever this CPU runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b-shape", help="a built-in shape (random weights)")
    p.add_argument("--rows", default="1,8,16,24,32", help="comma-separated row counts")
    p.add_argument("--threads", type=int)
    p.add_argument("--kernel", choices=("amx", "dpbf16"), help="default: amx where there are tiles, else dpbf16")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()

    import torch

    from kvscope.engine.cpu import linear as cpu_linear
    from kvscope.engine.cpu.linear import PackedLinear
    from kvscope.engine.loader.shapes import BUILTIN_SHAPES
    from kvscope.kernels.cpu import library as cpu_attention

    if args.model not in BUILTIN_SHAPES:
        p.error(f"--model: one of {', '.join(BUILTIN_SHAPES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu_attention.load() is None:
        print("amx_linear: the CPU kernels did not build here", file=sys.stderr)
        return 2
    kernel = args.kernel or ("amx" if cpu_linear.amx_unavailable() is None else "dpbf16")
    why_not = cpu_linear.amx_unavailable() if kernel == "amx" else cpu_linear.dpbf16_unavailable()
    if why_not is not None:
        print(f"amx_linear: {kernel} is not available here ({why_not})", file=sys.stderr)
        return 2
    cfg = BUILTIN_SHAPES[args.model]
    width, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = [(q + 2 * kv, width), (width, q), (2 * inter, width), (width, inter)] * cfg["num_hidden_layers"]
    shapes.append((cfg["vocab_size"], width))

    def packed(n: int, k: int) -> PackedLinear:
        return PackedLinear.of_weight(torch.randn(n, k).to(torch.bfloat16), None)

    print(f"packing {len(shapes)} random weights of {args.model}'s shapes ...", file=sys.stderr)
    layers = [packed(n, k) for n, k in shapes]
    nbytes = sum(2 * n * k for n, k in shapes)
    onednn = torch.ops.mkldnn._linear_pointwise
    if kernel == "amx":
        def ours(m, x):
            return torch.ops.kvscope.amx_linear(x, m.packed, None)
    else:
        blocks = {}
        for m in layers:
            key = (m.out_features, m.in_features)
            if key not in blocks:
                blocks[key] = cpu_linear._onednn_blocks(m)
                if blocks[key] is None:
                    print(f"amx_linear: oneDNN's layout or K blocks for {key} are not the dpbf16 loop's here",
                          file=sys.stderr)
                    return 2
            m.dpbf16_block = blocks[key]

        def ours(m, x):  # the kernel itself at every row count (the engine calls it up to DPBF16_MAX_ROWS)
            return torch.ops.kvscope.dpbf16_linear(x, m.packed, None, m.dpbf16_block[0 if x.shape[0] == 1 else 1])
    name = "AMX" if kernel == "amx" else "dpbf16"
    result = {"model": args.model, "kernel": kernel, "threads": torch.get_num_threads(),
              "cpu": platform.processor() or platform.machine(), "load_average": os.getloadavg(),
              "weights_mb": nbytes / 1e6, "rows_out": []}
    print(f"{args.model}: {nbytes / 1e6:,.0f} MB of bf16 weights, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'rows':>4} {'oneDNN ms':>10} {'GB/s':>6} {name + ' ms':>9} {'GB/s':>6} {'speed-up':>9}")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {k for _, k in shapes}}
            for m in layers[:4] + layers[-1:]:
                x = xs[m.in_features]
                if not torch.equal(ours(m, x), onednn(x, m.packed, None, "none", [], "")):
                    print(f"amx_linear: {rows} rows differ from oneDNN's products", file=sys.stderr)
                    return 1
            calls = {"oneDNN": lambda m, x: onednn(x, m.packed, None, "none", [], ""), name: ours}
            times: dict[str, list[float]] = {label: [] for label in calls}
            for i in range(args.repeats + 1):
                for label, call in calls.items():
                    t0 = time.perf_counter()
                    for m in layers:
                        call(m, xs[m.in_features])
                    if i:  # the first round warms up
                        times[label].append(time.perf_counter() - t0)
            ms = {label: statistics.median(t) * 1e3 for label, t in times.items()}
            print(f"{rows:>4} {ms['oneDNN']:>10.1f} {nbytes / ms['oneDNN'] / 1e6:>6.1f} {ms[name]:>9.1f} "
                  f"{nbytes / ms[name] / 1e6:>6.1f} {ms['oneDNN'] / ms[name]:>8.2f}x")
            result["rows_out"].append({"rows": rows, "onednn_ms": ms["oneDNN"], f"{kernel}_ms": ms[name],
                                       "speedup": ms["oneDNN"] / ms[name]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
