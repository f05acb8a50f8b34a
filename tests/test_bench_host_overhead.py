"""`kvscope bench --host-overhead`: the rows and the input-building table, on a small run."""

from __future__ import annotations

import json

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
