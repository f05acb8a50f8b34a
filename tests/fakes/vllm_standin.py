"""A stand-in vLLM that schedules for real: kvscope's sim engine behind vLLM V1's /metrics.

The scheduling is kvscope's (continuous batching, chunked prefill or not, KV blocks,
preemption by recompute), priced by the sim's cost model on a virtual clock; what leaves
it is only what a vLLM shows: its Prometheus text (kvscope.serve.metrics, vLLM's names,
labels and buckets, plus ``vllm:cache_config_info``), scraped every ``interval`` seconds of
virtual time. ``record()`` writes those scrapes into a `.kvtrace` exactly as `kvscope record
--vllm` does (same recorder, same events), so `kvscope diagnose` reads it as a recording
of a vLLM. Four scenarios are the cases docs/DIAGNOSE.md names.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvscope.vllm.watch.metrics import parse

MODEL = "Qwen/Qwen3-8B"
GPU = "h100-sxm5"


@dataclass
class Scenario:
    name: str
    rate: float  # requests per second (Poisson)
    prompt: tuple[int, int]  # uniform prompt length range
    output: tuple[int, int]
    requests: int
    engine: dict = field(default_factory=dict)  # EngineConfig settings (vLLM's, by kvscope's names)
    long_every: int = 0  # every Nth request gets a long prompt (long_prompt tokens)
    long_prompt: int = 0
    interval: float = 0.5  # seconds of virtual time between scrapes


SCENARIOS = {
    # a pool far too small for 128 sequences of long outputs: KV use at 1, preemptions, requests wait; with
    # prefix caching on, its KV events show the cache turning over
    "kv-bound": Scenario("kv-bound", rate=12.0, prompt=(400, 900), output=(300, 600), requests=220,
                         engine=dict(num_blocks=900, max_num_seqs=128, max_num_batched_tokens=2048,
                                     prefix_caching=True)),
    # a few requests a second against a big pool and budget
    "underloaded": Scenario("underloaded", rate=1.0, prompt=(100, 400), output=(50, 150), requests=40,
                            engine=dict(max_num_seqs=128, max_num_batched_tokens=2048)),
    # long prompts through a 256-token budget: every step full, a queue behind it, KV free
    "budget-bound": Scenario("budget-bound", rate=40.0, prompt=(1500, 2500), output=(20, 60), requests=300,
                             engine=dict(max_num_seqs=256, max_num_batched_tokens=256)),
    # chunked prefill off: each long prompt runs whole in one step and stalls every decode
    "prefill-interference": Scenario("prefill-interference", rate=4.0, prompt=(50, 150), output=(200, 400),
                                     requests=160, engine=dict(mode="continuous", max_num_seqs=128,
                                                               max_num_batched_tokens=16384),
                                     long_every=6, long_prompt=12000),
}


def _requests(sc: Scenario, seed: int) -> list[tuple[float, int, int]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(sc.requests):
        p = rng.randint(*sc.prompt)
        if sc.long_every and i % sc.long_every == sc.long_every - 1:
            p = sc.long_prompt
        out.append((t, p, rng.randint(*sc.output)))
        t += rng.expovariate(sc.rate)
    return out


def _cache_info(registry, cfg, num_blocks: int) -> None:
    """vllm:cache_config_info as vLLM's log_metrics_info writes it: a gauge at 1, the CacheConfig as labels."""
    from prometheus_client import Gauge

    labels = {"block_size": str(cfg.block_size), "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
              "swap_space": "4", "cache_dtype": "auto", "num_gpu_blocks": str(num_blocks),
              "num_cpu_blocks": "None", "enable_prefix_caching": str(bool(cfg.prefix_caching)),
              "prefix_caching_hash_algo": "sha256", "cpu_offload_gb": "0", "engine": "0"}
    g = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(labels), registry=registry)
    g.labels(**labels).set(1)


