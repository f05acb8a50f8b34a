"""The vLLM stat-logger plugin: vLLM-shaped stats in, kvscope protocol steps out, never an exception back."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from kvscope.vllm.inproc import plugin as P
from kvscope.protocol.codec import decode, encode
from kvscope.protocol.events import HelloEvent, RequestEvent, StepEvent
from kvscope.tui.model.state import new_state, reduce
from tests.fakes import vllm_stats as S

ROOT = Path(__file__).resolve().parents[1]


def _step(i: int, *, prefill: int, decode: int, running: int, waiting: int, usage: float, preempted: int = 0,
          finished: int = 0, ttfts=(), itls=()):
    sched = S.SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=usage,
                             iteration_details=S.SchedulerIterationDetails(i, 1 if prefill else 0, prefill, running,
                                                                           decode, 12.5))
    it = S.IterationStats()
    it.iteration_timestamp = 1000.0 + 0.0125 * i
    it.num_generation_tokens = decode + len(ttfts)
    it.prompt_token_stats.computed = it.prompt_token_stats.total = prefill
    it.num_preempted_reqs = preempted
    it.time_to_first_tokens_iter = list(ttfts)
    it.inter_token_latencies_iter = list(itls)
    for k in range(finished):
        it.finished_requests.append(S.FinishedRequestStats(S.FinishReason.LENGTH, f"req-{i}-{k}", e2e_latency=2.0,
                                                           num_prompt_tokens=300, num_generation_tokens=64,
                                                           max_tokens_param=64, queued_time=0.5, prefill_time=0.1,
                                                           decode_time=1.2))
    return sched, it


SHAPE = [dict(prefill=512 if i % 4 == 0 else 0, decode=20 + i, running=20 + i, waiting=3 if i % 2 else 0,
              usage=0.5 + 0.01 * i, preempted=i % 5 == 4, finished=i % 3 == 2, ttfts=[0.2] if i % 4 == 0 else [],
              itls=[0.0125] * (20 + i)) for i in range(12)]


def test_vllm_shaped_stats_reduce_to_per_step_batches():
    maker = P.StepMaker(P.engine_info(S.VllmConfig()), wall_start=1000.0)
    state = new_state()
    for i, shape in enumerate(SHAPE):
        for ev in maker.events(*_step(i, **shape)):
            state = reduce(state, decode(encode(ev)))  # through the wire codec, as the TUI receives it
    assert state.config.backend == P.BACKEND and state.config.max_num_seqs == 256
    assert state.config.max_num_batched_tokens == 2048 and state.config.num_blocks == 4096
    bars = list(state.history)
    assert len(bars) == len(SHAPE)
    assert [b.prefill for b in bars] == [s["prefill"] for s in SHAPE]
    assert [b.decode for b in bars] == [s["decode"] for s in SHAPE]
    assert all(b.budget == 2048 for b in bars)
    assert abs(bars[1].dur - 0.0125) < 1e-9, "a step's duration is vLLM's elapsed_ms"
    assert len(state.running) == SHAPE[-1]["running"] and len(state.waiting) == SHAPE[-1]["waiting"]
    # vLLM's null block is no block of the pool: usage is over num_gpu_blocks - 1, as vLLM's own gauge
    assert state.config.null_block == 0 and state.kv.total == 4096 - 1
    assert state.kv.used == round(SHAPE[-1]["usage"] * 4095) and state.kv.used + state.kv.free == state.kv.total
    assert state.preemption_count == sum(bool(s["preempted"]) for s in SHAPE)
    assert state.finished_count == sum(bool(s["finished"]) for s in SHAPE)
    assert state.ttft.n == sum(len(s["ttfts"]) for s in SHAPE)
    assert state.itl.n == sum(len(s["itls"]) for s in SHAPE)


def test_finished_requests_keep_vllms_exact_latencies():
    maker = P.StepMaker(P.engine_info(S.VllmConfig()), wall_start=1000.0)
    evs = maker.events(*_step(400, prefill=0, decode=8, running=8, waiting=0, usage=0.3, finished=1))
    req = next(e for e in evs if isinstance(e, RequestEvent))
    step = next(e for e in evs if isinstance(e, StepEvent))
    f = step.finished[0]
    assert f.e2e == 2.0 and f.output_len == 64 and f.reason == "length"
    assert abs(f.ttft - 0.8) < 1e-9, "TTFT = e2e - decode time"
    assert req.req == f.req and req.prompt_len == 300 and abs(req.arrival - (step.t - 2.0)) < 1e-9


def test_waiting_reason_follows_the_limit_reached():
    maker = P.StepMaker(P.engine_info(S.VllmConfig()), wall_start=1000.0)
    kv = maker.events(*_step(1, prefill=0, decode=10, running=10, waiting=4, usage=0.97))[-1]
    seqs = maker.events(*_step(2, prefill=0, decode=256, running=256, waiting=4, usage=0.4))[-1]
    budget = maker.events(*_step(3, prefill=1900, decode=100, running=100, waiting=4, usage=0.4))[-1]
    assert (kv.admission.reason, seqs.admission.reason, budget.admission.reason) == \
        ("kv_blocks", "max_num_seqs", "token_budget")


class _Exploding:
    def __getattr__(self, name):
        raise RuntimeError(f"vLLM changed {name}")


def test_an_exception_inside_never_reaches_the_caller(monkeypatch):
    monkeypatch.setenv(P.ENV_ADDR, "tcp://127.0.0.1:0")
    logger = P.KvscopeStatLogger(S.VllmConfig(), 0)
    try:
        assert logger.publisher is not None
        assert logger.record(_Exploding(), _Exploding()) is None
        assert logger.record(object(), "not stats") is None
        assert logger.record(None, None, None, 0) is None
        assert logger.flush()
        assert logger.errors == 0, "fields that raise or are missing read as 0"
        assert logger.recorded == 2, "two steps had stats objects; (None, None) is no step"
        monkeypatch.setattr(logger.maker, "events", lambda *a: 1 / 0)
        assert logger.record(*_step(0, **SHAPE[0])) is None
        assert logger.flush()
        assert logger.errors == 1 and "ZeroDivisionError" in logger.last_error
        monkeypatch.setattr(logger, "_queue", None)  # even a broken logger's record returns
        assert logger.record(*_step(0, **SHAPE[0])) is None
    finally:
        logger.close()


def test_a_bad_address_leaves_vllm_serving(monkeypatch):
    monkeypatch.setenv(P.ENV_ADDR, "tcp://10.1.2.3:5557")  # not loopback: refused without the opt-in
    logger = P.KvscopeStatLogger(S.VllmConfig(), 0)
    assert logger.publisher is None and logger._queue is None
    assert logger.errors == 1 and "loopback" in logger.last_error.lower()
    logger.record(*_step(0, **SHAPE[0]))  # a no-op, no error


def test_a_full_queue_drops_the_step_and_counts_it(monkeypatch):
    import threading

    monkeypatch.setenv(P.ENV_ADDR, "tcp://127.0.0.1:0")
    monkeypatch.setattr(P, "QUEUE_SIZE", 2)
    logger = P.KvscopeStatLogger(S.VllmConfig(), 0)
    held = threading.Event()
    release = threading.Event()
    real = logger.publish_step
    sent: list = []
    monkeypatch.setattr(logger.publisher, "publish", sent.append)

    def slow(sched, it):  # a stalled sender: the queue fills behind it
        held.set()
        release.wait(60)
        real(sched, it)

    monkeypatch.setattr(logger, "publish_step", slow)
    try:
        logger.record(*_step(0, **SHAPE[0]))
        assert held.wait(60)
        for i in range(1, 10):
            logger.record(*_step(i, **SHAPE[i % len(SHAPE)]))  # returns at once: queued or dropped
        assert logger.dropped == 9 - 2, "two fit the queue behind the stalled one"
        monkeypatch.setattr(logger, "publish_step", real)
        release.set()
        assert logger.flush()
        logger.record(*_step(10, **SHAPE[0]))
        assert logger.flush()
        steps = [e for e in sent if isinstance(e, StepEvent)]
        assert len(steps) == 1 + 2 + 1 and sum(e.dropped for e in steps) == 7
    finally:
        release.set()
        logger.close()


def test_disabled_means_no_socket_and_no_zmq():
    # vLLM itself imports zmq (its loggers); with vLLM installed the check is on kvscope's own imports
    code = ("import sys, os; os.environ.pop('KVSCOPE_VLLM_PUBLISH', None); sys.modules['vllm'] = None;"
            "from kvscope.vllm.inproc.plugin import KvscopeStatLogger;"
            "from tests.fakes import vllm_stats as S;"
            "lg = KvscopeStatLogger(S.VllmConfig(), 0); lg.record(S.SchedulerStats(), S.IterationStats());"
            "import threading;"
            "print(lg.publisher is None, 'zmq' in sys.modules, lg.maker is None, threading.active_count())")
    env = {k: v for k, v in os.environ.items() if k != P.ENV_ADDR}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "True", "1"], "no socket, no zmq, no thread"


def test_enabled_publishes_steps_a_subscriber_decodes(monkeypatch):
    from kvscope.protocol.transport import Subscriber

    monkeypatch.setenv(P.ENV_ADDR, "tcp://127.0.0.1:0")
    logger = P.KvscopeStatLogger(S.VllmConfig(), 0)
    sub = Subscriber(logger.publisher.addr)
    try:
        got: list = []
        deadline = time.monotonic() + 60
        i = 0
        while not any(isinstance(e, StepEvent) for e in got) and time.monotonic() < deadline:
            logger.record(*_step(i, **SHAPE[i % len(SHAPE)]))  # zmq's slow joiner: keep stepping
            i += 1
            ev = sub.recv(20)
            if ev is not None:
                got.append(ev)
        steps = [e for e in got if isinstance(e, StepEvent)]
        assert steps and steps[0].budget == 2048
        assert logger.errors == 0
    finally:
        sub.close()
        logger.close()


def test_registered_under_vllms_entry_point_group():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    group = meta["project"]["entry-points"]["vllm.stat_logger_plugins"]
    module, _, name = group["kvscope"].partition(":")
    import importlib

    assert getattr(importlib.import_module(module), name) is P.KvscopeStatLogger
    for method in ("record", "log_engine_initialized", "log", "record_sleep_state"):
        assert callable(getattr(P.KvscopeStatLogger, method))


_WHEEL_STATS = os.environ.get("KVSCOPE_VLLM_STATS_PY")  # vllm/v1/metrics/stats.py from the wheel


@pytest.mark.skipif(not _WHEEL_STATS, reason="set KVSCOPE_VLLM_STATS_PY to vllm/v1/metrics/stats.py of a wheel")
def test_the_mirror_matches_vllms_source():
    tree = ast.parse(Path(_WHEEL_STATS).read_text())
    real: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            real[node.name] = [n.target.id for n in node.body if isinstance(n, ast.AnnAssign)
                               and isinstance(n.target, ast.Name) and n.target.id.islower()]
            if node.name == "IterationStats":
                init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
                real[node.name] = [t.attr for n in init.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                                   for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                                   if isinstance(t, ast.Attribute)]
    for cls in (S.SchedulerStats, S.SchedulerIterationDetails, S.FinishedRequestStats, S.PrefixCacheStats,
                S.BaseCacheStats, S.PromptTokenStats):
        own = [k for k in vars(cls).get("__annotations__", {})]  # the fields the class itself declares
        assert [f for f in real[cls.__name__] if f != "ALL_SOURCES"] == own, cls.__name__
    assert real["IterationStats"] == list(vars(S.IterationStats()))


def test_record_connect_writes_a_trace_that_diagnose_reads(monkeypatch, tmp_path):
    """`kvscope record --connect ADDR --control ''` on the plugin's socket, then diagnose the file."""
    import threading

    from kvscope.analysis.diagnose import diagnose_trace
    from kvscope.traces.reader import TraceReader
    from kvscope.traces.record import record

    monkeypatch.setenv(P.ENV_ADDR, "tcp://127.0.0.1:0")
    logger = P.KvscopeStatLogger(S.VllmConfig(), 0)
    path = tmp_path / "plugin.kvtrace"
    stop = threading.Event()
    seen: list = []
    t = threading.Thread(target=record, args=(logger.publisher.addr, path),
                         kwargs={"control_addr": None, "stop": stop, "on_event": seen.append}, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 120
        i = 0
        while sum(isinstance(e, StepEvent) for e in seen) < 2 * P.SNAPSHOT_EVERY and time.monotonic() < deadline:
            logger.record(*_step(i, **SHAPE[i % len(SHAPE)]))
            i += 1
            if i % 64 == 0:
                time.sleep(0.01)  # let the publisher's thread and the recorder keep up
    finally:
        stop.set()
        t.join(timeout=30)
        logger.close()
    events = list(TraceReader(path))
    assert sum(isinstance(e, StepEvent) for e in events) >= P.SNAPSHOT_EVERY
    d = diagnose_trace(str(path), what_if=False)
    assert d.backend == P.BACKEND and d.steps >= P.SNAPSHOT_EVERY
