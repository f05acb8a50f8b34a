"""A vLLM stat-logger plugin: every engine step of a real vLLM, published as kvscope protocol events.

`pip install kvscope` registers ``KvscopeStatLogger`` under vLLM's entry-point group
``vllm.stat_logger_plugins`` (pyproject.toml); `vllm serve` loads it into its frontend.
It does nothing unless ``KVSCOPE_VLLM_PUBLISH`` names an address, e.g.
``KVSCOPE_VLLM_PUBLISH=tcp://127.0.0.1:5557``: then it binds a PUB socket there (loopback
only unless ``KVSCOPE_VLLM_ALLOW_REMOTE=1``) and `kvscope tui --connect ADDR`, `record
--connect ADDR`, `replay` and `diagnose` read it as they read a kvscope engine.

vLLM calls ``record(scheduler_stats, iteration_stats, ...)`` once per engine output batch
(one step). This plugin must never slow or break vLLM, so ``record`` only puts the two
stats objects on a bounded queue (vLLM makes new ones each step); the plugin's thread reads
them (defensively: vLLM says these classes are not a stable interface) into events for a
ZmqPublisher, whose own thread encodes and sends with NOBLOCK. A full queue drops the step
and counts it (the next step's ``dropped``). No exception leaves ``record``; one while
reading a step is counted and the step skipped. Importing
this module imports no zmq and nothing of vLLM's beyond its StatLoggerBase.

vLLM gives counts, not requests: a step's batch is one PREFILL entry (its prompt tokens)
and one DECODE entry (its generation tokens) under the synthetic request ids below, and
running / waiting are as many slot ids as vLLM counts. Finished requests are exact: each
finish carries vLLM's own e2e time, its TTFT (e2e - decode time) and output length, after a
``request`` event dated e2e seconds back; TTFTs and ITLs of the step are vLLM's own samples.
"""

from __future__ import annotations

import logging
import os
import time

ENV_ADDR = "KVSCOPE_VLLM_PUBLISH"
ENV_REMOTE = "KVSCOPE_VLLM_ALLOW_REMOTE"
BACKEND = "vllm-plugin"  # hello.config.backend of a vLLM's own steps
QUEUE_SIZE = 4096  # events waiting to be sent; past this they are dropped and counted
SNAPSHOT_EVERY = 128  # steps between a snapshot + hello: a late joiner (tui, record) starts from one
KV_SCALE = 10_000  # KV blocks reported when vLLM's num_gpu_blocks is unknown (usage x this)
PREFILL_ID, DECODE_ID, ANON_ID = -1, -2, -3  # synthetic request ids (vLLM names no request in its stats)
RUNNING_SLOT, WAITING_SLOT = -1_000_000, -2_000_000  # running slot i is RUNNING_SLOT - i
MAX_SLOTS = 4096  # slot ids per queue a step carries (the protocol has lists, not counts); more reads as this many
MAX_COUNT = 1 << 40  # a token or request count past this in vLLM's stats is garbage: read as this
MAX_TIME = 1e10  # seconds (or ms) past this in vLLM's stats are garbage: read as this
MAX_CONFIG_INT = 1 << 40  # a config int past this is not a setting but garbage: left out of the hello
MAX_BLOCKS = 1 << 24  # KV blocks a hello reports (16M blocks of 16 tokens: far past any GPU's KV cache)
log = logging.getLogger("kvscope.vllm_plugin")

try:  # vLLM checks that a plugin subclasses its base; without vLLM (tests, kvscope alone) any base does
    from vllm.v1.metrics.loggers import StatLoggerBase as _Base
except Exception:  # noqa: BLE001 - vllm absent, or a version whose module moved
    _Base = object


def _get(obj, *path, default=None):
    """``obj.a.b...``, or ``default`` where a step is missing, None, or raises (vLLM's objects are not ours)."""
    for name in path:
        try:
            obj = getattr(obj, name, None)
        except Exception:  # noqa: BLE001 - a property that raises reads as missing
            return default
        if obj is None:
            return default
    return obj


def _int(v, hi: int = MAX_CONFIG_INT) -> int | None:
    """A positive int a hello can carry, or None (bools, other types, out of range, a hostile __index__)."""
    try:
        if isinstance(v, bool) or not isinstance(v, int):
            return None
        v = int(v)
    except Exception:  # noqa: BLE001
        return None
    return v if 0 < v <= hi else None


def _num(v, hi: float = 1e12) -> float:
    """A stats number as a float in [0, hi]: 0 for NaN, negatives, non-numbers and what raises."""
    try:
        if not isinstance(v, (int, float)):
            return 0.0
        x = float(v)
    except Exception:  # noqa: BLE001 - an int past float's range, a hostile __float__
        return 0.0
    return x if 0.0 <= x <= hi else (hi if x > hi else 0.0)