class _KvTap:
    """A reader of the block manager's change queue: its registrations and evictions as vLLM KV-event batches."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.pending: list = []

    def consume(self, kv_events: list) -> None:
        from kvscope.vllm.watch.wire import Removed, Stored
        from kvscope.engine.kv.events import BlockRemoved, BlockStored

        for ev in kv_events:
            if type(ev) is BlockStored:
                self.pending.append(Stored([ev.key], ev.parent, len(ev.token_ids), self.block_size, "GPU"))
            elif type(ev) is BlockRemoved:
                self.pending.append(Removed([ev.key], "GPU"))

    def take(self, ts: float):
        from kvscope.vllm.watch.wire import Batch

        if not self.pending:
            return None
        events, self.pending = self.pending, []
        return Batch(ts, events, 0)


def scrapes(name: str, seed: int = 0, wall_start: float = 1_700_000_000.0):
    """(Scrape, text) at every ``interval`` of virtual time while the scenario's requests run."""
    return [(item, text) for kind, item, text in stream(name, seed, wall_start) if kind == "scrape"]


def stream(name: str, seed: int = 0, wall_start: float = 1_700_000_000.0):
    """("scrape", Scrape, text) every ``interval`` of virtual time and ("kv", Batch, t) after each step whose
    prefix cache changed (with prefix caching), in time order, while the scenario's requests run."""
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.sampling_params import SamplingParams
    from kvscope.serve.metrics import PrometheusSink

    sc = SCENARIOS[name]
    sink = PrometheusSink(MODEL)
    settings = {"backend": "sim", "model": MODEL, "gpu": GPU, "mode": "chunked", "seed": seed, **sc.engine}
    engine = LLMEngine(EngineConfig(**settings), sink=sink)
    _cache_info(sink.registry, engine.config, engine.num_blocks)
    tap = _KvTap(engine.config.block_size)
    if engine.config.prefix_caching:
        engine.kv_event_consumers.append(tap.consume)
    reqs = _requests(sc, seed)
    next_scrape = 0.0
    i = 0
    out = []
    while True:
        now = engine.now()
        while next_scrape <= now:
            text = sink.exposition()[0].decode()
            out.append(("scrape", parse(text, wall_start + next_scrape), text))
            next_scrape += sc.interval
        while i < len(reqs) and reqs[i][0] <= now:
            arrival, p, o = reqs[i]
            engine.add_request([17 + (i * 7 + k) % 1000 for k in range(p)], SamplingParams(max_tokens=o,
                               ignore_eos=True), arrival=arrival)
            i += 1
        if engine.has_unfinished():
            engine.step()
            batch = tap.take(wall_start + engine.now())
            if batch is not None:
                out.append(("kv", batch, engine.now()))
        elif i < len(reqs):
            engine.clock.sleep_until(reqs[i][0])
        else:
            break
    text = sink.exposition()[0].decode()
    out.append(("scrape", parse(text, wall_start + next_scrape), text))
    engine.close()
    return out


def record(name: str, path, seed: int = 0) -> int:
    """Write the scenario's scrapes as `kvscope record --vllm` would; returns the scrapes written."""
    from kvscope.vllm.watch.record import VllmRecorder
    from kvscope.vllm.watch.source import VllmState

    class _Source:  # what the recorder reads of a VllmSource
        url = "http://127.0.0.1:8000"
        interval = SCENARIOS[name].interval
        state = VllmState(url, None, None)

    from kvscope.vllm.watch.source import apply_batch

    wall = 1_700_000_000.0
    source = _Source()
    rec = VllmRecorder(path, source)
    rec.wall_start = wall
    now = [0.0]
    rec._t = lambda: now[0]  # the recorder's clock is the stand-in's virtual one
    n = seq = 0
    for kind, item, extra in stream(name, seed, wall):
        if kind == "scrape":
            now[0] = item.t - wall
            rec.scraped(item)
            n += 1
        else:
            now[0] = extra
            rec.applied(seq, item, False)
            apply_batch(source.state, seq, item, False)
            seq += 1
    rec.close()
    return n


if __name__ == "__main__":  # python -m tests.fakes.vllm_standin traces/vllm: the shipped stand-in recordings
    import sys
    from pathlib import Path

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "traces/vllm")
    for scenario in SCENARIOS:
        path = out / f"standin-{scenario}.kvtrace"
        print(f"{path}: {record(scenario, path)} scrapes")
