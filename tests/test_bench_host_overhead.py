"""`kvscope bench --host-overhead`: the rows and the input-building table, on a small run."""

from __future__ import annotations

import json

import pytest

from kvscope.bench import host_overhead as ho

def test_a_step_loop_with_no_compute_reports_full_decode_steps():
    row = ho.measure_steps(8)
    assert row["running"] == 8
    # outputs are 128-256 tokens: after the prefills, at least 127 steps run all 8 requests' decodes
    assert row["full_decode_steps"] >= 127
    assert row["steps"] > row["full_decode_steps"]
    assert row["host_ms_per_step"] > 0
    assert row["host_us_per_request"] == row["host_ms_per_step"] * 1e3 / 8


def test_input_table_times_both_builders_on_the_same_steps():
    rows = ho.measure_inputs(repeats=2)
    assert [r["case"] for r in rows] == ["256 decodes", "one 8,192-token chunked step"]
    assert [r["tokens"] for r in rows] == [256, 8192]
    assert all(r["old_us"] > 0 and r["new_us"] > 0 for r in rows)


def test_cli_flag_prints_the_table_and_writes_json(tmp_path, monkeypatch):
    monkeypatch.setattr(ho, "RUNNING", (4, 8))
    from kvscope import cli

    path = tmp_path / "host.json"
    assert cli.main(["bench", "--host-overhead", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert [r["running"] for r in result["rows"]] == [4, 8]
    assert result["bench"] == "host-overhead"


def test_device_null_is_the_same_bench_and_vllms_scheduler_runs_the_same_requests(tmp_path, monkeypatch):
    pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is installed by `make vllm`")
    monkeypatch.setattr(ho, "RUNNING", (8,))
    from kvscope import cli

    path = tmp_path / "null.json"
    assert cli.main(["bench", "--device", "null", "--json", str(path)]) == 0
    row = json.loads(path.read_text())["rows"][0]
    assert row["running"] == 8 and row["full_decode_steps"] >= 127
    # vLLM's scheduler served the same 8 requests to the end, and decoded all 8 at once as kvscope did
    assert row["vllm_ms_per_step"] > 0 and row["vllm_steps"] >= 128
    assert row["over_vllm"] == row["host_ms_per_step"] / row["vllm_ms_per_step"]
