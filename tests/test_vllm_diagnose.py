"""`kvscope diagnose` on a recorded vLLM: the four acceptance scenarios of the stand-in vLLM, the flags that
say what vLLM does not expose, the what-if, the TUI's hook, and a plugin-recorded (per-step) vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvscope.vllm.diagnose.run import diagnose_state, diagnose_vllm_trace, recording
from kvscope.vllm.diagnose.signals import VllmFlags
from kvscope.vllm.watch.source import VllmState
from kvscope.analysis.diagnose import Diagnosis, diagnose_trace
from kvscope.cli import main

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "traces" / "vllm"


def shipped(name: str) -> str:
    return str(TRACES / f"standin-{name}.kvtrace")


def test_kv_bound_names_kv_capacity_and_raises_gpu_memory_utilization():
    d = diagnose_vllm_trace(shipped("kv-bound"), what_if=False)
    assert d.backend == "vllm" and d.bottleneck == "kv_capacity"
    first = d.knobs[0]
    assert (first.flag == "--gpu-memory-utilization" and first.to > first.from_) or \
        (first.flag == "--max-num-seqs" and first.to < first.from_)
    assert first.from_ == 0.9, "the current value comes from vllm:cache_config_info"
    assert d.signals.kv_use_p90 >= 0.9 and d.signals.preemptions_kv > 0 and d.signals.blocked_kv > 0.1
    churn = next(e for e in d.evidence if e.name == "kv_churn")  # from the recorded KV events
    assert churn.series.startswith("KV events") and d.vllm.kv_blocks_removed > 0.5 * d.vllm.kv_blocks_stored


def test_underloaded_says_underloaded_with_no_knobs():
    d = diagnose_vllm_trace(shipped("underloaded"), what_if=False)
    assert d.bottleneck == "underloaded" and d.knobs == []


def test_budget_bound_names_token_budget_and_raises_the_budget():
    d = diagnose_vllm_trace(shipped("budget-bound"), what_if=False)
    assert d.bottleneck == "token_budget"
    k = d.knobs[0]
    assert k.flag == "--max-num-batched-tokens" and k.from_ == 256 and k.to > 256


def test_prefill_interference_names_it_and_its_knob_follows_chunked_prefill():
    d = diagnose_vllm_trace(shipped("prefill-interference"), what_if=False)
    assert d.bottleneck == "prefill_interference"
    assert d.signals.itl_p99 >= 3 * d.signals.itl_p50
    k = d.knobs[0]
    assert k.flag == "--max-num-batched-tokens" and k.to < k.from_, "chunked prefill on (vLLM's default): smaller chunks"
    off = diagnose_vllm_trace(shipped("prefill-interference"), what_if=False,
                         flags=VllmFlags(enable_chunked_prefill=False))
    assert off.bottleneck == "prefill_interference"
    assert (off.knobs[0].flag, off.knobs[0].from_, off.knobs[0].to) == ("--enable-chunked-prefill", False, True)


@pytest.mark.parametrize("name", ["kv-bound", "underloaded", "budget-bound", "prefill-interference"])
def test_every_piece_of_evidence_names_its_series(name):
    d = diagnose_vllm_trace(shipped(name), what_if=False)
    assert d.evidence
    for e in d.evidence:
        assert e.series and ("vllm:" in e.series or "KV events" in e.series), e
        assert f"[{e.series}]" in e.text


def test_settings_say_whether_they_were_given_read_or_inferred():
    d = diagnose_vllm_trace(shipped("kv-bound"), what_if=False)
    src = {s.name: s for s in d.vllm.settings}
    assert src["--max-num-seqs"].source.startswith("inferred")
    assert src["--max-num-batched-tokens"].source.startswith("inferred")
    assert src["--gpu-memory-utilization"].source == "vllm:cache_config_info"
    given = diagnose_vllm_trace(shipped("kv-bound"), what_if=False,
                           flags=VllmFlags(max_num_seqs=128, max_num_batched_tokens=2048))
    src = {s.name: s for s in given.vllm.settings}
    assert (src["--max-num-seqs"].value, src["--max-num-seqs"].source) == (128, "flag")
    assert given.config["max_num_seqs"] == 128
    kn = {k.flag: k for k in given.knobs}
    assert kn["--max-num-seqs"].from_ == 128 and kn["--max-num-seqs"].to < 128


def test_cli_text_and_json(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert main(["diagnose", shipped("budget-bound"), "--no-what-if", "--vllm-max-num-batched-tokens", "256",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "bottleneck: token_budget" in text and "--max-num-batched-tokens 256 -> 1024" in text
    assert "--max-num-batched-tokens 256  (flag)" in text
    data = json.loads(out.read_text())
    assert data["backend"] == "vllm" and data["bottleneck"] == "token_budget"
    assert data["vllm"]["settings"] and data["evidence"][0]["series"]


def test_cli_refuses_a_bad_vllm_flag_in_one_line(capsys):
    assert main(["diagnose", shipped("kv-bound"), "--no-what-if", "--vllm-max-num-seqs", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--vllm-max-num-seqs" in err


def test_what_if_needs_the_gpu_and_a_catalog_model():
    d = diagnose_vllm_trace(shipped("budget-bound"), what_if=True)
    assert d.what_if.ran is False and "--gpu" in d.what_if.note and d.knobs[0].predicted is None
    d = diagnose_vllm_trace(shipped("budget-bound"), what_if=True, flags=VllmFlags(model="no-such-model",
                                                                                  gpu="h100-sxm5"))
    assert d.what_if.ran is False and "sim catalog" in d.what_if.note


def test_what_if_replays_the_observed_shape_and_predicts_the_first_knob():
    d = diagnose_vllm_trace(shipped("budget-bound"), what_if=True,
                       flags=VllmFlags(gpu="h100-sxm5", max_num_batched_tokens=256, max_num_seqs=256))
    w = d.what_if
    assert w.ran and w.requests > 0 and w.trace is not None and w.baseline is not None
    k = d.knobs[0]
    assert k.flag == "--max-num-batched-tokens" and k.predicted is not None
    assert k.predicted.ttft_p99_s < k.baseline.ttft_p99_s, "a bigger budget drains the prompt queue sooner"


def test_the_tui_hook_judges_a_vllm_views_state():
    from kvscope.traces.reader import TraceReader

    scrapes, cache, _ = recording(TraceReader(shipped("kv-bound")))
    state = VllmState("http://127.0.0.1:8000", None, None)
    state.metrics.window_s = 1e9  # keep every scrape, as a long-lived view's window would hold its last ones
    for s in scrapes:
        state.metrics.add(s)
    d = diagnose_state(state)
    assert isinstance(d, Diagnosis) and d.bottleneck == "kv_capacity" and d.what_if is None


def test_a_fresh_stand_in_recording_matches_the_shipped_verdict(tmp_path):
    from tests.fakes.vllm_standin import record

    path = tmp_path / "budget.kvtrace"
    assert record("budget-bound", path) > 10
    assert diagnose_vllm_trace(path, what_if=False).bottleneck == "token_budget"


def test_a_plugin_recorded_vllm_is_diagnosed_in_vllms_flags(tmp_path):
    """Per-step events from the stat-logger plugin go through the engine-trace path, knobs in vLLM's flags."""
    from kvscope.vllm.inproc.plugin import StepMaker, engine_info
    from kvscope.traces.writer import TraceWriter
    from tests.fakes import vllm_stats as S
    from tests.test_vllm_plugin import _step

    maker = StepMaker(engine_info(S.VllmConfig()), wall_start=1000.0)
    events = []
    for i in range(60):  # the cache full, requests waiting, a preemption every few steps
        events += maker.events(*_step(i, prefill=128 if i % 3 == 0 else 0, decode=40, running=40, waiting=6,
                                      usage=0.98, preempted=1 if i % 4 == 0 else 0, finished=1 if i % 2 else 0,
                                      ttfts=[0.5] if i % 3 == 0 else [], itls=[0.0125] * 40))
    path = tmp_path / "plugin.kvtrace"
    w = TraceWriter(path, maker.hello)
    for ev in events:
        w.publish(ev)
    w.close()
    d = diagnose_trace(str(path), what_if=False)
    assert d.bottleneck == "kv_capacity"
    assert d.knobs[0].flag in ("--gpu-memory-utilization", "--max-num-seqs")
    assert all(not k.flag.startswith(("--mode", "--num-blocks", "--tp ")) for k in d.knobs)