def _count(v) -> int:
    """A stats count as an int in [0, MAX_COUNT] (0 for anything that is not a number)."""
    return int(_num(v, MAX_COUNT))


def _items(v, limit: int = MAX_SLOTS) -> list:
    """The first ``limit`` items of a list or tuple; [] for anything else."""
    return list(v[:limit]) if type(v) in (list, tuple) else []


def _str(v, limit: int = 200) -> str | None:
    """A plain string (an enum's value), cut to ``limit``; None for anything else."""
    try:
        v = getattr(v, "value", v)
        return str.__str__(v)[:limit] if isinstance(v, str) else None
    except Exception:  # noqa: BLE001
        return None


def _device(vllm_config) -> str:
    """The device vLLM runs on (DeviceConfig.device_type: "cpu", "cuda", ...), "" when unknown."""
    dev = _str(_get(vllm_config, "device_config", "device_type"), 64)
    if not dev:
        d = _get(vllm_config, "device_config", "device")
        dev = _str(_get(d, "type")) or _str(d, 64)
    return dev or ""


def _version() -> str | None:
    try:
        import vllm

        return _str(getattr(vllm, "__version__", None), 64)
    except Exception:  # noqa: BLE001 - vllm absent (tests) or broken: the key is left out
        return None


def engine_info(vllm_config) -> dict:
    """EngineInfo fields from a VllmConfig, each read defensively: an attribute that is missing, raises,
    has another type or is out of range is left out, so nothing in vLLM's config can fail a hello."""
    try:
        return _engine_info(vllm_config)
    except Exception:  # noqa: BLE001 - a config stranger than _get guards against: the engine's name only
        return {"engine": "vllm", "backend": BACKEND}


def _engine_info(vllm_config) -> dict:
    sched, cache = _get(vllm_config, "scheduler_config"), _get(vllm_config, "cache_config")
    model, par = _get(vllm_config, "model_config"), _get(vllm_config, "parallel_config")
    name = _get(model, "served_model_name") or _get(model, "model")
    if isinstance(name, (list, tuple)):  # served_model_name may list several; the first is the one reported
        name = name[0] if name else None
    chunked = _get(sched, "enable_chunked_prefill", default=True)
    info = {"engine": "vllm", "backend": BACKEND, "device": _device(vllm_config), "model": _str(name, 1000) or "",
            "mode": "continuous" if chunked is False else "chunked",
            "policy": _str(_get(sched, "policy")) or "fcfs"}
    version = _version()
    if version:
        info["vllm_version"] = version
    ints = {"max_num_seqs": _get(sched, "max_num_seqs"), "max_num_batched_tokens": _get(sched, "max_num_batched_tokens"),
            "max_model_len": _get(model, "max_model_len"), "num_blocks": _get(cache, "num_gpu_blocks"),
            "block_size": _get(cache, "block_size"), "tp": _get(par, "tensor_parallel_size")}
    for k, v in ints.items():
        v = _int(v, MAX_BLOCKS if k == "num_blocks" else MAX_CONFIG_INT)
        if v is not None:
            info[k] = v
    if info.get("num_blocks", 0) >= 2:
        info["null_block"] = 0  # vLLM's block 0 holds no KV (BlockPool.get_usage counts num_gpu_blocks - 1)
    else:
        info.pop("num_blocks", None)
    gmu = _get(cache, "gpu_memory_utilization")
    if type(gmu) is float and 0.0 < gmu <= 1.0:
        info["gpu_memory_utilization"] = gmu
    caching = _get(cache, "enable_prefix_caching")
    if type(caching) is bool:
        info["prefix_caching"] = caching
    dtype = _str(_get(cache, "cache_dtype"), 64)
    if dtype:
        info["kv_cache_dtype"] = dtype
    return info


def _watched(vllm_config) -> bool:
    """Is vLLM's scheduler kvscope's watched one (kvscope.vllm.inproc.watched)? It then publishes on the address."""
    cls = _get(vllm_config, "scheduler_config", "scheduler_cls")
    name = _str(cls)
    if name is None:
        name = f"{_str(_get(cls, '__module__')) or ''}.{_str(_get(cls, '__qualname__')) or ''}"
    return name.startswith("kvscope.vllm.inproc.watched.")


