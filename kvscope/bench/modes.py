"""`kvscope bench`: one workload, one model, one process, through the four modes and two peers.

Every request arrives at t=0 (an offline batch), so all rows see the same work
and TTFT includes queueing. Rows:
- naive, static, continuous, chunked: kvscope's scheduler modes;
- single-stream (asked for by --modes): chunked with one request running at a time, as a person chatting
  and as llama-cpp's row serve; its ITL is one stream's;
- hf-static: transformers `generate` on padded static batches of max_num_seqs;
- hf-generate-batch: transformers' own continuous batching (`generate_batch`'s manager).

The peers run in the same process after kvscope's rows, so with the same torch thread count
(the result's host.threads, printed in the table's heading).
"""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvscope.bench import events, peers, roofline
from kvscope.bench import SINGLE_STREAM
from kvscope.bench.harness import bench_workload, mode_row, model_info, row_config, run_config
from kvscope.goodput import NO_SLO
from kvscope.bench.report import ranking_lines, rows_table
from kvscope.engine.config import MODES, EngineConfig, Mode
from kvscope.errors import KvscopeError
from kvscope.engine.loader.gguf_blocks import BLOCKS_MAX_ROWS
from kvscope.engine.sim.catalog import CATALOG_DTYPES, shape_of_hf_config

BENCH_MAX_PROMPT_LEN = 2048  # keeps hf-static's dense padded attention inside CPU memory


@dataclass
class BenchOptions:
    workload: str = "mixed"
    num_requests: int | None = None  # None: the workload preset's own count
    modes: list[str] = field(default_factory=lambda: list(MODES))
    peers: list[str] = field(default_factory=lambda: list(peers.DEFAULT_PEERS))
    max_prompt_len: int = BENCH_MAX_PROMPT_LEN
    events: bool = False  # also measure the cost of publishing + recording events
    roofline: bool = False  # measure the machine's peaks and give each row its roofline % (benchmarks/roofline.py)
    slo: Any = None  # kvscope.goodput.Slo: each kvscope row's goodput (docs/GOODPUT.md)


def check_row_names(options: BenchOptions) -> None:
    """Every row's name, checked before minutes are spent on the first ones."""
    for mode in options.modes:
        if mode not in (*MODES, SINGLE_STREAM):
            raise KvscopeError(f"unknown mode {mode!r} (choose from {', '.join((*MODES, SINGLE_STREAM))})")
    for peer in options.peers:
        if peer not in peers.PEERS:
            raise KvscopeError(f"unknown peer {peer!r} (choose from {', '.join(peers.PEERS)})")


def bench_items(config: EngineConfig, options: BenchOptions) -> tuple[list, str]:
    """The bench's requests for this model (all arriving at t=0), and the device it runs on."""
    vocab, eos, device = model_info(config)
    return bench_workload(config, options.workload, options.num_requests, vocab, eos, options.max_prompt_len), device


