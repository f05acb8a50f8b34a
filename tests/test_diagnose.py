"""kvscope diagnose: each verdict on a sim run made to show it, what-if against real re-runs, bad input."""

from __future__ import annotations

import json
import os

import msgspec
import pytest

from kvscope.cli.diagnose import run_config
from kvscope.analysis.diagnose import NoSteps, diagnose_events, diagnose_trace, to_json
from kvscope.analysis.figures import RunFigures
from kvscope.analysis.predict import apply_knob
from kvscope.analysis.report import format_text
from kvscope.analysis.whatif import TraceRequests, run_sim, sim_settings
from kvscope.cli import main
from kvscope.engine.config import EngineConfig
from kvscope.engine.llm_engine import LLMEngine
from kvscope.protocol.events import RequestEvent
from kvscope.traces.writer import TraceWriter

DATA = os.path.join(os.path.dirname(__file__), "data", "diagnose")
UP, DOWN = "up", "down"

# name: (engine settings, workload, requests, verdict, top flag, its direction or target value)
SCENARIOS = {
    "kv": (dict(model="llama-3.3-70b-fp8", gpu="h100-sxm5"), "mixed", 120, "kv_capacity", "--gpu-memory-utilization",
           UP),
    "seqs": (dict(model="llama-3.1-8b", gpu="h100-sxm5", max_num_seqs=4), "chat", 60, "max_num_seqs",
             "--max-num-seqs", UP),
    "budget": (dict(model="llama-3.1-8b", gpu="h100-sxm5", max_num_batched_tokens=32), "long", 24, "token_budget",
               "--max-num-batched-tokens", UP),
    "prefill": (dict(model="llama-3.1-8b", gpu="h200", mode="continuous"), "long-mix.json", 100,
                "prefill_interference", "--mode", "chunked"),
    "naive": (dict(model="llama-3.1-8b", gpu="h100-sxm5", mode="naive"), "chat", 40, "batching_mode", "--mode",
              "chunked"),
    "static": (dict(model="llama-3.1-8b", gpu="h100-sxm5", mode="static"), "chat", 60, "batching_mode", "--mode",
               "chunked"),
    "sjf": (dict(model="llama-3.3-70b-fp8", gpu="h200", policy="sjf", max_num_seqs=256), "sjf-mix.json", 150,
            "policy_starvation", "--policy", "fcfs"),
    "compute": (dict(model="llama-3.3-70b-fp8", gpu="h200", max_num_seqs=512), "heavy-chat.json", 300,
                "compute_bound", "--tp", UP),
    "underloaded": (dict(model="llama-3.1-8b", gpu="h100-sxm5"), "chat", 60, "underloaded", None, None),
}


def _workload(name: str) -> str:
    return os.path.join(DATA, name) if name.endswith(".json") else name


def _events(settings: dict, workload: str, n: int) -> list:
    return run_config(EngineConfig(backend="sim", **settings), _workload(workload), n, 0)


def _points(knob, direction) -> bool:
    if direction == UP:
        return knob.to > knob.from_
    if direction == DOWN:
        return knob.to < knob.from_
    return knob.to == direction


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_verdict_and_top_knob(name):
    settings, workload, n, verdict, flag, direction = SCENARIOS[name]
    d = diagnose_events(_events(settings, workload, n), what_if=False)
    assert d.bottleneck == verdict, format_text(d)
    if flag is None:
        assert d.knobs == []
    else:
        assert d.knobs[0].flag == flag and _points(d.knobs[0], direction), format_text(d)
    assert d.evidence and all(e.text for e in d.evidence)
    assert all(r.bottleneck != verdict for r in d.secondary)


def _rerun(events: list, knob, workload: str, n: int) -> RunFigures:
    """A real sim re-run of the workload with the knob applied, summarised like the trace."""
    config = next(e for e in events if type(e).__name__ == "HelloEvent").config.as_dict()
    settings = apply_knob(sim_settings(config), knob)
    tr = TraceRequests()
    for ev in run_config(EngineConfig(**settings), _workload(workload), n, 0):
        tr.add(ev)
    return tr.figures()