def _record_http(path, moves: int, move) -> int:
    """Scrape the HTTP stand-in (tests/fakes/vllm.py) ``moves`` times through the recorder, ``move(i)`` before each."""
    import httpx

    from kvscope.vllm.watch.record import VllmRecorder
    from kvscope.vllm.watch.source import VllmSource
    from tests.fakes.vllm import FakeMetricsServer

    m = FakeMetricsServer()
    try:
        source = VllmSource(m.url, None, None)
        rec = VllmRecorder(path, source)
        source.listener = rec
        with httpx.Client(timeout=10) as client:
            for i in range(moves):
                move(m, i)
                source.scrape_once(client)
        rec.close()
        return rec.scrapes
    finally:
        m.close()


def test_a_kv_bound_vllm_watched_over_http(tmp_path):
    def move(m, i):
        m.running.set(60 + i % 3)
        m.waiting_for(capacity=12)
        m.kv.set(0.99)
        m.preemptions.inc(2)
        m.iteration_tokens.observe(400)
        m.generation.inc(60)
        m.prompt.inc(200)
        m.finish(1, prompt=800, output=400, queue=6.0, e2e=30.0)

    path = tmp_path / "kv.kvtrace"
    assert _record_http(path, 20, move) == 20
    d = diagnose_vllm_trace(path, what_if=False)
    assert d.bottleneck == "kv_capacity"
    assert d.knobs[0].flag == "--gpu-memory-utilization" and (d.knobs[0].from_, d.knobs[0].to) == (0.9, 0.95)


