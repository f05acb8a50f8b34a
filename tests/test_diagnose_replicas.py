"""`kvscope diagnose A B`: the replicas of one deployment judged together (is the load spread?), then each alone."""

from __future__ import annotations

import json

import pytest

from kvscope.cli import main
from tests.fakes.streams import drained_sim_stream


def _trace(path, events) -> str:
    from kvscope.traces.writer import TraceWriter

    w = TraceWriter(str(path), events[0])
    for ev in events[1:]:
        w.publish(ev)
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("replicas")
    busy = _trace(d / "rank0.kvtrace", drained_sim_stream(0, requests=40, max_num_seqs=2))  # a long queue
    idle = _trace(d / "rank1.kvtrace", drained_sim_stream(1, requests=4, max_num_seqs=8))  # room to spare
    even = _trace(d / "rank1-busy.kvtrace", drained_sim_stream(2, requests=40, max_num_seqs=2))
    return busy, idle, even


def test_one_rank_queueing_while_the_other_has_room_is_named(traces, capsys, tmp_path):
    busy, idle, _ = traces
    out_json = tmp_path / "d.json"
    assert main(["diagnose", busy, idle, "--no-what-if", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    verdict = next(ln for ln in out.splitlines() if ln.startswith(("imbalance:", "balanced:")))
    assert verdict.startswith(f"imbalance: {busy}'s queue averaged")
    assert f"while {idle} averaged 0.0 waiting" in verdict
    assert "route by load" in out and out.count("diagnosis of ") == 2  # each replica's own diagnosis follows
    body = json.loads(out_json.read_text())
    assert body["replicas"]["uneven"] is True and len(body["diagnoses"]) == 2
    waits = [r["mean_waiting"] for r in body["replicas"]["replicas"]]
    assert waits[0] > 2.0 and waits[1] <= 0.5


def test_two_ranks_queueing_alike_are_balanced(traces, capsys):
    busy, _, even = traces
    assert main(["diagnose", busy, even, "--no-what-if"]) == 0
    out = capsys.readouterr().out
    assert "\nbalanced: " in out and "imbalance:" not in out


def test_the_same_trace_twice_is_one_line(traces, capsys):
    busy, _, _ = traces
    assert main(["diagnose", busy, busy, "--no-what-if"]) == 2
    assert "named twice" in capsys.readouterr().err
