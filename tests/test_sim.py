"""The sim backend: catalog, cost model, virtual clock, same scheduler/event path, calibration, bench."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace

import pytest

from kvscope.engine.clock import VirtualClock
from kvscope.engine.config import EngineConfig
from kvscope.errors import KvscopeError
from kvscope.engine.sim import catalog
from kvscope.engine.sim.cost import CostModel, Efficiency, StepShape
from kvscope.workload import WorkloadRequest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _shape(*seqs: tuple[int, int]) -> StepShape:
    s = StepShape()
    for n, start in seqs:
        s.add(n, start, True)
    return s


def _items(n: int, prompt: int = 40, out: int = 12, gap: float = 0.0, vocab: int = 1000):
    return [WorkloadRequest(arrival=i * gap, prompt=[(i * 7 + k) % (vocab - 2) for k in range(prompt + i % 5)],
                            max_tokens=out + i % 3) for i in range(n)]


# ---- catalog -----------------------------------------------------------------------------
def test_catalog_complete_with_sources():
    for name in ("h100-sxm5", "h200", "a100-80gb", "l4"):
        g = catalog.gpu(name)
        assert g.memory_bytes > 10e9 and g.memory_bw > 1e11 and g.rate("bf16") > 1e13
        assert "datasheet" in g.source and "nvidia.com" in g.source
    assert catalog.gpu("h100-sxm5").rate("fp8") == pytest.approx(2 * catalog.gpu("h100-sxm5").rate("bf16"), rel=0.01)
    assert catalog.gpu("a100-80gb").rate("fp8") == catalog.gpu("a100-80gb").rate("bf16")  # no FP8 tensor cores
    for name in ("llama-3.3-70b", "llama-3.3-70b-fp8", "llama-3.1-8b", "qwen3-0.6b", "qwen3-8b"):
        m = catalog.model(name)
        assert "huggingface.co" in m.source
        # the parameter count derived from the shape matches the published one
        assert abs(m.total_params / m.params - 1) < 0.02, (name, m.total_params)
    with pytest.raises(KvscopeError):
        catalog.gpu("tpu-v9")
    with pytest.raises(KvscopeError):
        catalog.model("gpt-9")


def test_kv_bytes_per_token_matches_the_lesson():
    m = catalog.model("llama-3.3-70b")
    assert m.kv_bytes_per_token("bf16") == 80 * 2 * 8 * 128 * 2
    assert m.kv_bytes_per_token("bf16") * 8192 / catalog.GiB == pytest.approx(2.5)
    fp8 = catalog.model("llama-3.3-70b-fp8")
    assert 70e9 < fp8.weight_bytes < 75e9 < m.weight_bytes  # linear layers in FP8, embeddings bf16


# ---- cost model --------------------------------------------------------------------------
def test_cost_grows_with_work():
    cost = CostModel(catalog.gpu("h100-sxm5"), catalog.model("llama-3.1-8b"))
    t = cost.step_time
    assert t(_shape((1, 100))) < t(_shape(*[(1, 100)] * 64)) < t(_shape(*[(1, 100)] * 256))
    assert t(_shape(*[(1, 100)] * 64)) < t(_shape(*[(1, 4000)] * 64))  # longer contexts read more KV
    assert t(_shape((256, 0))) < t(_shape((1024, 0))) < t(_shape((4096, 0)))
    assert t(_shape((512, 0))) < t(_shape((512, 8000)))  # the quadratic attention term
    assert t(StepShape()) == cost.eff.overhead_s


def test_decode_is_memory_bound_and_big_prefill_compute_bound():
    cost = CostModel(catalog.gpu("h100-sxm5"), catalog.model("llama-3.3-70b-fp8"))
    eff = cost.eff
    for batch in (1, 8, 64):
        d = cost.terms(_shape(*[(1, 1000)] * batch))
        assert d.weight_mem / eff.eff_bw > d.linear_comp / eff.eff_flops
    p = cost.terms(_shape((4096, 0)))
    assert p.linear_comp / eff.eff_flops > p.weight_mem / eff.eff_bw
    # batch-1 decode of a 70B FP8 model is bounded by streaming ~70 GB of weights
    one = cost.step_time(_shape((1, 100)))
    assert 0.021 < one < 0.035


def test_tensor_parallel_splits_work_and_adds_memory():
    g, m = catalog.gpu("h100-sxm5"), catalog.model("llama-3.3-70b")
    tp1, tp4 = CostModel(g, m, tp=1), CostModel(g, m, tp=4)
    decode = _shape(*[(1, 500)] * 32)
    assert tp4.step_time(decode) < tp1.step_time(decode) / 2
    assert tp1.num_blocks(16, 0.9) == 0  # 141 GB of bf16 weights do not fit on one 80 GB GPU
    assert tp4.num_blocks(16, 0.9) > 10_000


def test_kv_capacity_from_memory_and_kv_dtype():
    cfg = EngineConfig(backend="sim", model="llama-3.3-70b-fp8", gpu="h100-sxm5")
    from kvscope.engine.llm_engine import LLMEngine

    bf16 = LLMEngine(cfg).num_blocks
    fp8 = LLMEngine(replace(cfg, kv_cache_dtype="fp8")).num_blocks
    assert fp8 == pytest.approx(2 * bf16, rel=0.01)
    assert LLMEngine(replace(cfg, gpu_memory_utilization=0.95)).num_blocks > bf16
    with pytest.raises(KvscopeError, match="does not fit"):
        LLMEngine(replace(cfg, model="llama-3.3-70b"))
    with pytest.raises(KvscopeError):
        EngineConfig(backend="sim", model="nope").validate()


# ---- the engine on the sim ---------------------------------------------------------------------
def _sim_config(**kw) -> EngineConfig:
    base = dict(backend="sim", model="qwen3-0.6b", gpu="l4", num_blocks=96, max_num_seqs=8,
                max_num_batched_tokens=64, max_model_len=512)
    base.update(kw)
    return EngineConfig(**base)


@pytest.mark.parametrize("mode", ["naive", "static", "continuous", "chunked"])
def test_sim_run_is_deterministic_and_drains(mode):
    from kvscope.bench.harness import run_config

    results = []
    for _ in range(2):
        engine, server = run_config(_sim_config(mode=mode), _items(20))
        assert not engine.has_unfinished()
        s = server.summary()
        assert s.requests == 20 and s.output_tokens == sum(12 + i % 3 for i in range(20))
        results.append((engine.now(), s.to_dict()))
    assert results[0] == results[1]


def test_sim_tokens_never_eos_and_hello_says_sim():
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.sampling_params import SamplingParams

    engine = LLMEngine(_sim_config())
    req = engine.add_request([5, 6, 7], SamplingParams(max_tokens=50))  # EOS would be honoured here
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert finished[0].req_id == req and finished[0].finish_reason == "length"
    assert all(t not in engine.loaded.eos_token_ids for t in finished[0].token_ids)
    hello = engine.hello().config.as_dict()
    assert hello["backend"] == "sim" and hello["gpu"] == "l4" and hello["sim_model"] == "qwen3-0.6b"
    assert hello["device"] == "sim:l4"


def test_virtual_clock_jumps_idle_gaps():
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.serve.driver import ServeOptions, Server

    engine = LLMEngine(_sim_config())
    items = [replace(it, arrival=a) for it, a in zip(_items(3), (0.0, 500.0, 3600.0))]
    wall = time.perf_counter()
    summary = Server(engine, ServeOptions(verbose_rejects=False)).run(items)
    assert time.perf_counter() - wall < 5
    assert summary.requests == 3
    assert engine.now() > 3600  # an hour of virtual time
    assert summary.ttft_p99_s < 1.0  # nobody waited for the gaps


def test_virtual_clock_pacing():
    c = VirtualClock(pace=100.0)
    wall = time.perf_counter()
    c.advance(0.5)  # 0.5 virtual s at 100x is 5 ms of wall time
    assert time.perf_counter() - wall >= 0.004
    c.sleep_until(0.2)
    assert c.now() == 0.5
    with pytest.raises(ValueError):
        c.advance(-1)


def test_sim_events_replay_through_traces_and_reducer(tmp_path):
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.serve.driver import ServeOptions, Server
    from kvscope.protocol.events import StepEvent
    from kvscope.traces.reader import TraceReader
    from kvscope.traces.writer import TraceWriter
    from kvscope.tui.model.state import new_state, reduce_all

    path = tmp_path / "sim.kvtrace"
    engine = LLMEngine(_sim_config(num_blocks=40))  # small: preemptions happen
    writer = TraceWriter(path, engine.hello(), snapshot_provider=engine.snapshot, background=False)
    engine.attach(writer)
    summary = Server(engine, ServeOptions(verbose_rejects=False)).run(_items(24, prompt=60, out=30, gap=0.01))
    engine.close()
    writer.close()
    reader = TraceReader(path)
    assert reader.hello.config.backend == "sim"
    events = list(reader)
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert len(steps) == engine.scheduler.step_count
    assert sum(len(s.sampled) for s in steps) == summary.output_tokens
    assert sum(len(s.preemptions) for s in steps) == engine.num_preemptions > 0
    state = reduce_all(new_state(), [reader.hello] + events)
    assert state.config.backend == "sim"
    assert state.finished_count == 24 and state.ended == "drained"


# ---- calibration ----------------------------------------------------------------------------------
def test_calibrate_recovers_known_parameters(tmp_path):
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.serve.driver import ServeOptions, Server
    from kvscope.analysis.calibrate import calibrate
    from kvscope.traces.writer import TraceWriter

    truth = Efficiency(eff_bw=0.55, eff_flops=0.35, overhead_s=0.004, per_seq_s=0.0002)
    cfg = EngineConfig(backend="sim", model="llama-3.1-8b", gpu="a100-80gb", num_blocks=2000, max_num_seqs=48,
                       max_num_batched_tokens=1024, sim_efficiency=truth.to_dict())
    engine = LLMEngine(cfg)
    path = tmp_path / "synthetic.kvtrace"
    writer = TraceWriter(path, engine.hello(), snapshot_provider=engine.snapshot, background=False)
    engine.attach(writer)
    # long prompts (compute-bound chunks) and many decodes (memory-bound steps)
    items = [WorkloadRequest(arrival=i * 0.05, prompt=[(i + k) % 1000 for k in range(100 + (i * 397) % 1900)],
                             max_tokens=20 + (i * 13) % 60) for i in range(80)]
    Server(engine, ServeOptions(verbose_rejects=False)).run(items)
    engine.close()
    writer.close()
    r = calibrate(str(path))
    got = r["efficiency"]
    for key in ("eff_bw", "eff_flops", "overhead_s", "per_seq_s"):
        assert got[key] == pytest.approx(getattr(truth, key), rel=0.03, abs=1e-6), key
    assert r["fit"]["r2"] > 0.999
    assert abs(r["error"]["output_tok_per_s"]) < 0.01 and abs(r["error"]["ttft_p50_s"]) < 0.01


def test_calibrated_cpu_trace_reproduces_throughput_and_ttft():
    """The acceptance target: fitted on the real engine's CPU run, the sim lands within 10%."""
    from kvscope.analysis.calibrate import calibrate

    r = calibrate(os.path.join(ROOT, "traces", "calib-cpu.kvtrace"))
    assert r["gpu"] == "cpu" and r["model"] == "tiny"
    assert abs(r["error"]["output_tok_per_s"]) < 0.10
    assert abs(r["error"]["ttft_p50_s"]) < 0.10