def test_an_idle_vllm_watched_over_http_is_underloaded(tmp_path):
    def move(m, i):
        m.running.set(1 if i % 2 else 0)
        m.waiting_for(capacity=0)
        m.kv.set(0.02)
        if i % 2:
            m.iteration_tokens.observe(1)
            m.generation.inc(1)
            m.itl.observe(0.02)
        m.finish(i % 2, prompt=100, output=20, queue=0.001, e2e=0.5)

    path = tmp_path / "idle.kvtrace"
    _record_http(path, 20, move)
    d = diagnose_vllm_trace(path, what_if=False, flags=VllmFlags(max_num_seqs=64, max_num_batched_tokens=2048))
    assert d.bottleneck == "underloaded" and d.knobs == []


def test_a_budget_bound_vllm_without_a_queue_histogram(tmp_path):
    """Iterations pinned at the budget with a queue; no request_queue_time_seconds: the queue time is
    Little's law's (waiting / arrival rate), and the evidence says so."""
    def move(m, i):
        m.running.set(8)
        m.waiting_for(capacity=20)
        m.kv.set(0.3)
        for _ in range(50):
            m.iteration_tokens.observe(512)
        m.prompt.inc(20_000)
        m.generation.inc(400)
        m.success.labels("Qwen/Qwen3-0.6B", "0", "length").inc(2)

    path = tmp_path / "budget.kvtrace"
    _record_http(path, 20, move)
    d = diagnose_vllm_trace(path, what_if=False, flags=VllmFlags(max_num_batched_tokens=512))
    assert d.bottleneck == "token_budget"
    assert (d.knobs[0].flag, d.knobs[0].from_, d.knobs[0].to) == ("--max-num-batched-tokens", 512, 1024)
    q = next(e for e in d.evidence if e.name == "queue_p50_steps")
    assert "Little's law" in q.series


def _bimodal_itl_move(queue: float):
    """A stand-in vLLM whose ITL is bimodal (p50 ~20 ms, p99 ~0.5 s): iterations of 8,192 tokens (a long prompt's
    chunk sharing the step with 60 decodes) alternate with decode-only ones; 60 requests run and a few wait at
    each scrape for ``queue`` seconds."""
    def move(m, i):
        m.running.set(60)
        m.waiting_for(capacity=2 if i % 2 else 0)
        m.kv.set(0.45)
        for k in range(10):  # 2 iterations of 8,192 tokens, 8 decode-only ones, per interval
            m.iteration_tokens.observe(8192 if k % 5 == 0 else 60)
        m.prompt.inc(2 * (8192 - 60))
        m.generation.inc(10 * 60)
        for _ in range(2 * 60):
            m.itl.observe(0.5)  # every decode stalls behind the long prefill
        for _ in range(8 * 60):
            m.itl.observe(0.02)
        m.ttft.observe(0.6)
        m.prefill_time.observe(0.55)
        m.decode_time.observe(4.0)
        m.finish(2, prompt=8192, output=200, queue=queue, e2e=5.0)
    return move


