"""kvscope's GPU check: kernel correctness in bf16, the decode kernel table, end-to-end throughput, a GPU trace.

    benchmarks/gpu_check.sh RESULTS_DIR            # on a CUDA machine, under 8 minutes on an H200
    python benchmarks/gpu_check.py --dry-run --out DIR   # CPU: tiny shapes through every code path

Writes RESULTS_DIR/gpu-check.json after every section, so a failure or a
timeout keeps what finished:

    {"gpu": ..., "versions": {...}, "correctness": [...],
     "decode": [{"kernel", "B", "ctx", "num_splits", "ms", "gbps", "sdpa_gbps", "vs_sdpa",
                 "graph_ms", "graph_gbps", "sdpa_graph_gbps", "vs_sdpa_graph", ...}],
     "e2e": [{"name", "output_tok_per_s", ...}],
     "step_split": {"chunked": {"decode": {...}, "mixed": {...}, "all": {...}}},
     "trace": ..., "errors": {...}}

Each section runs in its own child process (a CUDA error or an out-of-memory cannot
spoil the next one) and records its error instead of stopping; a time budget
(--budget-s) cuts off the rest. Nothing here imports pyzmq or textual; the sections that
run kvscope's engine (e2e:*) need msgspec, which the GPU image may lack (carry its wheel:
docs/KERNELS.md, "The GPU check").
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import random
import sys
import time
import traceback

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

GPU_DECODE_SHAPES = dict(B=(1, 16, 64, 256), ctx=(512, 4096, 16384), heads=32, kv_heads=8, head_dim=128,
                         block_size=16)
DRY_DECODE_SHAPES = dict(B=(1, 3), ctx=(40, 300), heads=8, kv_heads=2, head_dim=16, block_size=16)
ONE_PASS_B = (1, 16)  # batch sizes that also get a row with the one-pass kernel forced, beside split-K
L2_ROTATE_BYTES = 192 << 20  # graph timings cycle through copies of K/V at least this big: past any L2
MAX_COPIES = 128
ENGINE_NEEDS = ("msgspec",)  # what the e2e sections import beyond torch, triton and transformers


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Check:
    def __init__(self, out_dir: str, dry_run: bool) -> None:
        self.out_dir = out_dir
        self.dry = dry_run
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.path = os.path.join(out_dir, "gpu-check-dry-run.json" if dry_run else "gpu-check.json")
        self.result: dict = {"gpu": None, "versions": {}, "dry_run": dry_run, "correctness": [], "decode": [],
                             "e2e": [], "step_split": {}, "trace": None, "errors": {}, "seconds": {}}

    def save(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.result, f, indent=1)
        os.replace(tmp, self.path)

    def section(self, name: str, fn) -> None:
        log(f"{name} ...")
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # one failing section must not lose the others
            log(f"{name} FAILED: {type(e).__name__}: {e}")
            self.result["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
        self.result["seconds"][name] = round(time.perf_counter() - t0, 2)
        self.save()
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def time_ms(self, fn) -> float:
        if self.dry:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=60))

    def graph_ms(self, fns) -> float | None:
        """Device ms of one call, with no host launch cost: the calls in fns (each over its own copy of
        the data, so that together they are past the L2 cache), cycled, captured in one CUDA graph,
        replayed; the median of five replays. None in a dry run (no CUDA graphs on a CPU)."""
        if self.dry:
            return None
        for fn in fns:  # compiles, and caches each step plan, outside the capture
            fn()
        torch.cuda.synchronize()
        rounds = max(1, -(-16 // len(fns)))
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                for _ in range(rounds):
                    for fn in fns:
                        fn()
        except Exception as e:  # a call that cannot be captured loses its graph column, not the table
            log(f"  CUDA graph capture failed: {type(e).__name__}: {e}")
            self.result["errors"].setdefault("decode/graph", f"{type(e).__name__}: {e}")
            torch.cuda.synchronize()
            return None
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(5):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / (rounds * len(fns)))
        del graph
        return sorted(times)[len(times) // 2]

    # ---- 0: environment ----------------------------------------------------------------
    def environment(self) -> None:
        import importlib.metadata as md

        versions = {"python": platform.python_version(), "torch": torch.__version__,
                    "cuda": torch.version.cuda}
        for pkg in ("triton", "transformers", "msgpack", "msgspec"):
            try:
                versions[pkg] = md.version(pkg)
            except md.PackageNotFoundError:
                versions[pkg] = None
        self.result["versions"] = versions
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(0)
            self.result["gpu"] = torch.cuda.get_device_name(0)
            self.result["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
            self.result["sm_count"] = props.multi_processor_count
        else:
            self.result["gpu"] = "none (dry run on CPU, Triton interpreter)"

    # ---- 1: correctness ----------------------------------------------------------------
    def correctness(self) -> None:
        from kvscope.kernels import reference
        from kvscope.kernels.triton import attention as triton_attention
        from kvscope.kernels.triton import decode as triton_decode
        from kvscope.kernels.triton import prefill as triton_prefill
        from kvscope.kernels.testing import make_case

        dtype = torch.float32 if self.dry else torch.bfloat16
        tol = 2e-4 if self.dry else 3e-2
        rows = self.result["correctness"]
        if self.dry:
            cases = [(8, 2, 16, 16, [1, 1, 9], [17, 40, 30])]
        else:
            cases = [(32, 8, 128, 16, [1] * 6 + [37, 300], [1, 100, 513, 4096, 16383, 7, 900, 300]),
                     (16, 16, 64, 32, [1] * 3 + [64], [33, 1000, 5000, 200]),
                     (32, 4, 128, 16, [1] * 4 + [129], [15, 2048, 3000, 77, 129]),
                     (16, 8, 128, 32, [1] * 2 + [1000], [20000, 31, 1500])]

        def record(name, shape, actual, expected):
            err = (actual.float() - expected.float()).abs().max().item()
            rows.append({"kernel": name, "shape": shape, "dtype": str(dtype).removeprefix("torch."),
                         "max_abs_err": err, "ok": bool(err <= tol + tol * expected.float().abs().max().item())})
            log(f"  {name} {shape}: max abs err {err:.2e} {'ok' if rows[-1]['ok'] else 'MISMATCH'}")

        for h, kvh, d, bs, qlens, slens in cases:
            shape = f"H{h}/KVH{kvh} d{d} block{bs} q{qlens} ctx{slens}"
            q, kc, vc, meta = make_case(qlens, slens, heads=h, kv_heads=kvh, head_dim=d, block_size=bs, dtype=dtype,
                                        device=self.device, seed=h + d)
            t = q.shape[0]
            key = torch.randn(t, kvh, d, device=self.device).to(dtype)
            value = torch.randn(t, kvh, d, device=self.device).to(dtype)
            rk, rv = kc.clone(), vc.clone()
            reference.write_kv(key, value, rk, rv, meta.slot_mapping)
            triton_attention.write_kv(key, value, kc, vc, meta.slot_mapping)
            rows.append({"kernel": "write_kv", "shape": shape, "dtype": str(dtype).removeprefix("torch."),
                         "max_abs_err": 0.0 if torch.equal(rk, kc) and torch.equal(rv, vc) else None,
                         "ok": bool(torch.equal(rk, kc) and torch.equal(rv, vc))})
            expected = reference.paged_attention(q, rk, rv, meta, d ** -0.5)
            record("paged_attention", shape, triton_attention.paged_attention(q, kc, vc, meta, d ** -0.5), expected)
            window = 24 if self.dry else 1000  # sliding window: not a multiple of the block size
            record(f"paged_attention window={window}", shape,
                   triton_attention.paged_attention(q, kc, vc, meta, d ** -0.5, window),
                   reference.paged_attention(q, rk, rv, meta, d ** -0.5, window))
            decodes = [s for s, n in enumerate(qlens) if n == 1]
            prefills = [s for s, n in enumerate(qlens) if n > 1]
            ids = torch.tensor(decodes, dtype=torch.int32, device=self.device)
            for splits in ((1, 4) if self.dry else (1, 4, 32)):  # 32: the reduce reads two chunks
                out = torch.zeros_like(q)
                triton_decode.decode_attention(q, kc, vc, out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                               d ** -0.5, len(decodes), max(slens), seq_ids=ids, num_splits=splits)
                rows_idx = meta.query_start_loc[ids.long()].long()
                record(f"decode splits={splits}", shape, out[rows_idx], expected[rows_idx])
            if prefills:
                out = torch.zeros_like(q)
                pid = torch.tensor(prefills, dtype=torch.int32, device=self.device)
                triton_prefill.prefill_attention(q, kc, vc, out, meta.block_tables, meta.seq_lens,
                                                 meta.query_start_loc, d ** -0.5, len(prefills),
                                                 max(qlens[s] for s in prefills), seq_ids=pid)
                qsl = meta.query_start_loc.tolist()
                sel = torch.cat([torch.arange(qsl[s], qsl[s + 1]) for s in prefills]).to(self.device)
                record("prefill", shape, out[sel], expected[sel])
        bad = [r for r in rows if not r["ok"]]
        if bad:
            raise AssertionError(f"{len(bad)} kernel checks out of tolerance: {[r['kernel'] for r in bad]}")

    # ---- 2: decode kernel table ----------------------------------------------------------
    def decode_table(self) -> None:
        """Per B x context: the dispatcher (split-K or one pass, as chosen) and, for ONE_PASS_B, the
        one-pass kernel forced; each beside SDPA on the same K/V laid out contiguously. `ms` is
        do_bench's (host launch included, as eager steps pay it), `graph_ms` a CUDA graph's replay
        (device time alone, as decode steps run in the engine), over enough copies of K/V to be
        past L2."""
        from kvscope.kernels.metadata import AttentionMetadata
        from kvscope.kernels.triton import attention as triton_attention
        from kvscope.kernels.triton import decode as triton_decode

        shp = DRY_DECODE_SHAPES if self.dry else GPU_DECODE_SHAPES
        one_pass_b = (1,) if self.dry else ONE_PASS_B
        h, kvh, d, bs = shp["heads"], shp["kv_heads"], shp["head_dim"], shp["block_size"]
        dtype = torch.float32 if self.dry else torch.bfloat16
        elem = torch.empty((), dtype=dtype).element_size()
        dev = self.device
        scale = d ** -0.5
        for ctx in shp["ctx"]:
            for b in shp["B"]:
                nb = -(-ctx // bs)
                total = b * nb
                kv_bytes = 2 * b * ctx * kvh * d * elem
                copies = 1 if self.dry else max(1, min(MAX_COPIES, -(-L2_ROTATE_BYTES // kv_bytes)))
                caches = [(torch.randn(total, bs, kvh, d, device=dev, dtype=dtype),
                           torch.randn(total, bs, kvh, d, device=dev, dtype=dtype)) for _ in range(copies)]
                perm = torch.randperm(total, device=dev).to(torch.int32)
                meta = AttentionMetadata(
                    slot_mapping=torch.zeros(b, dtype=torch.long, device=dev),
                    query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=dev),
                    seq_lens=torch.full((b,), ctx, dtype=torch.int32, device=dev),
                    block_tables=perm.view(b, nb), block_size=bs, query_lens_host=[1] * b, seq_lens_host=[ctx] * b)
                q = torch.randn(b, h, d, device=dev, dtype=dtype)
                out = torch.empty_like(q)
                chosen = triton_decode.choose_num_splits(b, kvh, ctx, dev)

                def dispatch(kc, vc):
                    return lambda: triton_attention.paged_attention(q, kc, vc, meta, scale)

                def forced(kc, vc, splits):
                    return lambda: triton_decode.decode_attention(q, kc, vc, out, meta.block_tables, meta.seq_lens,
                                                                  meta.query_start_loc, scale, b, ctx,
                                                                  num_splits=splits)

                timed = [("split-k" if chosen > 1 else "one-pass", chosen, dispatch, False)]
                if b in one_pass_b and chosen > 1:
                    timed.append(("one-pass", 1, lambda kc, vc: forced(kc, vc, 1), True))
                kernel_rows = []
                for kernel, splits, make, was_forced in timed:
                    ms = self.time_ms(make(*caches[0]))
                    graph_ms = self.graph_ms([make(kc, vc) for kc, vc in caches])
                    kernel_rows.append({"kernel": kernel, "forced": was_forced, "num_splits": splits, "ms": ms,
                                        "graph_ms": graph_ms})
                # SDPA on the same K/V laid out contiguously: [B, KVH, ctx, D]
                idx = perm.view(b, nb).long()

                def contiguous(cache):
                    return cache[idx].reshape(b, nb * bs, kvh, d)[:, :ctx].transpose(1, 2).contiguous()

                dense = [(contiguous(kc), contiguous(vc)) for kc, vc in caches]
                del caches
                q4 = q.unsqueeze(2)

                def sdpa(kc, vc):
                    return lambda: F.scaled_dot_product_attention(q4, kc, vc, scale=scale, enable_gqa=True)

                sdpa_ms = self.time_ms(sdpa(*dense[0]))
                sdpa_graph_ms = self.graph_ms([sdpa(kc, vc) for kc, vc in dense])
                del dense
                n_copy = min(kv_bytes, 2 << 30) // elem
                src = torch.empty(n_copy, device=dev, dtype=dtype)
                dst = torch.empty_like(src)
                copy_ms = self.time_ms(lambda: dst.copy_(src))
                del src, dst
                for k in kernel_rows:
                    row = {"kernel": k["kernel"], "forced": k["forced"], "B": b, "ctx": ctx,
                           "num_splits": k["num_splits"], "ms": k["ms"], "gbps": kv_bytes / k["ms"] / 1e6,
                           "sdpa_ms": sdpa_ms, "sdpa_gbps": kv_bytes / sdpa_ms / 1e6,
                           "copy_gbps": 2 * n_copy * elem / copy_ms / 1e6,
                           "graph_ms": k["graph_ms"], "sdpa_graph_ms": sdpa_graph_ms, "kv_copies": copies,
                           "heads": h, "kv_heads": kvh, "head_dim": d, "block_size": bs,
                           "dtype": str(dtype).removeprefix("torch.")}
                    row["vs_sdpa"] = row["gbps"] / row["sdpa_gbps"]
                    both = k["graph_ms"] is not None and sdpa_graph_ms is not None
                    row["graph_gbps"] = kv_bytes / k["graph_ms"] / 1e6 if both else None
                    row["sdpa_graph_gbps"] = kv_bytes / sdpa_graph_ms / 1e6 if both else None
                    row["vs_sdpa_graph"] = sdpa_graph_ms / k["graph_ms"] if both else None
                    self.result["decode"].append(row)
                    graph = (f"  graph {row['graph_gbps']:8.1f} GB/s ({row['vs_sdpa_graph'] * 100:5.1f}% of sdpa's "
                             f"{row['sdpa_graph_gbps']:.1f})" if both else "")
                    log(f"  B={b:4d} ctx={ctx:6d} {k['kernel']:8s} splits={k['num_splits']:2d}: {k['ms']:8.3f} ms "
                        f"{row['gbps']:8.1f} GB/s  sdpa {row['sdpa_gbps']:8.1f} GB/s ({row['vs_sdpa'] * 100:5.1f}%)"
                        f"{graph}  copy {row['copy_gbps']:8.1f} GB/s")
                self.save()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()

    # ---- 3 + 4: end to end, with a trace of the kvscope run --------------------------------
    def workload(self, n: int, lo: int, hi: int, vocab: int):
        from kvscope.workload import WorkloadRequest

        rng = random.Random(0)
        return [WorkloadRequest(arrival=0.0, prompt=[rng.randrange(3, min(vocab, 50000)) for _ in
                                                     range(rng.randint(lo, hi))],
                                max_tokens=rng.randint(lo, hi), ignore_eos=True) for _ in range(n)]

    def record_step_split(self, name: str, timer, price=None) -> dict:
        """A run's step timings (kvscope.engine.worker.step_timer), per step kind, into the JSON."""
        from kvscope.engine.worker.step_timer import FIELDS

        split = timer.summary(price)
        self.result["step_split"][name] = split
        for kind, g in split.items():
            ms = "  ".join(f"{f.removesuffix('_ms')} {g[f]['mean']:.2f}" for f in FIELDS)
            roof = f"; roofline {g['roofline_pct']:.1f}% of its wall time" if g.get("roofline_pct") else ""
            log(f"  {name} {kind:7s} steps {g['steps']:5d} (graphs {g['graph_steps']}): mean ms {ms}; "
                f"device {g['device_share'] * 100:.0f}% of the wall time{roof}")
        self.save()
        return split

    def e2e(self, args) -> None:
        from dataclasses import replace

        missing = []
        for name in ENGINE_NEEDS:
            try:
                importlib.import_module(name)
            except ImportError:
                missing.append(name)
        if missing:
            raise RuntimeError(f"kvscope's engine needs {', '.join(missing)}, which this python lacks: carry its "
                               f"wheel (docs/KERNELS.md, 'The GPU check')")
        from kvscope.bench import roofline
        from kvscope.bench.harness import mode_row, warm_up
        from kvscope.bench.peers import PEERS
        from kvscope.engine.sim.catalog import CATALOG_DTYPES, shape_of_hf_config
        from kvscope.engine.sim.runner import SimRunner
        from kvscope.engine.config import EngineConfig
        from kvscope.engine.llm_engine import LLMEngine
        from kvscope.engine.worker import step_timer
        from kvscope.serve.driver import ServeOptions, Server
        from kvscope.traces.writer import TraceWriter

        if self.dry:
            model, n, lo, hi = "tiny", 4, 4, 12
            config = EngineConfig(model=model, device="cpu", mode="chunked", max_num_seqs=4,
                                  max_num_batched_tokens=32, num_blocks=64, seed=0)
        else:
            model, n, lo, hi = "qwen3-0.6b-shape", args.num_requests, 100, 1024
            config = EngineConfig(model=model, device="cuda", dtype="bfloat16", mode="chunked", max_num_seqs=256,
                                  max_num_batched_tokens=args.max_num_batched_tokens, seed=0)
        vocab = 256 if self.dry else 151936
        items = self.workload(n, lo, hi, vocab)
        self.result["e2e_workload"] = {"model": model, "num_requests": n, "prompt_len": [lo, hi],
                                       "output_len": [lo, hi], "ignore_eos": True,
                                       "max_num_batched_tokens": config.max_num_batched_tokens}
        rows = self.result["e2e"]
        names = [x for x in args.e2e.split(",") if x]

        if "chunked" in names:
            t0 = time.perf_counter()
            engine = LLMEngine(config)
            log(f"  chunked: engine ready in {time.perf_counter() - t0:.1f}s ({engine.num_blocks} KV blocks, "
                f"attention {engine.runner.ops.name}, cuda graphs {'on' if getattr(engine.runner, 'graphs', None) else 'off'})")
            warm_up(engine)
            steps = roofline.StepShapes(engine.runner)
            timer = step_timer.attach(engine, shape_of=SimRunner.shape)  # host/device split of every step
            trace_dir = self.out_dir if self.dry else args.trace_dir
            os.makedirs(trace_dir, exist_ok=True)
            trace_path = os.path.join(trace_dir, "gpu-h200-chunked.kvtrace" if "H200" in str(self.result["gpu"])
                                      else ("dry-run.kvtrace" if self.dry else "gpu-chunked.kvtrace"))
            writer = TraceWriter(trace_path, engine.hello(), snapshot_provider=engine.snapshot)
            engine.attach(writer)
            server = Server(engine, ServeOptions(verbose_rejects=False))
            server.run(items)
            engine.close()
            writer.close()
            row = mode_row("chunked", engine, server, num_blocks=engine.num_blocks,
                           cuda_graphs=getattr(engine.runner, "graphs", None) is not None,
                           attention=engine.runner.ops.name)
            # the roofline of the same steps at this device's measured GEMM rate and copy bandwidth
            shape = shape_of_hf_config(engine.loaded.model.config, CATALOG_DTYPES[engine.dtype], name=model)
            peaks = roofline.measure_peaks(shape, engine.backend.torch_dtype, config.max_num_batched_tokens,
                                           device=engine.device)
            roof = roofline.Roofline.of(peaks, shape)
            row.extra.update(roof.extra(steps.shapes, row.duration_s))
            self.result["roofline"] = {"peaks": peaks.to_dict(), "formula": roofline.FORMULA}
            log(f"  chunked: {peaks.line()}; roofline {row.extra['roofline_pct']:.1f}% of the run")
            self.record_step_split("chunked", timer,
                                   price=lambda s: roofline.step_roofline_s(roof.cost.terms(s)) if s.tokens else 0.0)
            row = row.to_dict()
            rows.append(row)
            self.result["trace"] = {"path": trace_path, "bytes": os.path.getsize(trace_path)}
            log(f"  chunked: {row['output_tok_per_s']:.1f} output tok/s, {row['steps']} steps; "
                f"trace {trace_path} ({os.path.getsize(trace_path) / 2**20:.1f} MiB)")
            self.save()
            del engine, server, writer
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        peer_config = replace(config, max_num_seqs=args.static_batch if not self.dry else 4)
        for name in ("hf-generate-batch", "hf-static"):
            if name not in names:
                continue
            try:
                if name == "hf-static":  # padded batches run to their longest output: the first static_requests
                    row = PEERS[name](peer_config, items[: args.static_requests]).to_dict()
                    row["num_requests"] = len(items[: args.static_requests])
                else:  # stops itself after --generate-batch-s (or before the section's time is up), with the
                    # requests finished by then
                    limit = args.generate_batch_s
                    if args.time_left_s:
                        limit = min(limit, args.time_left_s - (time.monotonic() - STARTED) - 20)
                    row = PEERS[name](peer_config, items, time_limit_s=limit).to_dict()
                rows.append(row)
                log(f"  {name}: {row['output_tok_per_s']:.1f} output tok/s")
            except Exception as e:
                self.result["errors"][f"e2e/{name}"] = f"{type(e).__name__}: {e}"
                log(f"  {name} FAILED: {type(e).__name__}: {e}")
            self.save()
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()


