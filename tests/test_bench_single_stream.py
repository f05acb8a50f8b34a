"""`kvscope bench --modes single-stream`: the workload served one request at a time (the row beside
llama.cpp's one-at-a-time peer), on the sim backend (fast) and the model backend (the tiny model)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("backend", [["--backend", "sim", "--model", "qwen3-0.6b"], ["--device", "cpu",
                                                                                     "--model", "tiny"]])
def test_single_stream_serves_one_request_per_step(tmp_path, backend):
    from kvscope.cli.main import main

    out = tmp_path / "bench.json"
    assert main(["bench", *backend, "--workload", "chat", "--num-requests", "6", "--modes", "chunked,single-stream",
                 "--peers", "", "--json", str(out)]) == 0
    chunked, single = json.loads(out.read_text())["rows"]
    assert (chunked["name"], single["name"]) == ("chunked", "single-stream")
    assert single["output_tokens"] == chunked["output_tokens"]  # the same requests, served whole
    # one stream: a step samples at most one token, so there are at least as many steps as tokens;
    # chunked batches the six requests, so it samples several tokens in most steps
    assert single["steps"] >= single["output_tokens"]
    assert chunked["steps"] < chunked["output_tokens"]
    assert single["ttft_p99_s"] > chunked["ttft_p99_s"]  # the last request waited for the five before it


def test_single_stream_is_a_row_name_the_command_line_takes(capsys):
    from kvscope.cli.main import main

    assert main(["bench", "--backend", "sim", "--modes", "chunked,one-stream"]) == 2
    assert "single-stream" in capsys.readouterr().err
