"""The bench harness: the workload every row sees, one configuration run after a warm-up, and the
one Row type every table prints and every JSON file holds.

Percentiles are nearest-rank (kvscope.quantiles.percentile, docs/QUANTILES.md) in every table.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from kvscope import workload as wl
from kvscope.goodput import NO_SLO, GoodputTally, RequestRecord, Slo, row_fields, usd_per_mtok
from kvscope.bench import SINGLE_STREAM
from kvscope.engine.config import EngineConfig, Mode
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.metrics import MetricsCollector, mean
from kvscope.quantiles import percentile
from kvscope.engine.sampling_params import SamplingParams
from kvscope.serve.driver import ServeOptions, Server, reserved_top_ids


@dataclass
class Row:
    """One row of a bench table. `extra` holds a table's own columns (steps, sim speed, ...); in JSON
    they sit beside the common keys, so every bench file's rows have one shape."""

    name: str
    output_tok_per_s: float
    ttft_mean_s: float | None
    ttft_p99_s: float | None
    itl_p99_s: float | None
    preemptions: int | None  # None: a peer that does not preempt
    kv_waste: float | None  # None: not measured
    output_tokens: int
    duration_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    ttft_p50_s: float | None = None
    itl_p50_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d.update(self.extra)
        return d

    @classmethod
    def from_metrics(cls, name: str, m: MetricsCollector, preemptions: int, kv_waste: float | None,
                     goodput: GoodputTally | None = None, **extra: Any) -> Row:
        s = m.summary(preemptions=preemptions, kv_waste=kv_waste or 0.0, steps=0)
        if goodput is not None:  # over the same span as tok/s (docs/GOODPUT.md)
            extra = {**row_fields(goodput.figures(s.duration_s)), **extra}
        return cls(name, s.output_tok_per_s, s.ttft_mean_s, s.ttft_p99_s, s.itl_p99_s, preemptions, kv_waste,
                   s.output_tokens, s.duration_s, extra, ttft_p50_s=s.ttft_p50_s, itl_p50_s=s.itl_p50_s)

    @classmethod
    def from_samples(cls, name: str, ttft: list[float], itl: list[float], tokens: int, span: float,
                     kv_waste: float | None = None, **extra: Any) -> Row:
        """A peer's row, from its own TTFT and ITL samples and the span it took."""
        return cls(name, tokens / span if span > 0 else 0.0, mean(ttft), percentile(ttft, 99), percentile(itl, 99),
                   None, kv_waste, tokens, span, extra, ttft_p50_s=percentile(ttft, 50), itl_p50_s=percentile(itl, 50))


def bench_workload(config: EngineConfig, workload: str | Any, num_requests: int | None, vocab: int,
                   eos: frozenset[int], max_prompt_len: int | None, at_once: bool = True):
    """The requests every row serves: a preset name or spec, generated from config.seed, all arriving
    at t=0 when at_once (an offline batch: every row sees the same work, and TTFT includes queueing)."""
    spec = wl.load_spec(workload) if isinstance(workload, str) else workload
    items = wl.generate(spec, vocab_size=vocab, num_requests=num_requests, seed=config.seed,
                        max_prompt_len=max_prompt_len, reserved_ids=reserved_top_ids(vocab, eos))
    return [replace(item, arrival=0.0) for item in items] if at_once else items


def model_info(config: EngineConfig):
    """The model's vocabulary and EOS ids, from a small engine (the workload is generated for them)."""
    probe = LLMEngine(replace(config, num_blocks=config.num_blocks or 64))
    return probe.loaded.vocab_size, probe.loaded.eos_token_ids, probe.device


def warm_up(engine) -> None:
    """One tiny request first, so lazy initialisation is not billed to the first row."""
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.reset_counters()


def run_config(config: EngineConfig, items, make_sink: Callable | None = None,
               on_progress: Callable[[int], None] | None = None, before_run: Callable | None = None,
               slo: Slo = NO_SLO, outputs: dict | None = None):
    """Serve items through one fresh engine after a warm-up; make_sink(engine), if given, builds the sink
    attached after the warm-up; before_run(engine), if given, is called then too (the roofline's step
    recorder); on_progress(n) is called as requests finish. Returns the engine and the server (its metrics;
    ``server.goodput``: every finished request's finish record, as a trace holds it, judged against slo).
    With ``outputs``, each finished request's generated token ids go there, keyed by its prompt (a tuple)."""
    from kvscope.engine.telemetry import finish_record

    engine = LLMEngine(config)
    engine.hello_extra = slo.to_wire()  # a recorded run carries its SLO (docs/GOODPUT.md)
    warm_up(engine)
    if before_run is not None:
        before_run(engine)
    if make_sink is not None:
        engine.attach(make_sink(engine))
    goodput = GoodputTally(slo)

    def finished(req) -> None:
        goodput.add(RequestRecord.of_finish(finish_record(req)), req.finish_time)
        if outputs is not None:
            outputs[tuple(req.prompt_token_ids)] = list(req.output_token_ids)

    server = Server(engine, ServeOptions(verbose_rejects=False), on_progress=on_progress, on_finished=finished)
    server.goodput = goodput
    server.run(items)
    engine.close()
    return engine, server


def row_config(config: EngineConfig, row: str) -> EngineConfig:
    """The engine config of one of the bench's kvscope rows: a mode, or single-stream (chunked, max_num_seqs=1;
    its ITL is one stream's, to set beside llama.cpp's one-at-a-time row)."""
    if row == SINGLE_STREAM:
        return replace(config, mode=Mode.CHUNKED, max_num_seqs=1)
    return replace(config, mode=row)


def mode_row(name: str, engine, server, **extra: Any) -> Row:
    """A kvscope row: the server's request metrics and the engine's run totals (also `kvscope race`'s)."""
    return Row.from_metrics(name, server.metrics, engine.num_preemptions, engine.mean_kv_waste,
                            goodput=getattr(server, "goodput", None), steps=engine.scheduler.step_count, **extra)


def add_cost(result: dict[str, Any], cost_per_hour: float | None) -> dict[str, Any]:
    """$ per million output tokens and per million goodput tokens on every row (--cost-per-hour)."""
    if cost_per_hour is None:
        return result
    result["cost_per_hour"] = cost_per_hour
    for row in result.get("rows", []):
        row["cost_per_hour"] = cost_per_hour
        row["usd_per_mtok"] = usd_per_mtok(cost_per_hour, row.get("output_tok_per_s"))
        row["usd_per_mgood"] = usd_per_mtok(cost_per_hour, row.get("goodput_tok_per_s"))
    return result