class StepMaker:
    """Turns one record() call into protocol events (pure: no I/O, no clock but the stats' own)."""

    def __init__(self, info: dict, wall_start: float) -> None:
        from kvscope.protocol.events import PROTOCOL_VERSION, HelloEvent, engine_info

        self.info = info
        self.hello = HelloEvent(PROTOCOL_VERSION, engine_info(info), wall_start)  # flat keys into their sections
        self.wall_start = wall_start
        self.step = 0
        self.next_req = 0
        self.last_t: float | None = None
        self.budget = int(info.get("max_num_batched_tokens") or 0)
        # kv.total: the blocks that hold KV (vLLM's null block is no block of the pool), so used / total is
        # vLLM's own kv_cache_usage
        self.blocks = int(info["num_blocks"]) - ("null_block" in info) if info.get("num_blocks") else KV_SCALE
        self.max_seqs = info.get("max_num_seqs")
        self._run_ids = [RUNNING_SLOT - i for i in range(MAX_SLOTS)]  # sliced per step: no per-step loop
        self._wait_ids = [WAITING_SLOT - i for i in range(MAX_SLOTS)]

    def events(self, sched, it, dropped: int = 0) -> list:
        from kvscope.protocol import events as E

        now = _num(_get(it, "iteration_timestamp"), MAX_TIME) or time.time()
        t = max(0.0, now - self.wall_start)
        details = _get(sched, "iteration_details")
        if details is not None:
            prefill = _count(_get(details, "num_ctx_tokens"))
            decode = _count(_get(details, "num_generation_tokens"))
        else:
            prefill = _count(_get(it, "prompt_token_stats", "computed")) or _count(_get(it, "num_prompt_tokens"))
            decode = max(0, _count(_get(it, "num_generation_tokens"))
                         - len(_items(_get(it, "time_to_first_tokens_iter"))))
        elapsed = _num(_get(details, "elapsed_ms"), MAX_TIME)
        dur = elapsed / 1000 if elapsed > 0 else (t - self.last_t if self.last_t is not None and t > self.last_t else 0.0)
        self.last_t = t
        running = min(MAX_SLOTS, _count(_get(sched, "num_running_reqs")))
        waiting = min(MAX_SLOTS, _count(_get(sched, "num_waiting_reqs")) + _count(_get(sched, "num_skipped_waiting_reqs")))
        usage = min(1.0, _num(_get(sched, "kv_cache_usage")))
        preempted = _count(_get(it, "num_preempted_reqs"))
        out: list = []
        run_ids = self._run_ids[:running]
        wait_ids = self._wait_ids[:waiting]
        used = min(self.blocks, round(usage * self.blocks))
        kv = E.KvCounters(total=self.blocks, used=used, free=self.blocks - used)
        if self.step % SNAPSHOT_EVERY == 0:  # as a kvscope engine does: a snapshot, then its hello
            out += [E.SnapshotEvent(self.step, t, running=run_ids, waiting=wait_ids, kv=kv), self.hello]
        self.step += 1
        finished = []
        for f in _items(_get(it, "finished_requests")):
            req = self.next_req
            self.next_req += 1
            e2e = _num(_get(f, "e2e_latency"), MAX_TIME)
            ttft = max(0.0, min(e2e, e2e - _num(_get(f, "decode_time"), MAX_TIME)))
            gen = _count(_get(f, "num_generation_tokens"))
            out.append(E.RequestEvent(req, _count(_get(f, "num_prompt_tokens")),
                                      _count(_get(f, "max_tokens_param")) or gen, 0, max(0.0, t - e2e)))
            fr = _get(f, "finish_reason")
            reason = (_str(_get(fr, "name"), 32) or _str(fr, 32) or "stop").lower()
            finished.append(E.Finish(req, ttft, e2e, gen, reason))
        batch = [E.BatchEntry(PREFILL_ID, E.PREFILL, prefill, 0)] if prefill else []
        if decode:
            batch.append(E.BatchEntry(DECODE_ID, E.DECODE, decode, 0))
        admission = E.Admission(E.VERDICT_IDLE)
        if waiting:
            admission = E.Admission(E.VERDICT_BLOCKED, self._reason(usage, preempted, running, prefill + decode))
        elif batch:
            admission = E.Admission(E.VERDICT_ADMITTED)
        ttfts = _items(_get(it, "time_to_first_tokens_iter"))
        out.append(E.StepEvent(
            step=self.step, t=t, dur=dur, budget=self.budget, batch=batch,
            running=run_ids, waiting=wait_ids, admission=admission,
            preemptions=[E.Preemption(ANON_ID, E.BLOCKED_KV, "recompute") for _ in range(min(preempted, MAX_SLOTS))],
            sampled=[DECODE_ID] * min(MAX_SLOTS, decode + len(ttfts)),
            first_tokens=[E.FirstToken(ANON_ID, _num(x, MAX_TIME)) for x in ttfts],
            finished=finished,
            itl=[E.ItlSample(DECODE_ID, _num(x, MAX_TIME)) for x in _items(_get(it, "inter_token_latencies_iter"))],
            kv=kv, dropped=dropped))
        return out

    def _reason(self, usage: float, preempted: int, running: int, tokens: int) -> str:
        """Why the head of WAITING waits, by which limit is reached (vLLM says only 'capacity')."""
        from kvscope.protocol import events as E

        if usage >= 0.9 or preempted:
            return E.BLOCKED_KV
        if self.max_seqs and running >= self.max_seqs:
            return E.BLOCKED_SEQS
        if self.budget and tokens >= 0.9 * self.budget:
            return E.BLOCKED_BUDGET
        return E.BLOCKED_KV