def run_bench(config: EngineConfig, options: BenchOptions, log=print) -> dict:
    check_row_names(options)
    for peer in options.peers:
        if peer in peers.PEER_CHECKS:
            peers.PEER_CHECKS[peer](config)
    items, device = bench_items(config, options)
    rows = []
    ideal: roofline.Roofline | None = None  # once the machine is measured (after the first row)
    thread_choice = config.cpu_threads  # the peers run at the count kvscope's own runner ended on
    # the first row's greedy tokens, for the peers that compare theirs (same prompts, both greedy)
    reference: dict | None = {} if any(p in peers.REFERENCE_PEERS for p in options.peers) else None
    for mode in options.modes:
        log(f"[bench] {mode} ...", file=sys.stderr)
        steps: list = []
        engine, server = run_config(row_config(config, mode), items, slo=options.slo or NO_SLO,
                                    before_run=(lambda e: steps.append(roofline.StepShapes(e.runner)))
                                    if options.roofline else None, outputs=reference if not rows else None)
        if not rows:
            log(f"[bench] {engine.describe_dtype()}", file=sys.stderr)
            log(f"[bench] {engine.describe_kv_cache()}", file=sys.stderr)
        tuner = getattr(engine.backend, "thread_tuner", None)  # the sim backend has none
        if tuner is not None:
            thread_choice = tuner.best
        row = mode_row(mode, engine, server, cpu_threads=tuner.best if tuner else engine.backend.cpu_threads)
        weights = decode_weight_bytes(engine)
        if weights is not None:
            row.extra["weights_mb_per_token"] = weights / 1e6
        if options.roofline:
            ideal = ideal or _measure_machine(engine, config, log)
            row.extra.update(ideal.extra(steps[0].shapes, row.duration_s))
        rows.append(row.to_dict())
    for peer in options.peers:
        log(f"[bench] {peer} ...", file=sys.stderr)
        kw = {"reference": reference} if peer in peers.REFERENCE_PEERS else {}
        row = peers.PEERS[peer](replace(config, cpu_threads=thread_choice), items, **kw)
        if ideal is not None:
            row.extra.update(ideal.extra(peers.peer_step_shapes(peer, items, config), row.duration_s))
        rows.append(row.to_dict())
    result = {
        "workload": options.workload,
        "model": config.model,
        "device": device,
        "num_requests": len(items),
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_prompt_len": options.max_prompt_len,
        "host": {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "rows": rows,
    }
    if ideal is not None:
        result["roofline"] = ideal.to_dict()
    if options.events:
        log("[bench] events on/off ...", file=sys.stderr)
        result["events"] = events.measure_event_overhead(replace(config, mode=Mode.CHUNKED), items)
    return result


def decode_weight_bytes(engine) -> int | None:
    """Bytes of weights a decode token reads: every weight (the lm_head's packed copy included) but the input
    embedding, of which a token reads one row; under --quantization gguf with at most BLOCKS_MAX_ROWS running, the
    GGUF's blocks instead (larger decode steps run on the dense weights). None on the sim."""
    blocks = getattr(getattr(engine, "backend", None), "gguf_weights", None)
    if blocks is not None and engine.config.effective_max_num_seqs <= BLOCKS_MAX_ROWS:
        return blocks.nbytes  # --quantization gguf: decode steps this small read the GGUF's blocks (gguf_blocks.py)
    loaded = engine.loaded
    model = getattr(loaded, "model", None)
    if not isinstance(model, torch.nn.Module) or not getattr(loaded, "weight_bytes", 0):
        return None
    embed = model.get_input_embeddings().weight
    return loaded.weight_bytes - embed.numel() * embed.element_size()


def _measure_machine(engine, config: EngineConfig, log) -> roofline.Roofline:
    """The roofline's peaks, measured once, with the engine's model shape and dtype, on every thread the engine
    may use (--cpu-threads, else every core): the machine's limit, not the count a thread tuner last chose."""
    shape = shape_of_hf_config(engine.loaded.model.config, CATALOG_DTYPES[engine.dtype], name=config.model)
    log("[bench] measuring GEMM FLOP/s and memory bandwidth for the roofline ...", file=sys.stderr)
    threads = getattr(engine.backend, "cpu_threads", None)  # None: CUDA, or the sim
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        peaks = roofline.measure_peaks(shape, engine.backend.torch_dtype, config.max_num_batched_tokens)
    finally:
        torch.set_num_threads(before)
    log(f"[bench] {peaks.line()}", file=sys.stderr)
    return roofline.Roofline.of(peaks, shape)


def greedy_lines(result: dict) -> list[str]:
    """For a peer that compared its greedy tokens with kvscope's first row: how many came out the same."""
    first = result["rows"][0]["name"] if result.get("rows") else "?"
    out = []
    for r in result.get("rows", []):
        if r.get("greedy_compared"):
            line = (f"{r['name']}: greedy tokens identical to kvscope's {first} row in {r['greedy_same']} of "
                    f"{r['greedy_compared']} requests")
            if r.get("greedy_first_diff_p50") is not None:
                line += f"; the others first differ at token {r['greedy_first_diff_p50']:.0f} (median)"
            out.append(line)
    return out


def print_table(result: dict) -> None:
    print(rows_table(result))
    for line in ranking_lines(result) + greedy_lines(result):
        print(line)
    if "roofline" in result:
        p = result["roofline"]["peaks"]
        print(f"roofline: GEMM {p['flops_per_s'] / 1e9:,.0f} GFLOP/s ({p['dtype']}, {p['threads']} threads), "
              f"copy {p['bytes_per_s'] / 1e9:.1f} GB/s; {result['roofline']['formula']}")
    if "events" in result:
        print("\n" + events.summary_line(result["events"]))