# generate_batch before static generate: static padded batches were measured on the H200 already
# (benchmarks/results/gpu-check-h200.json) and take the longest, so they go last
SECTIONS = ("correctness", "decode", "e2e:chunked", "e2e:hf-generate-batch", "e2e:hf-static")
STARTED = time.monotonic()


def run_section(args) -> int:
    """Child mode: one section in this process, its part of the result written to --fragment."""
    check = Check(args.out, args.dry_run)
    check.path = args.fragment  # saves (after every row) go to the fragment, which the parent merges
    check.environment()
    name = args.section
    if name == "correctness":
        check.section(name, check.correctness)
    elif name == "decode":
        check.section(name, check.decode_table)
    elif name.startswith("e2e:"):
        args.e2e = name.removeprefix("e2e:")
        check.section(name, lambda: check.e2e(args))
    else:
        raise SystemExit(f"unknown section {name!r}")
    return 1 if check.result["errors"] else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results", help="results folder (default: benchmarks/results)")
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, Triton interpreter, tiny model")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma list, in order")
    p.add_argument("--budget-s", type=float, default=450.0, help="stop starting work after this many seconds")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--static-batch", type=int, default=128, help="hf-static batch size (padded generate)")
    p.add_argument("--static-requests", type=int, default=128,
                   help="hf-static runs the first N requests (one batch of 128: two took 4 minutes on an H200)")
    p.add_argument("--generate-batch-s", type=float, default=150.0,
                   help="hf-generate-batch stops after this long, reporting the requests finished by then")
    p.add_argument("--trace-dir", default="traces")
    p.add_argument("--section", help=argparse.SUPPRESS)  # child mode
    p.add_argument("--fragment", help=argparse.SUPPRESS)
    p.add_argument("--time-left-s", type=float, help=argparse.SUPPRESS)  # child mode: before the parent kills it
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here; use --dry-run for the CPU walk-through", file=sys.stderr)
        return 2
    if args.section:
        return run_section(args)
    # Each section runs in its own process: a CUDA error (or an out-of-memory) in one cannot poison
    # the CUDA context or the memory of the next, and a hung section is cut off by the time budget.
    import subprocess

    deadline = time.monotonic() + args.budget_s
    check = Check(args.out, args.dry_run)
    check.section("environment", check.environment)
    res = check.result
    for name in [x for x in args.sections.split(",") if x]:
        left = deadline - time.monotonic()
        if left < 10:
            res["errors"][name] = "skipped: out of time budget"
            log(f"{name}: skipped, out of time")
            continue
        log(f"{name} (in a child process, {left:.0f}s left) ...")
        fragment = os.path.join(args.out, f".gpu-check-{name.replace(':', '-')}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--section", name, "--fragment", fragment,
               "--out", args.out, "--num-requests", str(args.num_requests),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--static-batch", str(args.static_batch), "--static-requests", str(args.static_requests),
               "--generate-batch-s", str(args.generate_batch_s), "--trace-dir", args.trace_dir,
               "--time-left-s", f"{left:.1f}"]
        if args.dry_run:
            cmd.append("--dry-run")
        t0 = time.perf_counter()
        try:
            rc = subprocess.run(cmd, timeout=left).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        res["seconds"][name] = round(time.perf_counter() - t0, 2)
        try:
            with open(fragment) as f:
                part = json.load(f)
            os.remove(fragment)
        except (OSError, ValueError):
            part = {}
        for key in ("correctness", "decode", "e2e"):
            res[key].extend(part.get(key) or [])
        res["step_split"].update(part.get("step_split") or {})
        for key in ("trace", "e2e_workload", "roofline"):
            if part.get(key) is not None:
                res[key] = part[key]
        res["errors"].update(part.get("errors") or {})
        if rc != 0 and not part.get("errors"):
            res["errors"][name] = f"child process ended with {rc}"
        check.save()
    log(f"wrote {check.path}; errors: {sorted(res['errors']) or 'none'}")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
