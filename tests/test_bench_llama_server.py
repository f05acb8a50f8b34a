"""`kvscope bench --peers llama-server`: llama.cpp's server over parallel slots, as a process on loopback.

A stand-in server (tests/fakes/llama_server.py) speaks the real one's /health and streamed /completion, so
the row's client side, the flags passed and the one-line errors are tested without building llama.cpp.
"""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from kvscope.bench import llama_server_peer
from kvscope.engine.config import EngineConfig
from kvscope.errors import KvscopeError
from kvscope.workload.generate import WorkloadRequest

FAKE = os.path.join(os.path.dirname(__file__), "fakes", "llama_server.py")


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    """An executable named by KVSCOPE_LLAMA_SERVER that runs the stand-in; its log of argv and requests."""
    binary = tmp_path / "llama-server"
    binary.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "requests.jsonl"
    monkeypatch.setenv(llama_server_peer.BINARY_ENV, str(binary))
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    return gguf, log


def _records(log):
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_every_request_is_sent_at_once_greedy_and_counted_token_by_token(fake_server):
    gguf, log = fake_server
    items = [WorkloadRequest(0.0, [5, 6, 7 + i], max_tokens=3 + i) for i in range(5)]
    row = llama_server_peer.llama_server_row(EngineConfig(model=str(gguf), max_num_seqs=4), items, threads=2)

    assert row.name == "llama-server"
    assert row.output_tokens == sum(it.max_tokens for it in items)  # held-back tokens counted too
    assert row.extra["slots"] == 4 and row.extra["threads"] == 2 and row.extra["gguf"] == "m.gguf"
    assert row.output_tok_per_s > 0 and row.ttft_p99_s >= row.ttft_p50_s > 0
    records = _records(log)
    argv = records[0]["argv"]
    flags = dict(zip(argv[0::2], argv[1::2]))  # flag, value pairs; --no-webui last
    assert argv[argv.index("-m") + 1] == str(gguf)
    assert flags["--host"] == "127.0.0.1" and flags["-t"] == "2" and flags["-tb"] == "2"
    assert flags["-np"] == "4" and flags["-cram"] == "0"
    assert int(flags["-c"]) == 4 * (3 + 3 + 4 + 8)  # every slot holds the longest prompt + output
    bodies = [r["body"] for r in records[1:]]
    assert bodies[0]["prompt"] == [1, 2, 3]  # the warm-up
    served = sorted((b["prompt"], b["n_predict"]) for b in bodies[1:])
    assert served == sorted((it.prompt, it.max_tokens) for it in items)
    for b in bodies:
        assert b["temperature"] == 0.0 and b["top_k"] == 1 and b["ignore_eos"] is True
        assert b["cache_prompt"] is False and b["stream"] is True


def test_a_server_that_cannot_start_is_one_line_with_its_own_last_words(fake_server, monkeypatch):
    gguf, _ = fake_server
    monkeypatch.setenv("FAKE_LLAMA_FAIL", "error: failed to load model 'm.gguf'")
    items = [WorkloadRequest(0.0, [1, 2], max_tokens=2)]
    with pytest.raises(KvscopeError, match=r"exited with status 1 at start: error: failed to load model"):
        llama_server_peer.llama_server_row(EngineConfig(model=str(gguf)), items, threads=1)


def test_a_server_that_dies_mid_run_ends_the_row_with_one_error(fake_server, monkeypatch):
    gguf, _ = fake_server
    monkeypatch.setenv("FAKE_LLAMA_CRASH", "1")
    items = [WorkloadRequest(0.0, [4, 5, 6], max_tokens=8) for _ in range(3)]
    with pytest.raises(KvscopeError, match="peer llama-server: (the stream ended|request failed)"):
        llama_server_peer.llama_server_row(EngineConfig(model=str(gguf)), items, threads=1)


def test_without_the_binary_the_bench_says_how_to_build_it_before_any_row(monkeypatch, tmp_path, capsys):
    from kvscope.cli.main import main

    monkeypatch.delenv(llama_server_peer.BINARY_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-server anywhere
    assert main(["bench", "--model", "tiny", "--device", "cpu", "--peers", "llama-server", "--modes", "chunked",
                 "--num-requests", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "llama-server" in err[0] and "KVSCOPE_LLAMA_SERVER" in err[0]
    assert "[bench] chunked" not in err[0]


def test_a_named_binary_that_is_not_executable_is_refused(monkeypatch, tmp_path):
    plain = tmp_path / "llama-server"
    plain.write_text("not a program")
    monkeypatch.setenv(llama_server_peer.BINARY_ENV, str(plain))
    with pytest.raises(KvscopeError, match="is not an executable file"):
        llama_server_peer.server_binary()


def test_a_stream_cut_short_or_not_json_is_an_error_not_a_short_count():
    import io

    with pytest.raises(KvscopeError, match="ended before its last event"):
        llama_server_peer._token_times(io.BytesIO(b'data: {"tokens_predicted": 1, "stop": false}\n\n'))
    with pytest.raises(KvscopeError, match="not JSON"):
        llama_server_peer._token_times(io.BytesIO(b"data: {oops\n\n"))
    with pytest.raises(KvscopeError, match="without a token count"):
        llama_server_peer._token_times(io.BytesIO(b'data: {"tokens": [1], "stop": true}\n\n'))
    with pytest.raises(KvscopeError, match="without a token count"):
        llama_server_peer._token_times(io.BytesIO(b'data: {"tokens_predicted": 1e300, "stop": true}\n\n'))


def test_tokens_without_an_event_of_their_own_are_counted_by_the_next():
    """The real server sends nothing for a token that ends inside a UTF-8 character: 64 generated, 33 events."""
    import io

    stream = io.BytesIO(b'data: {"tokens_predicted": 1, "stop": false}\n\n'
                        b'data: {"tokens_predicted": 4, "stop": false}\n\n'
                        b'data: {"tokens_predicted": 5, "stop": true}\n\n')
    times = llama_server_peer._token_times(stream)
    assert len(times) == 5 and times[1] == times[2] == times[3]