def _close(a: float, b: float, tol: float = 0.15) -> bool:
    return abs(a - b) <= tol * abs(b)


@pytest.mark.parametrize("name", ["kv", "seqs", "budget"])
def test_what_if_matches_a_real_rerun(name):
    settings, workload, n, *_ = SCENARIOS[name]
    events = _events(settings, workload, n)
    d = diagnose_events(events, what_if=True)
    w = d.what_if
    assert w.ran and not w.calibrated and w.requests == n
    # deterministic sim: the baseline is the trace itself
    assert _close(w.baseline.output_tok_per_s, w.trace.output_tok_per_s, 0.01)
    assert _close(w.baseline.ttft_p99_s, w.trace.ttft_p99_s, 0.01)
    top = d.knobs[0]
    real = _rerun(events, top, workload, n)
    assert _close(top.predicted.ttft_p99_s, real.ttft_p99_s), (top.predicted, real)
    assert _close(top.predicted.output_tok_per_s, real.output_tok_per_s), (top.predicted, real)
    # and the knob helps: tail TTFT falls, throughput does not
    assert real.ttft_p99_s < w.baseline.ttft_p99_s
    assert real.output_tok_per_s >= 0.95 * w.baseline.output_tok_per_s


def _record(path: str, settings: dict, workload: str, n: int) -> None:
    from kvscope.serve.driver import ServeOptions, Server

    engine = LLMEngine(EngineConfig(**settings))
    writer = TraceWriter(path, engine.hello(), snapshot_provider=engine.snapshot)
    engine.attach(writer)
    if n:
        Server(engine, ServeOptions(workload=workload, num_requests=n, verbose_rejects=False)).run()
    engine.close()
    writer.close()


def test_cli_text_and_json_carry_the_same_content(tmp_path, capsys):
    trace, out = str(tmp_path / "seqs.kvtrace"), str(tmp_path / "d.json")
    _record(trace, dict(backend="sim", model="llama-3.1-8b", gpu="h100-sxm5", max_num_seqs=4), "chat", 30)
    assert main(["diagnose", trace, "--json", out]) == 0
    text = capsys.readouterr().out
    d = json.load(open(out))
    assert d["bottleneck"] == "max_num_seqs" and f"bottleneck: {d['bottleneck']}" in text
    for e in d["evidence"]:
        assert e["text"] in text and "value" in e and "threshold" in e
    for k in d["knobs"]:
        assert f"{k['flag']} {k['from']} -> {k['to']}" in text
        assert set(k["baseline"]) == set(k["predicted"]) == {
            "output_tok_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p99_s", "preemptions"}
    assert d["measure_next"] in text and d["what_if"]["note"] in text
    # --window judges only the last N steps
    assert main(["diagnose", trace, "--window", "50", "--no-what-if"]) == 0
    assert "(last 50 only)" in capsys.readouterr().out