class KvscopeStatLogger(_Base):
    """vLLM's per-engine stat logger (StatLoggerBase): ``record`` once per step, never raising.

    ``record`` only queues the step's two stats objects (vLLM makes new ones every step); this
    logger's thread reads them into events and hands those to a ZmqPublisher (its own thread
    encodes and sends). A full queue drops the step and counts it."""

    def __init__(self, vllm_config=None, engine_index: int = 0) -> None:
        self.engine_index = engine_index if type(engine_index) is int else 0
        self.addr = os.environ.get(ENV_ADDR, "").strip() or None
        self.publisher = None
        self.maker: StepMaker | None = None
        self.errors = 0
        self.last_error: str | None = None
        self.recorded = 0  # steps turned into events
        self.dropped = 0  # steps dropped on a full queue (all time)
        self._unsent_drops = 0  # ... not yet reported in a step's `dropped`
        self._queue = None
        self._thread = None
        if self.addr is None:
            return  # disabled: no socket, no thread, record() returns at once
        try:
            self._start(vllm_config)
        except Exception as e:  # noqa: BLE001 - a bad address or a strange config must not stop vLLM from serving
            self._fail(e)
            self._stop_publisher()
            self._queue = None

    def _start(self, vllm_config) -> None:
        import queue
        import threading

        from kvscope.protocol.transport import ZmqPublisher

        if _watched(vllm_config):
            log.info("kvscope: the scheduler class publishes vLLM's steps on %s; the stat logger stands down", self.addr)
            self.addr = None
            return
        self.maker = StepMaker(engine_info(vllm_config), time.time())
        self.publisher = ZmqPublisher(self.addr, queue_size=QUEUE_SIZE, allow_remote=os.environ.get(ENV_REMOTE) == "1")
        q = queue.Queue(maxsize=QUEUE_SIZE)
        thread = threading.Thread(target=self._run, args=(q,), name="kvscope-vllm-plugin", daemon=True)
        thread.start()
        self._queue, self._thread = q, thread
        log.info("kvscope: publishing vLLM engine %d steps on %s", self.engine_index, self.publisher.addr)

    def _stop_publisher(self) -> None:
        pub, self.publisher = self.publisher, None
        if pub is not None:
            try:
                pub.close()
            except Exception as e:  # noqa: BLE001
                self._fail(e)

    def _fail(self, e: BaseException) -> None:
        self.errors += 1
        try:
            text = f"{type(e).__name__}: {e}"[:500]
        except Exception:  # noqa: BLE001 - an exception whose message itself raises
            text = type(e).__name__[:500]
        if self.last_error is None:
            log.warning("kvscope: stat logger skipped a step: %s", text)
        self.last_error = text

    def record(self, scheduler_stats=None, iteration_stats=None, mm_cache_stats=None, engine_idx: int = 0) -> None:
        q = self._queue
        if q is None:
            return
        try:
            q.put_nowait((scheduler_stats, iteration_stats))
        except Exception:  # noqa: BLE001 - queue.Full; nothing may reach vLLM's caller
            self.dropped += 1
            self._unsent_drops += 1

    def _run(self, q) -> None:
        while True:
            item = q.get()
            try:
                if item is None:
                    return
                self.publish_step(*item)
            finally:
                q.task_done()

    def publish_step(self, scheduler_stats, iteration_stats) -> None:
        """One step's stats into events on the socket (the logger's thread; tests call it directly)."""
        pub = self.publisher
        if pub is None or (scheduler_stats is None and iteration_stats is None):
            return
        try:
            drops, self._unsent_drops = self._unsent_drops, 0
            for ev in self.maker.events(scheduler_stats, iteration_stats, drops + pub.take_dropped()):
                pub.publish(ev)
            self.recorded += 1
        except Exception as e:  # noqa: BLE001 - vLLM changed a field: skip the step, count it
            self._fail(e)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the queued steps are handed to the publisher (tests); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue is not None and self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return self._queue is None or not self._queue.unfinished_tasks

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass

    def close(self) -> None:
        if self._queue is not None and self._thread is not None:
            try:
                self._queue.put(None, timeout=2.0)
            except Exception:  # noqa: BLE001
                pass
            self._thread.join(timeout=5.0)
        self._stop_publisher()