def test_an_itl_tail_from_long_prefills_with_tiny_queues_is_prefill_interference(tmp_path):
    """Requests wait under 50 ms while 60 run: admission is not what hurts, the ITL tail is. The verdict names
    prefill_interference with a budget or threshold knob, not --max-num-seqs 60 -> 120."""
    path = tmp_path / "bimodal.kvtrace"
    _record_http(path, 24, _bimodal_itl_move(queue=0.03))
    d = diagnose_vllm_trace(path, what_if=False)
    assert d.signals.itl_p99 >= 10 * d.signals.itl_p50 and d.signals.running_max == 60
    assert d.bottleneck == "prefill_interference", (d.bottleneck, d.score, d.secondary)
    flags = {k.flag: k for k in d.knobs}
    assert set(flags) & {"--max-num-batched-tokens", "--long-prefill-token-threshold"}
    assert d.knobs[0].flag in ("--max-num-batched-tokens", "--long-prefill-token-threshold")
    budget = flags.get("--max-num-batched-tokens")
    assert budget is None or budget.to < budget.from_ == 8192
    assert not any(k.flag == "--max-num-seqs" and k.to > (k.from_ or 0) for k in d.knobs)
    admission = [x for x in d.secondary if x.bottleneck in ("max_num_seqs", "kv_capacity", "token_budget")]
    assert all(x.score < 0.5 for x in admission), "the admission rules are weighed down by the tiny queue times"


def test_the_same_tail_with_requests_that_really_wait_stays_max_num_seqs(tmp_path):
    """The weighing cuts both ways: when the waiting requests wait seconds, admission is what hurts."""
    path = tmp_path / "queued.kvtrace"
    _record_http(path, 24, _bimodal_itl_move(queue=8.0))
    d = diagnose_vllm_trace(path, what_if=False)
    assert d.bottleneck == "max_num_seqs"
    assert (d.knobs[0].flag, d.knobs[0].from_, d.knobs[0].to) == ("--max-num-seqs", 60, 120)


def test_a_vllm_recordings_what_if_replays_through_vllms_own_scheduler():
    """With vLLM installed, the replays run vLLM's V1 scheduler on the sim (`--scheduler vllm`), and a
    --long-prefill-token-threshold knob, which only vLLM's scheduler has, gets a prediction."""
    pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM's scheduler is not installed (make vllm)")
    from kvscope.vllm.diagnose.run import sim_settings, sim_knob
    from kvscope.vllm.diagnose.signals import read
    from kvscope.analysis.knobs import Knob
    from kvscope.analysis.predict import apply_knob
    from kvscope.traces.reader import TraceReader

    scrapes, cache, _ = recording(TraceReader(shipped("budget-bound")))
    flags = VllmFlags(gpu="h100-sxm5", max_num_batched_tokens=256, max_num_seqs=256)
    settings, note = sim_settings(read(scrapes, flags, cache), flags)
    assert settings["scheduler"] == "vllm" and "vLLM's own scheduler" in note
    knob = sim_knob(Knob(flag="--long-prefill-token-threshold", from_=None, to=128, why=""))
    assert apply_knob(settings, knob)["long_prefill_token_threshold"] == 128
    d = diagnose_vllm_trace(shipped("budget-bound"), what_if=True, flags=flags)
    assert d.what_if.ran and "vLLM's own scheduler" in d.what_if.note
    assert d.knobs[0].predicted is not None


def test_a_trace_of_vllms_scheduler_replays_through_it():
    """A trace recorded under --scheduler vllm (or from the watched scheduler: its hello says scheduler
    vllm) keeps vLLM's scheduler and its long-prefill threshold in the what-if's sim settings."""
    from kvscope.analysis.whatif import sim_settings

    cfg = {"backend": "sim", "model": "llama-3.1-8b", "gpu": "h100-sxm5", "mode": "chunked", "scheduler": "vllm",
           "long_prefill_token_threshold": 512, "max_num_seqs": 60}
    s = sim_settings(cfg)
    assert (s["scheduler"], s["long_prefill_token_threshold"]) == ("vllm", 512)


def test_the_knob_table_names_real_flags_of_both_engines():
    """analysis.knobs.FLAGS: every kvscope flag is one `kvscope serve` takes, every vLLM flag a field of
    vLLM's own EngineArgs (`vllm serve --max-num-seqs` is EngineArgs.max_num_seqs)."""
    import argparse
    import dataclasses

    from kvscope.analysis.knobs import FLAGS
    from kvscope.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve_flags = {o for a in sub.choices["serve"]._actions for o in a.option_strings}
    assert [f.kvscope for f in FLAGS.values() if f.kvscope and f.kvscope not in serve_flags] == []
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    fields = {f.name for f in dataclasses.fields(arg_utils.EngineArgs)}
    assert [f.vllm for f in FLAGS.values() if f.vllm and f.vllm[2:].replace("-", "_") not in fields] == []
    assert sum(1 for f in FLAGS.values() if f.vllm) >= 8
