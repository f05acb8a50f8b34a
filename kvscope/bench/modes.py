"""`kvscope bench`: one workload, one model, one process, through the four modes and two peers.

Every request arrives at t=0 (an offline batch), so all rows see the same work
and TTFT includes queueing. Rows:
- naive, static, continuous, chunked: kvscope's scheduler modes;
- hf-static: transformers `generate` on padded static batches of max_num_seqs;
- hf-generate-batch: transformers' own continuous batching (`generate_batch`'s manager).
"""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass, field, replace

from kvscope.engine.config import EngineConfig
from kvscope.engine.metrics import MetricsCollector, fmt_ms, fmt_pct

BENCH_MAX_PROMPT_LEN = 2048  # keeps hf-static's dense padded attention inside CPU memory


@dataclass
class BenchOptions:
    workload: str = "mixed"
    num_requests: int | None = None  # None: the workload preset's own count
    modes: list[str] = field(default_factory=lambda: ["naive", "static", "continuous", "chunked"])
    peers: list[str] = field(default_factory=lambda: ["hf-static", "hf-generate-batch"])
    max_prompt_len: int = BENCH_MAX_PROMPT_LEN
    events: bool = False  # also measure the cost of publishing + recording events


def _workload(config: EngineConfig, options: BenchOptions, vocab: int, eos: frozenset[int]):
    from kvscope import workload as wl
    from kvscope.serve.driver import reserved_top_ids

    spec = wl.load_spec(options.workload)
    reserved = reserved_top_ids(vocab, eos)
    items = wl.generate(spec, vocab_size=vocab, num_requests=options.num_requests, seed=config.seed,
                        max_prompt_len=options.max_prompt_len, reserved_ids=reserved)
    return [replace(item, arrival=0.0) for item in items]


def bench_items(config: EngineConfig, options: BenchOptions) -> tuple[list, str]:
    """The bench's requests for this model (all arriving at t=0), and the device it runs on."""
    from kvscope.engine.llm_engine import LLMEngine

    probe = LLMEngine(replace(config, num_blocks=config.num_blocks or 64))
    items = _workload(config, options, probe.loaded.vocab_size, probe.loaded.eos_token_ids)
    device = str(probe.device)
    del probe
    return items, device


def _row(name: str, m: MetricsCollector, preemptions: int, kv_waste: float | None, extra: dict | None = None) -> dict:
    s = m.summary(preemptions=preemptions, kv_waste=kv_waste or 0.0, steps=0)
    row = {
        "name": name,
        "output_tok_per_s": s.output_tok_per_s,
        "ttft_mean_s": s.ttft_mean_s,
        "ttft_p99_s": s.ttft_p99_s,
        "itl_p99_s": s.itl_p99_s,
        "preemptions": preemptions,
        "kv_waste": kv_waste,
        "output_tokens": s.output_tokens,
        "duration_s": s.duration_s,
    }
    row.update(extra or {})
    return row


def mode_row(name: str, engine, server) -> dict:
    """One bench row for a kvscope run (also what `kvscope race` reports for it)."""
    return _row(name, server.metrics, engine.num_preemptions, engine.mean_kv_waste,
                {"steps": engine.scheduler.step_count})


def run_mode(config: EngineConfig, items, make_sink=None, on_progress=None):
    """Serve items through one engine; make_sink(engine), if given, builds the sink attached after warm-up;
    on_progress(n) is called as requests finish."""
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.serve.driver import ServeOptions, Server

    engine = LLMEngine(config)
    _warm_up(engine)
    if make_sink is not None:
        engine.attach(make_sink(engine))
    server = Server(engine, ServeOptions(verbose_rejects=False), on_progress=on_progress)
    server.run(items)
    engine.close()
    return engine, server


def _warm_up(engine) -> None:
    """One tiny request first, so lazy initialisation is not billed to the first row."""
    from kvscope.engine.sampling_params import SamplingParams

    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.reset_counters()


def run_bench(config: EngineConfig, options: BenchOptions, log=print) -> dict:
    import torch

    from kvscope.bench.peers import PEERS
    from kvscope.engine.config import MODES

    # Check every row's name before spending minutes on the first ones.
    for mode in options.modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} (choose from {', '.join(MODES)})")
    for peer in options.peers:
        if peer not in PEERS:
            raise ValueError(f"unknown peer {peer!r} (choose from {', '.join(PEERS)})")
    items, device = bench_items(config, options)
    rows = []
    for mode in options.modes:
        log(f"[bench] {mode} ...", file=sys.stderr)
        engine, server = run_mode(replace(config, mode=mode), items)
        rows.append(mode_row(mode, engine, server))
    for peer in options.peers:
        log(f"[bench] {peer} ...", file=sys.stderr)
        rows.append(PEERS[peer](config, items))
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
    if options.events:
        from kvscope.bench.events import measure_event_overhead

        log("[bench] events on/off ...", file=sys.stderr)
        result["events"] = measure_event_overhead(replace(config, mode="chunked"), items)
    return result


def print_table(result: dict) -> None:
    header = ("row", "out tok/s", "TTFT mean", "TTFT p99", "ITL p99", "preempt", "KV waste")
    lines = [header]
    for r in result["rows"]:
        lines.append((r["name"], f"{r['output_tok_per_s']:.1f}", fmt_ms(r["ttft_mean_s"]), fmt_ms(r["ttft_p99_s"]),
                      fmt_ms(r["itl_p99_s"]), str(r["preemptions"]) if r["preemptions"] is not None else "-",
                      fmt_pct(r["kv_waste"])))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    print(f"workload={result['workload']} model={result['model']} device={result['device']} "
          f"requests={result['num_requests']} max_num_seqs={result['max_num_seqs']}")
    for i, line in enumerate(lines):
        print("  ".join(cell.ljust(w) if j == 0 else cell.rjust(w) for j, (cell, w) in enumerate(zip(line, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    if "events" in result:
        e = result["events"]
        print(f"\nevents: kept {e['kept_fraction'] * 100:.1f}% of tok/s with events+recording on; "
              f"{e['bytes_per_step']:.0f} B/step; encode {e['encode_us_per_step_256']:.0f} us/step at 256 running; "
              f"{e['trace_bytes_per_1000_steps'] / 1024:.1f} KiB trace per 1000 steps")