def test_no_steps_is_one_line(tmp_path, capsys):
    trace = str(tmp_path / "empty.kvtrace")
    _record(trace, dict(backend="sim", model="llama-3.1-8b", gpu="h100-sxm5"), "chat", 0)
    assert main(["diagnose", trace]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no steps" in err
    with pytest.raises(NoSteps):
        diagnose_trace(trace)


def test_no_requests_says_what_it_could_not_judge():
    events = [e for e in _events(dict(model="llama-3.1-8b", gpu="h100-sxm5", max_num_seqs=4), "chat", 20)
              if not isinstance(e, RequestEvent)]
    d = diagnose_events(events, what_if=True)
    assert any("no requests" in x for x in d.cannot_judge)
    assert not d.what_if.ran and "no requests" in d.what_if.note
    assert d.bottleneck == "max_num_seqs"  # the admission evidence still stands


def test_cut_short_trace_is_diagnosed_up_to_the_cut(tmp_path):
    trace = str(tmp_path / "cut.kvtrace")
    _record(trace, dict(backend="sim", model="llama-3.1-8b", gpu="h100-sxm5", max_num_seqs=4), "chat", 60)
    data = open(trace, "rb").read()
    cut = str(tmp_path / "half.kvtrace")
    open(cut, "wb").write(data[: len(data) // 2])
    d = diagnose_trace(cut, what_if=False)
    assert "cut short" in d.cannot_judge[0]
    assert d.bottleneck == "max_num_seqs"
    assert msgspec.json.decode(to_json(d))["cannot_judge"] == d.cannot_judge


def test_low_memory_utilization_is_refused_until_raised():
    events = _events(dict(model="llama-3.1-8b", gpu="h100-sxm5", gpu_memory_utilization=0.3), "long", 16)
    d = diagnose_events(events, what_if=False)
    assert [k.flag for k in d.knobs] == ["--gpu-memory-utilization"] and d.knobs[0].to > 0.7
    assert any("below 0.7" in r for r in d.refusals)


def test_no_more_gpus_before_scheduler_knobs():
    d = diagnose_events(_events(*SCENARIOS["seqs"][:3]), what_if=False)
    assert all(k.flag != "--tp" for k in d.knobs)
    assert any("--tp" in r for r in d.refusals)


def test_replay_rebuilds_shared_prefixes():
    settings = dict(model="llama-3.1-8b", gpu="h100-sxm5", prefix_caching=True)
    events = _events(settings, "shared-prefix", 40)
    tr = TraceRequests()
    for ev in events:
        tr.add(ev)
    reqs = tr.replay_requests()
    assert sum(r.prefix_len > 0 for r in reqs) >= 25
    config = events[0].config.as_dict()
    run = run_sim(reqs, sim_settings(config))
    assert _close(run.figures.output_tok_per_s, tr.figures().output_tok_per_s, 0.05)


def test_diagnose_without_what_if_loads_no_engine_or_torch(tmp_path):
    import subprocess
    import sys

    trace = str(tmp_path / "t.kvtrace")
    _record(trace, dict(backend="sim", model="llama-3.1-8b", gpu="h100-sxm5", max_num_seqs=4), "chat", 10)
    code = ("import sys; from kvscope.cli import main; rc = main(['diagnose', sys.argv[1], '--no-what-if']); "
            "flags = ('kvscope.engine', 'kvscope.engine.config', 'kvscope.engine.errors'); "
            "bad = sorted(m for m in sys.modules if m in ('torch', 'transformers') "
            "or (m.startswith('kvscope.engine') and m not in flags)); "
            "print('LOADED', bad); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, trace], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    assert "LOADED []" in out.stdout


def _tiny_events(n: int, prompt_len: int, max_tokens: int, **settings) -> list:
    """A tiny-model run on the CPU: n requests arriving at once."""
    from kvscope import workload as wl
    from kvscope.protocol.sinks import ListSink as _ListSink
    from kvscope.serve.driver import ServeOptions, Server

    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", cpu_threads=1, **settings))
    sink = _ListSink()
    engine.attach(sink)
    items = [wl.WorkloadRequest(arrival=0.0, prompt=[(i * 7 + k) % 200 + 1 for k in range(prompt_len)],
                                max_tokens=max_tokens) for i in range(n)]
    Server(engine, ServeOptions(verbose_rejects=False)).run(items)
    engine.close()
    return sink.events


def test_tiny_model_max_num_seqs_with_calibrated_what_if():
    d = diagnose_events(_tiny_events(10, 24, 8, max_num_seqs=2), what_if=True)
    assert d.backend == "model" and d.bottleneck == "max_num_seqs", format_text(d)
    top = d.knobs[0]
    assert top.flag == "--max-num-seqs" and top.to > top.from_ == 2
    w = d.what_if
    assert w.ran and w.calibrated and "calibrated the sim" in w.note and w.calibration["model"] == "tiny"
    assert top.predicted is not None and top.predicted.ttft_p99_s < top.baseline.ttft_p99_s


def test_tiny_model_kv_capacity():
    d = diagnose_events(_tiny_events(6, 24, 12, num_blocks=6), what_if=False)
    assert d.bottleneck == "kv_capacity", format_text(d)
    top = d.knobs[0]
    assert top.flag == "--num-blocks" and top.to > top.from_ == 6


def test_hand_set_pool_gets_num_blocks_not_memory_utilization():
    events = _events(dict(model="llama-3.3-70b-fp8", gpu="h100-sxm5", num_blocks=600), "mixed", 80)
    assert diagnose_events(events, what_if=False).knobs[0].flag == "--gpu-memory-utilization"
    d = diagnose_events(events, what_if=True)  # the what-if sizes the pool and sees it was set by hand
    top = d.knobs[0]
    assert d.bottleneck == "kv_capacity" and top.flag == "--num-blocks" and top.from_ == 600 and top.to > 600
    assert top.predicted.preemptions < top.baseline.preemptions


def test_tiny_model_naive_mode():
    d = diagnose_events(_tiny_events(6, 16, 6, mode="naive"), what_if=False)
    assert d.bottleneck == "batching_mode", format_text(d)
    assert d.knobs[0].flag == "--mode" and d.knobs[0].to == "chunked"


def _signals(**over):
    from kvscope.analysis.signals import Signals

    base = dict(steps=400, busy_steps=400, span_s=60.0, busy_time_frac=1.0, requests=200, finished=200,
                blocked_kv=0.0, blocked_budget=0.0, blocked_seqs=0.0, blocked_static=0.0, queued_frac=0.5,
                mean_queued=2.0, preemptions_kv=0, preemptions_priority=0, preempted_per_request=0.0,
                recompute_frac=0.0, kv_use_p90=0.5, kv_use_mean=0.4, running_mean=1.0, running_max=60,
                tokens_fill=0.5, padding_frac=0.0, step_dur_p50=0.02, fixed_share=None, ttft_p50=0.5, ttft_p99=0.6,
                queue_p50=0.02, queue_p99=0.04, itl_p50=0.02, itl_p99=0.5, itl_tail_prefill_share=1.0,
                itl_p99_prefill=0.5, itl_p50_clean=0.02, prefill_step_dur_p99=0.5, decode_step_dur_p99=0.02,
                overtaken_frac=0.0, wait_ratio=None, priorities=1)
    return Signals(**{**base, **over})


def test_an_engine_trace_weighs_the_symptom_as_a_vllm_recording_does():
    """The rules are shared: with max_num_seqs reached but requests waiting 40 ms while the ITL p99 is 25x its
    median from prefills, a kvscope trace is prefill_interference too; when they wait seconds, max_num_seqs."""
    from kvscope.analysis.knobs import choose
    from kvscope.analysis.verdicts import rule

    cfg = dict(backend="sim", mode="chunked", max_num_seqs=60, max_num_batched_tokens=8192, policy="fcfs",
               gpu_memory_utilization=0.9)
    blocked = _signals(blocked_seqs=0.5)
    top, rest = rule(blocked, cfg)
    assert top.bottleneck == "prefill_interference"
    knobs, _ = choose(top.bottleneck, rest, cfg, blocked)
    assert knobs[0].flag == "--max-num-batched-tokens" and knobs[0].to < 8192
    assert not any(k.flag == "--max-num-seqs" for k in knobs)
    waiting = _signals(blocked_seqs=0.5, queue_p50=4.0, queue_p99=8.0)
    assert rule(waiting, cfg)[0].bottleneck == "max_num_seqs"
    unknown = _signals(blocked_seqs=0.5, queue_p50=None, queue_p99=None)  # no request events: not weighed
    assert rule(unknown, cfg)[0].bottleneck == "max_num_seqs"
