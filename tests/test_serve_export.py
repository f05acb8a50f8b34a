"""`kvscope export`: the Perfetto JSON and CSV tables agree with the trace's own events; memory stays flat."""

from __future__ import annotations

import csv
import json
import random
import subprocess
import sys
from collections import Counter, defaultdict

import pytest

from kvscope.engine import LLMEngine, SamplingParams
from kvscope.engine.config import EngineConfig
from kvscope.engine.errors import RequestRejected
from kvscope.protocol import events as E
from kvscope.serve.metrics import step_kind
from kvscope.traces.reader import TraceReader
from kvscope.traces.writer import TraceWriter


@pytest.fixture(scope="module")
def sim_trace(tmp_path_factory):
    """A sim run with prefix hits, swap and recompute preemptions, a reject and aborts."""
    path = tmp_path_factory.mktemp("export") / "sim.kvtrace"
    engine = LLMEngine(EngineConfig(backend="sim", model="qwen3-0.6b", gpu="l4", num_blocks=20, max_num_seqs=8,
                                    max_num_batched_tokens=64, max_model_len=300, prefix_caching=True,
                                    preemption="swap", swap_space=0.002), snapshot_every=50)
    writer = TraceWriter(path, engine.hello(), snapshot_provider=engine.snapshot, chunk_steps=64)
    engine.attach(writer)
    rng = random.Random(5)
    shared = [rng.randrange(1000) for _ in range(32)]
    ids = []
    for i in range(60):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(1000) for _ in range(rng.randint(3, 90))]
        ids.append(engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 80))))
        for _ in range(rng.randint(0, 6)):
            engine.step()
        if i in (20, 41):
            engine.abort_request(ids[i - 1])
    with pytest.raises(RequestRejected):
        engine.add_request(list(range(400)), SamplingParams(max_tokens=4))
    while engine.has_unfinished():
        engine.step()
    engine.close()
    writer.close()
    return path


@pytest.fixture(scope="module")
def exported(sim_trace, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    from kvscope.cli import main

    assert main(["export", str(sim_trace), "--perfetto", str(out / "t.json"), "--requests", str(out / "r.csv"),
                 "--steps", str(out / "s.csv")]) == 0
    events = list(TraceReader(sim_trace))
    trace = json.loads((out / "t.json").read_text())
    with open(out / "r.csv") as f:
        requests = list(csv.DictReader(f))
    with open(out / "s.csv") as f:
        steps = list(csv.DictReader(f))
    return events, trace["traceEvents"], requests, steps


def _steps(events):
    return [e for e in events if isinstance(e, E.StepEvent)]


def test_one_scheduler_slice_per_step_named_by_kind(exported):
    events, trace, _, _ = exported
    slices = [e for e in trace if e["ph"] == "X" and e["pid"] == 1]
    steps = _steps(events)
    assert [s["args"]["step"] for s in slices] == [s.step for s in steps]
    assert [s["name"] for s in slices] == [step_kind(s) for s in steps]
    assert {s["name"] for s in slices} >= {"prefill", "decode", "mixed"}
    for sl, st in zip(slices, steps):
        assert sl["args"]["tokens"] == sum(b.tokens for b in st.batch)
        assert sl["args"]["batch_size"] == len(st.batch)
        assert sl["ts"] == round(st.t * 1e6)


def test_every_request_has_its_phases(exported):
    events, trace, requests, _ = exported
    arrivals = {e.req for e in events if isinstance(e, E.RequestEvent)}
    req_slices = defaultdict(list)
    for e in trace:
        if e["ph"] == "X" and e["pid"] == 2:
            req_slices[e["args"]["req"]].append(e)
    assert set(req_slices) == arrivals
    prefill_entries = Counter(b.req for s in _steps(events) for b in s.batch if b.kind == "prefill")
    prefill_tokens = Counter()
    for s in _steps(events):
        for b in s.batch:
            if b.kind == "prefill":
                prefill_tokens[b.req] += b.tokens
    finishes = {f.req: f for s in _steps(events) for f in s.finished}
    for req, sl in req_slices.items():
        assert len({s["tid"] for s in sl}) == 1, "a request stays on one lane"
        assert sum(s["name"] == "prefill" for s in sl) == prefill_entries[req]
        assert sum(s["args"]["tokens"] for s in sl if s["name"] == "prefill") == prefill_tokens[req]
        assert sl[0]["args"]["output_tokens"] == finishes[req].output_len
        assert sl[0]["args"]["finish_reason"] == finishes[req].reason
        assert set(sl[0]["args"]) >= {"req", "prompt_tokens", "cached_tokens", "output_tokens", "ttft"}
    assert any(s["args"]["cached_tokens"] > 0 for sl in req_slices.values() for s in sl)
    assert {s["name"] for sl in req_slices.values() for s in sl} >= {"queued", "prefill", "decode", "swapped"}
    assert {r["req"] for r in requests} == {str(r) for r in arrivals}
    assert sum(r["finish_reason"] == "abort" for r in requests) == 2


def test_no_two_slices_overlap_on_a_track(exported):
    _, trace, _, _ = exported
    tracks = defaultdict(list)
    for e in trace:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["ts"], int)
            tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    assert len(tracks) > 3
    lanes = [k for k in tracks if k[0] == 2]
    assert len(lanes) < len({e["args"]["req"] for e in trace if e["ph"] == "X" and e["pid"] == 2}), "lanes reused"
    for spans in tracks.values():
        spans.sort()
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            assert a1 <= b0


