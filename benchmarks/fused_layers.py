"""One decode step's layers on a GGUF's blocks, bf16: the one-pass loops around the GEMMs against the ATen ops.

Runs the real model (`kvscope fetch smollm2-135m`) with --quantization gguf, captures the first decode-only
step's inputs, and calls kvscope::decode_layers on them with fused=False and fused=True, interleaved.
    python benchmarks/fused_layers.py --threads 2 --repeats 60
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=60)
    args = ap.parse_args()
    import torch

    from kvscope.engine import LLM, SamplingParams
    from kvscope.engine.loader import named_models

    torch.set_num_threads(args.threads)
    llm = LLM(named_models.cached_path(args.model), device="cpu", dtype="bfloat16", num_blocks=64,
              quantization="gguf", cpu_threads=args.threads)
    decoder = llm.engine.runner.decoder
    native = decoder.native
    if native is None:
        raise SystemExit(f"the C++ layers are not loaded: {decoder.native_why}")
    captured = []

    class Capture:
        def run(self, hidden, cos, signed_sin, kv_cache, meta):
            if not captured:
                captured.append((hidden.clone(), cos, signed_sin, kv_cache, meta))
            return native.run(hidden, cos, signed_sin, kv_cache, meta)

    decoder.native = Capture()
    llm.generate(["<|im_start|>user\nTell me a story<|im_end|>\n<|im_start|>assistant\n"],
                 SamplingParams(max_tokens=3, ignore_eos=True))
    decoder.native = native
    inputs = captured[0]
    times: dict[bool, list[float]] = {False: [], True: []}
    variants = {fused: dataclasses.replace(native, fused=fused) for fused in times}
    for _ in range(args.repeats):
        for fused, layers in variants.items():
            t0 = time.perf_counter()
            layers.run(*inputs)
            times[fused].append(time.perf_counter() - t0)
    print(f"{args.model}, {len(native.scaling)} layers, {inputs[0].shape[0]} row(s), bfloat16, {args.threads} threads,"
          f" load average {os.getloadavg()[0]:.1f}")
    for fused, got in times.items():
        got.sort()
        print(f"fused={fused}: median {1e3 * statistics.median(got):.2f} ms, p10 {1e3 * got[len(got) // 10]:.2f} ms")


if __name__ == "__main__":
    main()