# ---- bench and CLI --------------------------------------------------------------------------
def test_bench_sim_json_has_the_model_bench_shape(tmp_path, capsys):
    from kvscope.cli import main

    out = tmp_path / "sim.json"
    rc = main(["bench", "--backend", "sim", "--model", "qwen3-8b", "--gpu", "h200", "--num-requests", "24",
               "--max-num-seqs", "16", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [r["name"] for r in result["rows"]] == ["naive", "static", "continuous", "chunked"]
    for key in ("workload", "model", "device", "num_requests", "max_num_seqs", "max_num_batched_tokens", "rows"):
        assert key in result
    for row in result["rows"]:
        for key in ("output_tok_per_s", "ttft_mean_s", "ttft_p99_s", "itl_p99_s", "preemptions", "kv_waste",
                    "output_tokens", "duration_s", "steps"):
            assert key in row
    tps = {r["name"]: r["output_tok_per_s"] for r in result["rows"]}
    assert tps["naive"] < tps["static"] < tps["continuous"]
    assert result["sim"]["gpu"] == "h200" and result["backend"] == "sim"


def test_fragmentation_preset(tmp_path, capsys):
    from kvscope.cli import main

    out = tmp_path / "frag.json"
    assert main(["bench", "--preset", "fragmentation", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["num_requests"] == 1000
    assert 1400 < r["tokens_mean"] < 1600 and 500 < r["tokens_std"] < 700
    assert 0.75 < r["reserved"]["waste"] < 0.88  # the lesson: reserving max_len wastes 60-80%+
    assert r["paged"]["waste"] < 0.04 and r["paged"]["waste_tokens_per_request"] < 16


def test_calibrate_cli_and_efficiency_file(tmp_path, capsys):
    from kvscope.cli import main

    out = tmp_path / "fit.json"
    assert main(["calibrate", os.path.join(ROOT, "traces", "calib-cpu.kvtrace"), "--json", str(out)]) == 0
    assert "TTFT p50" in capsys.readouterr().out
    bench = tmp_path / "b.json"
    assert main(["bench", "--backend", "sim", "--model", "tiny", "--gpu", "cpu", "--sim-efficiency", str(out),
                 "--num-requests", "8", "--modes", "chunked", "--json", str(bench)]) == 0
    eff = json.loads(bench.read_text())["sim"]["sim_efficiency"]
    assert eff == json.loads(out.read_text())["efficiency"]
    assert main(["bench", "--backend", "sim", "--model", "gpt-9"]) == 2


def test_sim_swap_preemption_bills_copies():
    from kvscope.bench.harness import run_config

    engine, server = run_config(_sim_config(preemption="swap", num_blocks=30), _items(16, prompt=60, out=30))
    assert engine.num_preemptions > 0 and engine.swapper.blocks_copied > 0
    assert server.summary().requests == 16


def test_gpu_from_cuda_device_name():
    assert catalog.gpu_from_device_name("NVIDIA H200") == "h200"
    assert catalog.gpu_from_device_name("NVIDIA H100 80GB HBM3") == "h100-sxm5"
    assert catalog.gpu_from_device_name("NVIDIA H100 PCIe") is None
    assert catalog.gpu_from_device_name("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert catalog.gpu_from_device_name("NVIDIA L4") == "l4"
    assert catalog.gpu_from_device_name(None) is None
