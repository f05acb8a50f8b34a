"""`kvscope bench --roofline` (kvscope/bench/roofline.py): each row's steps priced at the machine's peaks."""

from __future__ import annotations

import json

import pytest

from kvscope.bench import roofline
from kvscope.engine.sim.catalog import MODELS
from kvscope.engine.sim.cost import StepShape


def _peaks(flops: float, bw: float) -> roofline.MachinePeaks:
    return roofline.MachinePeaks(flops, bw, "bf16", 2, 512)


def test_a_step_costs_the_larger_of_its_flops_and_its_bytes():
    shape = MODELS["qwen3-0.6b"]
    line = roofline.Roofline.of(_peaks(1e12, 1e11), shape)
    decode = StepShape()
    for pos in (100, 200, 300):
        decode.add(1, pos, True)
    kv_bytes = shape.kv_bytes_per_token("bf16") * decode.kv_tokens
    bytes_s = (shape.weight_bytes_read_per_step + kv_bytes) / 1e11
    flops = 2 * shape.linear_params * 3 + 2 * shape.lm_head_params * 3 + \
        4 * shape.num_heads * shape.head_dim * shape.num_layers * decode.pairs
    assert bytes_s > flops / 1e12  # a small decode is memory-bound
    assert roofline.roofline_seconds(line.cost, [decode]) == pytest.approx(bytes_s)
    prefill = StepShape()
    prefill.add(512, 0, True)
    got = roofline.roofline_seconds(line.cost, [prefill])
    assert got > (shape.weight_bytes_read_per_step + shape.kv_bytes_per_token("bf16") * 512) / 1e11  # compute-bound
    assert roofline.roofline_seconds(line.cost, [decode, prefill]) == pytest.approx(bytes_s + got)
    extra = line.extra([decode, prefill], duration_s=4 * (bytes_s + got))
    assert extra["roofline_pct"] == pytest.approx(25.0)
    assert line.extra(None, 1.0) == {"roofline_s": None, "roofline_pct": None}


def test_hf_static_steps_are_its_padded_batches():
    from kvscope.workload import WorkloadRequest

    items = [WorkloadRequest(0.0, [1] * n, m) for n, m in ((4, 3), (6, 5), (2, 2))]
    shapes = roofline.hf_static_shapes(items, max_num_seqs=2)
    # batch 1: prefill 2 x 6 tokens, then 4 decode steps; batch 2: prefill 2 tokens, then 1 decode step
    assert [s.tokens for s in shapes] == [12, 2, 2, 2, 2, 2, 1]
    assert shapes[1].kv_tokens == 2 * 7 and shapes[-1].kv_tokens == 3


def test_the_sim_gives_the_same_figure_from_its_cost_model(tmp_path):
    from kvscope.cli.main import main

    out = tmp_path / "sim.json"
    assert main(["bench", "--backend", "sim", "--model", "qwen3-0.6b", "--gpu", "h100-sxm5", "--workload", "chat",
                 "--num-requests", "16", "--modes", "chunked,naive", "--roofline", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    for row in rows:
        # the sim's step time (two maxima plus overhead) is never under the roofline's one maximum
        assert 0 < row["roofline_pct"] <= 100.0
    chunked, naive = rows
    assert chunked["roofline_pct"] > naive["roofline_pct"]  # batching reads the weights once for many


def test_a_model_run_measures_the_machine_once_and_prices_every_row(tmp_path, capsys):
    from kvscope.cli.main import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--device", "cpu", "--dtype", "float32", "--model", "tiny", "--workload", "mixed",
                 "--num-requests", "4", "--max-num-seqs", "4", "--modes", "chunked,naive", "--peers",
                 "hf-static,hf-generate-batch", "--roofline", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    peaks = result["roofline"]["peaks"]
    assert peaks["flops_per_s"] > 0 and peaks["bytes_per_s"] > 0 and peaks["dtype"] == "fp32"
    assert len(peaks["gemms"]) >= 3 and all(g["flop_per_s"] > 0 and g["m"] == 512 for g in peaks["gemms"])
    by = {r["name"]: r for r in result["rows"]}
    for name in ("chunked", "naive", "hf-static"):
        assert by[name]["roofline_s"] > 0 and by[name]["roofline_pct"] > 0
    assert by["hf-generate-batch"]["roofline_pct"] is None  # its schedule is its own
    table = capsys.readouterr().out
    assert "roofline" in table.splitlines()[1] and "GFLOP/s" in table


def test_the_machine_is_measured_on_every_thread_the_engine_may_use(monkeypatch):
    """A thread tuner that ended a row on one thread must not halve the roofline's peak (the machine's limit)."""
    import types

    import torch

    from kvscope.bench import modes
    from kvscope.engine.loader.models import build_builtin

    seen = []
    monkeypatch.setattr(roofline, "measure_peaks",
                        lambda shape, dtype, tokens: seen.append(torch.get_num_threads()) or _peaks(1e12, 1e11))
    engine = types.SimpleNamespace(loaded=types.SimpleNamespace(model=build_builtin("tiny")), dtype="float32",
                                   backend=types.SimpleNamespace(cpu_threads=2, torch_dtype=torch.float32))
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # where the tuner left the row
    try:
        modes._measure_machine(engine, modes.EngineConfig(model="tiny"), lambda *a, **k: None)
        assert seen == [2] and torch.get_num_threads() == 1, "measured on 2 threads, then the tuner's count back"
    finally:
        torch.set_num_threads(before)
