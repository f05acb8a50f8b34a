"""/metrics: vLLM V1's names, types, labels and buckets, with values that agree with the event stream."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import httpx
import pytest
from _helpers import DEADLINE_S, free_port
from prometheus_client.parser import text_string_to_metric_families

from kvscope.engine import LLMEngine, SamplingParams
from kvscope.engine.config import EngineConfig
from kvscope.protocol.sinks import FanOut
from kvscope.serve.frontend import FrontEnd
from kvscope.serve.metrics import PrometheusSink, step_kind

# From vLLM's source (vllm/v1/metrics/loggers.py): the buckets its histograms use.
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0, 160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0]
ITERATION = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
MAX_MODEL_LEN = 512
ONE_TWO_FIVE = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]  # vLLM's build_1_2_5_buckets: those <= max_model_len

VLLM = {
    "vllm:num_requests_running": ("gauge", None),
    "vllm:num_requests_waiting": ("gauge", None),
    "vllm:num_requests_waiting_by_reason": ("gauge", None),
    "vllm:kv_cache_usage_perc": ("gauge", None),
    "vllm:gpu_cache_usage_perc": ("gauge", None),
    "vllm:num_preemptions": ("counter", None),
    "vllm:prompt_tokens": ("counter", None),
    "vllm:generation_tokens": ("counter", None),
    "vllm:prefix_cache_queries": ("counter", None),
    "vllm:prefix_cache_hits": ("counter", None),
    "vllm:request_success": ("counter", None),
    "vllm:time_to_first_token_seconds": ("histogram", TTFT),
    "vllm:inter_token_latency_seconds": ("histogram", ITL),
    "vllm:time_per_output_token_seconds": ("histogram", ITL),
    "vllm:request_time_per_output_token_seconds": ("histogram", ITL),
    "vllm:e2e_request_latency_seconds": ("histogram", LATENCY),
    "vllm:request_queue_time_seconds": ("histogram", LATENCY),
    "vllm:request_inference_time_seconds": ("histogram", LATENCY),
    "vllm:request_prefill_time_seconds": ("histogram", LATENCY),
    "vllm:request_decode_time_seconds": ("histogram", LATENCY),
    "vllm:request_prompt_tokens": ("histogram", ONE_TWO_FIVE),
    "vllm:request_generation_tokens": ("histogram", ONE_TWO_FIVE),
    "vllm:request_max_num_generation_tokens": ("histogram", ONE_TWO_FIVE),
    "vllm:request_params_max_tokens": ("histogram", ONE_TWO_FIVE),
    "vllm:iteration_tokens_total": ("histogram", ITERATION),
}


class Recorder:
    def __init__(self) -> None:
        self.events = []

    def publish(self, e) -> None:
        self.events.append(e)

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def run():
    """A sim engine under pressure (preemptions, prefix hits), watched by the sink and a recorder."""
    sink, rec = PrometheusSink("sim-model"), Recorder()
    engine = LLMEngine(EngineConfig(backend="sim", model="qwen3-0.6b", gpu="l4", num_blocks=24, max_num_seqs=8,
                                    max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN, prefix_caching=True),
                       sink=FanOut([sink, rec]))
    rng = random.Random(3)
    shared = [rng.randrange(1000) for _ in range(48)]
    for i in range(40):
        prompt = (shared if i % 2 else []) + [rng.randrange(1000) for _ in range(rng.randint(4, 60))]
        engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 120)))
        if i % 8 == 7:
            for _ in range(20):
                engine.step()
    engine.abort_request(39)
    while engine.has_unfinished():
        engine.step()
    families = {f.name: f for f in text_string_to_metric_families(sink.exposition()[0].decode())}
    return families, rec.events


def _value(families, name, sample=None, **labels) -> float:
    fam = families[name]
    sample = sample or name
    return sum(s.value for s in fam.samples if s.name == sample and all(s.labels.get(k) == v
                                                                        for k, v in labels.items()))


def test_names_types_labels_and_buckets_are_vllms(run):
    families, events = run
    max_model_len = events[0].config.max_model_len
    assert 200 <= max_model_len < 500
    for name, (kind, buckets) in VLLM.items():
        if buckets is ONE_TWO_FIVE:
            buckets = [b for b in buckets if b <= max_model_len]
        assert name in families, f"{name} missing"
        fam = families[name]
        assert fam.type == kind, name
        for s in fam.samples:
            assert s.labels["model_name"] == "sim-model" and s.labels["engine"] == "0", (name, s.labels)
        if buckets is not None:
            les = [float(s.labels["le"]) for s in fam.samples if s.name == name + "_bucket"]
            assert les == [float(b) for b in buckets] + [float("inf")], name
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert {"stop", "length", "abort"} <= reasons
    assert {s.labels["reason"] for s in families["vllm:num_requests_waiting_by_reason"].samples} == {"capacity",
                                                                                                    "deferred"}


def test_values_agree_with_the_events(run):
    families, events = run
    steps = [e for e in events if e.type == "step"]
    finishes = [f for s in steps for f in s.finished]
    prompt_len = {e.req: e.prompt_len for e in events if e.type == "request"}
    assert _value(families, "vllm:generation_tokens", "vllm:generation_tokens_total") == sum(len(s.sampled)
                                                                                             for s in steps)
    assert _value(families, "vllm:num_preemptions", "vllm:num_preemptions_total") == sum(len(s.preemptions)
                                                                                         for s in steps) > 0
    assert _value(families, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == sum(
        prompt_len[f.req] for s in steps for f in s.first_tokens)
    assert _value(families, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == steps[-1].kv.hit_tokens > 0
    assert _value(families, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == steps[-1].kv.query_tokens
    for reason in ("length", "abort"):
        assert _value(families, "vllm:request_success", "vllm:request_success_total", finished_reason=reason) == \
            sum(f.reason == reason for f in finishes)
    assert _value(families, "vllm:request_success", "vllm:request_success_total", finished_reason="abort") == 1
    n_first = sum(len(s.first_tokens) for s in steps)
    n_itl = sum(len(s.itl) for s in steps)
    assert _value(families, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == n_first
    assert _value(families, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == n_itl
    assert _value(families, "vllm:time_per_output_token_seconds", "vllm:time_per_output_token_seconds_sum") == \
        pytest.approx(sum(i.gap for s in steps for i in s.itl))
    assert _value(families, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == \
        len(finishes) == 40
    assert _value(families, "vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_count") == 40
    assert _value(families, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_sum") == sum(
        b.tokens for s in steps for b in s.batch)
    assert _value(families, "vllm:num_requests_running") == len(steps[-1].running) == 0
    assert _value(families, "vllm:kv_cache_usage_perc") == steps[-1].kv.used / steps[-1].kv.total
    kinds = {k: sum(step_kind(s) == k for s in steps) for k in ("prefill", "decode", "mixed", "idle")}
    for kind, n in kinds.items():
        assert _value(families, "kvscope:steps", "kvscope:steps_total", kind=kind) == n
    blocked = sum(s.admission.verdict == "blocked" for s in steps)
    assert _value(families, "kvscope:blocked_steps", "kvscope:blocked_steps_total") == blocked > 0


def test_metrics_port_alone_serves_the_sink():
    engine = LLMEngine(EngineConfig(backend="sim", model="qwen3-0.6b", gpu="l4", num_blocks=64))
    port = free_port()
    front = FrontEnd(engine, http=None, metrics_port=port, served_model_name="m", allow_remote=False)
    engine.attach(front.sink)
    front.start()
    try:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=3))
        while engine.has_unfinished():
            engine.step()
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=DEADLINE_S).text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        assert _value(fams, "vllm:generation_tokens", "vllm:generation_tokens_total") == 3
    finally:
        front.close()


def test_cli_serve_http_end_to_end(tmp_path):
    """`kvscope serve --http` as a user runs it: answers, exposes /metrics, stops cleanly on SIGTERM."""
    import openai

    port = free_port()
    cmd = [sys.executable, "-m", "kvscope", "serve", "--http", f"127.0.0.1:{port}", "--backend", "sim",
           "--model", "qwen3-0.6b", "--gpu", "l4", "--served-model-name", "demo", "--no-progress",
           "--record", str(tmp_path / "http.kvtrace")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=DEADLINE_S) as c:
            out = c.completions.create(model="demo", prompt=[5, 6, 7], max_tokens=4)
            assert out.usage.completion_tokens == 4
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=DEADLINE_S).text
        assert 'vllm:generation_tokens_total{engine="0",model_name="demo"} 4.0' in text
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    from kvscope.traces.reader import TraceReader

    reqs = [e for e in TraceReader(tmp_path / "http.kvtrace") if e.type == "request"]
    assert [r.source for r in reqs] == ["http"]


def test_cli_refuses_a_remote_bind_without_allow_remote():
    proc = subprocess.run([sys.executable, "-m", "kvscope", "serve", "--http", "0.0.0.0:8000"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("kvscope: error:") and "--allow-remote" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_grafana_board_queries_only_exported_metrics(run):
    import json
    import re
    from pathlib import Path

    families, _ = run
    exported = {s.name for f in families.values() for s in f.samples}
    board = (Path(__file__).parents[1] / "docs" / "grafana" / "kvscope.json").read_text()
    json.loads(board)
    names = set(re.findall(r"kvscope:[a-z_]+", board))
    assert len(names) >= 8 and names <= exported, names - exported
