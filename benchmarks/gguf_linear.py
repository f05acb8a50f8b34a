"""One decode token's linear layers on SmolLM2: the GGUF's own blocks against the dequantized, oneDNN-packed weights.

    python benchmarks/gguf_linear.py [--model smollm2-135m] [--rows 1] [--dtype bfloat16] [--threads N]
                                [--repeats 30] [--paths] [--json FILE]

A pass is every layer's q/k/v, o, gate/up and down GEMM and the lm_head, on `--rows` rows of
input, as a decode step runs them (the attention and norms between are left out): the weights
are read from memory, not cache, since together they are larger than the last-level cache. The
two passes alternate, and each time is the median of the repeats; GB/s is the weights' bytes
over the time. `--paths` adds a row for each of the op's loops this CPU runs (kvscope::gguf_paths: AVX-512,
AVX2, generic), the default first; the blocks row is the default's.
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
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--paths", action="store_true", help="a row for each loop the op has here")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()

    import torch

    from kvscope import cpu_isa
    from kvscope.engine.loader import gguf_blocks
    from kvscope.engine.cpu.linear import pack_linears
    from kvscope.engine.loader.models import load_model
    from kvscope.kernels.cpu import gguf_linear
    from kvscope.kernels.cpu import library as cpu_attention

    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_attention.load()
    dtype = getattr(torch, args.dtype)
    loaded = load_model(args.model, dtype, "cpu")
    pack_linears(loaded.model)
    blocks = gguf_blocks.load(loaded.gguf_path, loaded.model)
    body = loaded.model.model
    cfg = loaded.model.config
    dense = []
    for block in body.layers:
        attn, mlp = block.self_attn, block.mlp
        dense.append((attn.q_proj.fused, attn.o_proj, mlp.gate_proj.fused, mlp.down_proj))
    gguf = [(layer.qkv, layer.o_proj, layer.gate_up, layer.down) for layer in blocks.layers]
    width, inter = cfg.hidden_size, cfg.intermediate_size
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, width, generator=gen).to(dtype)
    xi = torch.randn(args.rows, inter, generator=gen).to(dtype)

    def run(layers, lm_head) -> float:
        t0 = time.perf_counter()
        for qkv, o, gate_up, down in layers:
            qkv(x), o(x), gate_up(x), down(xi)
        lm_head(x)
        return time.perf_counter() - t0

    dense_bytes = sum(m.out_features * m.in_features for layer in dense for m in layer) * x.element_size() + \
        cfg.vocab_size * width * x.element_size()
    rows = {"dense (oneDNN, packed)": (dense, loaded.model.lm_head, dense_bytes),
            "GGUF blocks": (gguf, blocks.lm_head, blocks.nbytes)}
    if args.paths and not any(m.ggml_type >= gguf_linear.X16 for layer in gguf for m in layer):
        def on(path):
            def call(m):
                return lambda v: torch.ops.kvscope.gguf_linear_on(v, m.blocks, m.ggml_type, m.bias, path)
            return [tuple(map(call, layer)) for layer in gguf], call(blocks.lm_head)

        for path in torch.ops.kvscope.gguf_paths(dtype):
            rows[f"GGUF blocks, {path} loops"] = (*on(path), blocks.nbytes)
    times: dict[str, list[float]] = {name: [] for name in rows}
    with torch.inference_mode():
        for _ in range(3):
            for layers, head, _ in rows.values():
                run(layers, head)
        for _ in range(args.repeats):
            for name, (layers, head, _) in rows.items():
                times[name].append(run(layers, head))
        # the machine's copy bandwidth (read + write counted, as kvscope bench --roofline measures it), best of 5
        src, dst = torch.ones(1 << 27), torch.empty(1 << 27)  # 512 MiB each, far past the last-level cache
        copies = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            copies.append(time.perf_counter() - t0)
        copy_gb_s = 2 * src.numel() * 4 / min(copies) / 1e9
        del src, dst
    result = {"model": args.model, "copy_gb_s": copy_gb_s, "dtype": args.dtype, "rows": args.rows,
              "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
              "load_average": os.getloadavg(), "rows_out": []}
    result["isa_cap"] = cpu_isa.describe()
    cap = f", {cpu_isa.describe()}" if cpu_isa.describe() else ""
    print(f"{args.model}, {args.dtype}, {args.rows} row(s), {torch.get_num_threads()} threads{cap}, "
          f"load average {os.getloadavg()[0]:.1f}; copy bandwidth {copy_gb_s:.1f} GB/s (read + write)")
    print(f"{'weights':<32} {'MB read':>8} {'ms / pass':>10} {'GB/s':>6}")
    for name, (_, _, nbytes) in rows.items():
        ms = statistics.median(times[name]) * 1e3
        print(f"{name:<32} {nbytes / 1e6:>8.1f} {ms:>10.2f} {nbytes / ms / 1e6:>6.1f}")
        result["rows_out"].append({"weights": name, "mb": nbytes / 1e6, "ms": ms, "gb_s": nbytes / ms / 1e6})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