def test_counters_follow_the_steps(exported):
    events, trace, _, steps_csv = exported
    series = defaultdict(list)
    for e in trace:
        if e["ph"] == "C":
            series[e["name"]].append((e["ts"], e["args"]))

    def at(name, ts):
        vals = [a for t, a in series[name] if t <= ts]
        return vals[-1]

    for st in _steps(events):
        end = round((st.t + st.dur) * 1e6)
        q = at("queues", end)
        assert q == {"running": len(st.running), "waiting": len(st.waiting),
                     "preempted": len(st.preempted) + len(st.swapped)}
        assert at("kv blocks", end) == {"used": st.kv.used, "cached": st.kv.cached}
        assert at("step", end) == {"tokens": sum(b.tokens for b in st.batch)}
    assert len(steps_csv) == len(_steps(events))
    assert [int(r["kv_used"]) for r in steps_csv] == [s.kv.used for s in _steps(events)]


def test_instants_for_preemptions_swaps_and_rejects(exported):
    events, trace, _, _ = exported
    inst = Counter(e["tid"] for e in trace if e["ph"] == "i")
    steps = _steps(events)
    assert inst[2] == sum(len(s.preemptions) for s in steps) > 0
    assert inst[3] == sum(len(s.swaps) for s in steps) > 0
    assert inst[4] == sum(isinstance(e, E.RejectEvent) for e in events) == 1
    modes = {e["args"]["mode"] for e in trace if e["ph"] == "i" and e["tid"] == 2}
    assert "swap" in modes


def _synthetic_trace(path, n_steps: int) -> None:
    """A long, consistent stream written straight to a trace (the engine is too slow for 100k steps in a test)."""
    hello = E.HelloEvent(E.PROTOCOL_VERSION, {"model": "synthetic", "block_size": 16, "num_blocks": 4096}, 0.0)
    state = {"running": [], "t": 0.0}
    writer = TraceWriter(path, hello, chunk_steps=2048, background=False,
                         snapshot_provider=lambda: E.SnapshotEvent(step=step, t=state["t"], running=list(left)))
    left: dict[int, int] = {}
    next_req = 0
    step = 0
    writer.publish(E.SnapshotEvent(step=0, t=0.0))
    for step in range(1, n_steps + 1):
        t = step * 0.01
        batch, first, finished = [], [], []
        if step % 4 == 1:
            writer.publish(E.RequestEvent(next_req, 32, 2 + next_req % 7, 0, t - 0.002))
            batch.append(E.BatchEntry(next_req, E.PREFILL, 32, 0))
            first.append(E.FirstToken(next_req, 0.012))
            left[next_req] = 2 + next_req % 7
            next_req += 1
        for req in list(left):
            if batch and batch[0].req == req:
                continue
            batch.append(E.BatchEntry(req, E.DECODE, 1, 0))
            left[req] -= 1
            if left[req] == 0:
                finished.append(E.Finish(req, 0.012, 0.1, 3, E.FINISH_LENGTH))
                del left[req]
        state["t"] = t
        writer.publish(E.StepEvent(step, t, 0.009, 512, batch=batch, running=list(left), sampled=[b.req for b in batch],
                                   first_tokens=first, finished=finished,
                                   kv=E.KvCounters(total=4096, used=3 * len(left))))
    writer.close()


def _export_peak_rss_mb(trace, out) -> float:
    code = ("import resource, sys; from kvscope.cli import main; "
            f"rc = main(['export', {str(trace)!r}, '--perfetto', {str(out)!r}, '--steps', {str(out) + '.csv'!r}]); "
            "assert rc == 0; assert 'torch' not in sys.modules, 'export imported torch'; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return float(proc.stdout.strip().splitlines()[-1])


def test_memory_stays_flat_on_a_100k_step_trace(tmp_path):
    small, big = tmp_path / "small.kvtrace", tmp_path / "big.kvtrace"
    _synthetic_trace(small, 5_000)
    _synthetic_trace(big, 100_000)
    rss_small = _export_peak_rss_mb(small, tmp_path / "small.json")
    rss_big = _export_peak_rss_mb(big, tmp_path / "big.json")
    assert rss_big < rss_small + 25, (rss_small, rss_big)
    with open(tmp_path / "big.json.csv") as f:
        assert sum(1 for _ in f) == 100_001
    tail = (tmp_path / "big.json").read_bytes()[-64:]
    assert tail.rstrip().endswith(b"]}")
