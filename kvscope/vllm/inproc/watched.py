"""Inside a real `vllm serve`: vLLM's own scheduler, publishing kvscope's per-step events.

    KVSCOPE_VLLM_PUBLISH=tcp://127.0.0.1:5557 \\
        vllm serve MODEL --scheduler-cls kvscope.vllm.inproc.watched.WatchedScheduler
    kvscope tui --connect tcp://127.0.0.1:5557          # or: kvscope record FILE --connect ADDR --control ""

``WatchedScheduler`` and ``WatchedAsyncScheduler`` subclass vLLM's ``Scheduler`` and
``AsyncScheduler``: every decision is vLLM's (each method calls vLLM's first and returns its
result untouched). After ``schedule()`` and ``update_from_output()`` they copy what the step's
event needs (kvscope.vllm.inproc.capture) and queue it; the watch's own thread assembles the
events (kvscope.vllm.inproc.assemble: request ids, queues, physical block tables as net deltas,
the batch, prefix hits, preemptions, why the head of WAITING waits, finishes with their latencies,
with the meanings of kvscope.vllm.inproc.events) and hands them to a ZmqPublisher, which
encodes and sends on its own thread.

vLLM picks ``AsyncScheduler`` when async scheduling is on (its default) and ``Scheduler`` when
off; a ``--scheduler-cls`` replaces that choice, so ``WatchedScheduler`` makes it again: built
with async scheduling on, it is a ``WatchedAsyncScheduler``.

Without ``KVSCOPE_VLLM_PUBLISH`` nothing is built: no socket, no thread, and each override is one
attribute test around vLLM's method. With it, the watch never breaks vLLM: no exception leaves an
override (one is counted, logged once, and a snapshot read afresh follows the next step, from
which a watcher starts over); the queues are bounded, a full one drops and counts (the next step's
``dropped``), and a drop is followed by a fresh snapshot too. A new subscriber (the socket is an
XPUB that counts them) gets a snapshot after the next step, as does a `snapshot` asked on the control
socket (``KVSCOPE_VLLM_CONTROL``, kvscope.vllm.inproc.control); an idle vLLM, which calls no
scheduler method, sends heartbeats. Each data-parallel rank publishes on the base port + its rank, as
vLLM's KV events do. The same address binds only on
loopback unless ``KVSCOPE_VLLM_ALLOW_REMOTE=1``. The stat-logger plugin (kvscope.vllm.inproc.plugin)
stands down when the scheduler class is this one, so the two do not race for the address.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

ENV_ADDR = "KVSCOPE_VLLM_PUBLISH"  # the stat-logger plugin's variable (kvscope.vllm.inproc.plugin.ENV_ADDR)
ENV_REMOTE = "KVSCOPE_VLLM_ALLOW_REMOTE"
ENV_CONTROL = "KVSCOPE_VLLM_CONTROL"  # a control socket answering `snapshot` (kvscope.vllm.inproc.control)
HEARTBEAT_S = 0.5  # an idle vLLM calls no scheduler method: heartbeats keep its watchers live, as `kvscope serve`'s
BACKEND = "vllm-scheduler"  # hello.config.backend: a real vLLM's own scheduler (knobs in vLLM's flags)
QUEUE_SIZE = 8192  # captures (and events) waiting for the watch's and the publisher's threads; past this dropped, counted
SNAPSHOT_EVERY = 256  # steps between snapshots (+ hello): a late joiner (tui, record) starts from one
log = logging.getLogger("kvscope.vllm_watch")


def _async_on(args: tuple, kwargs: dict) -> bool:
    cfg = kwargs.get("vllm_config", args[0] if args else None)
    return bool(getattr(getattr(cfg, "scheduler_config", None), "async_scheduling", False))


class Watch:
    """Publishes the events of one vLLM scheduler. Every entry point swallows its errors.

    On vLLM's thread the hooks only capture (kvscope.vllm.inproc.capture: a few C-level passes over
    the step's requests and the blocks that moved) and queue the capture; the watch's own thread
    assembles the events (kvscope.vllm.inproc.assemble) and hands them to the publisher, whose
    thread encodes and sends. Captures queue in order; a full queue drops one, counts it, and the
    next step is followed by a snapshot read afresh from vLLM (a resync)."""

    def __init__(self, sched, publisher, wall_start: float | None = None, *, background: bool = True) -> None:
        from kvscope.vllm.inproc.assemble import Assembler
        from kvscope.vllm.inproc.capture import Capturer

        self.sched = sched
        self.publisher = publisher
        self.wall_start = time.time() if wall_start is None else wall_start
        self.capture = Capturer(sched)
        self.builder = Assembler(sched.block_size, sched.kv_cache_manager.block_pool.num_gpu_blocks, self.wall_start)
        self.steps = 0  # steps captured
        self.errors = 0
        self.last_error: str | None = None
        self.dropped = 0  # events the publisher dropped, and captures the queue dropped (all time)
        self._lost = 0  # captures dropped on a full queue (vLLM's thread writes it, the watch's thread reads it)
        self._lost_seen = 0
        self._starts: dict[int, float] = {}  # id(scheduler output) -> wall time schedule() returned it
        self._preempted: set[str] = set()  # preempted by a schedule() whose step is not published yet
        self._resync = False  # the next step is followed by a snapshot read afresh from vLLM
        self._joins = 0  # the publisher's count of subscriptions, as of the last snapshot
        self.control = None  # a WatchControl, when KVSCOPE_VLLM_CONTROL names an address
        self.hello = self._hello()
        self._queue: queue.SimpleQueue | None = None  # (C-level put: the cheapest hand-over on vLLM's thread)
        self._submitted = 0  # items queued (vLLM's thread writes it) ...
        self._done = 0  # ... and assembled (the watch's thread writes it)
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, name="kvscope-vllm-watch", daemon=True)
            self._thread.start()
        try:  # the stream starts with the hello and a snapshot, as a kvscope engine's does
            self._submit(("hello", None))
            self._snapshot(time.time(), full=True)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    # ---- what vLLM calls (through the scheduler's overrides), on vLLM's thread --------------------
    def added(self, request) -> None:
        try:
            self._submit(("request", request))
        except Exception as e:  # noqa: BLE001 - nothing may reach vLLM
            self._fail(e)

    def scheduled(self, out) -> None:
        try:
            self._starts[id(out)] = time.time()
            if out.preempted_req_ids:
                self._preempted.update(out.preempted_req_ids)
            self.capture.scheduled(out)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def updated(self, out) -> None:
        t_end = time.time()
        try:
            t_start = self._starts.pop(id(out), t_end)
            # with async scheduling the next schedule() ran before this update: the state the step describes
            # already holds its preemptions, so they are this step's (each is published once)
            preempted, self._preempted = self._preempted, set()
            cap = self.capture.step(out, preempted, t_start, t_end)
            self.steps += 1
            self._submit(("step", cap))
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        # a snapshot with step S is the state after step S (docs/PROTOCOL.md): it follows the step's event;
        # also after a watcher joined (`tui --connect`, `record --connect`), so it starts at once
        joins = getattr(self.publisher, "joins", 0)
        if self._resync or self.steps % SNAPSHOT_EVERY == 0 or joins != self._joins:
            self._joins = joins
            try:
                self._snapshot(t_end, full=self._resync)
                self._submit(("hello", None))
            except Exception as e:  # noqa: BLE001
                self._fail(e)

    def request_snapshot(self) -> None:
        """A watcher asked on the control socket (its own thread): the next step is followed by a snapshot read
        afresh. Only a flag: vLLM's state is read on vLLM's thread."""
        self._resync = True

    def close(self) -> None:
        try:
            if self.control is not None:
                self.control.close()
            self._submit(("bye", time.time()))
            self.flush()
            if self._queue is not None:
                self._queue.put(None)
                self._thread.join(timeout=5.0)
            self.publisher.close()
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every capture so far is assembled and handed to the publisher (tests, close)."""
        deadline = time.monotonic() + timeout
        while self._done < self._submitted and time.monotonic() < deadline:
            time.sleep(0.001)
        return self._done >= self._submitted

    # ---- inside ----------------------------------------------------------------------------
    def _snapshot(self, t: float, full: bool) -> None:
        self._resync = False
        self._submit(("snapshot", self.capture.snapshot(t, full)))

    def _submit(self, item) -> None:
        q = self._queue
        if q is None:
            self._assemble(item)
            return
        if self._submitted - self._done >= QUEUE_SIZE:  # the watch's thread is behind: drop, count, resync
            self._lost += 1
            self._resync = True  # the watch's view missed a step: a snapshot read afresh follows the next one
            return
        self._submitted += 1
        q.put(item)

    def _run(self) -> None:
        q = self._queue
        while True:
            item = q.get()
            if item is None:
                return
            try:
                self._assemble(item)
            except Exception as e:  # noqa: BLE001
                self._fail(e)
            finally:
                self._done += 1

    def _assemble(self, item) -> None:
        kind, cap = item
        b = self.builder
        if kind == "step":
            self._send(b.step(cap, self._take_dropped()))
        elif kind == "snapshot":
            self._send(b.snapshot(cap))
        elif kind == "request":
            self._send(b.request(cap))
        elif kind == "hello":
            self._send(self.hello)
        elif kind == "bye":
            from kvscope.protocol.events import ByeEvent

            self._send(ByeEvent(b.step_count, max(0.0, cap - self.wall_start), "stopped"))

    def _hello(self):
        from kvscope.vllm.inproc.events import VllmEventBuilder
        from kvscope.vllm.inproc.plugin import engine_info
        from kvscope.protocol.events import PROTOCOL_VERSION, HelloEvent
        from kvscope.protocol.events import engine_info as to_info

        info = engine_info(self.sched.vllm_config)
        info.update({k: v for k, v in VllmEventBuilder(self.sched).hello_config().items() if v is not None})
        info["backend"] = BACKEND
        return HelloEvent(PROTOCOL_VERSION, to_info(info), self.wall_start)

    def _send(self, ev) -> None:
        self.publisher.publish(ev)

    def _take_dropped(self) -> int:
        take = getattr(self.publisher, "take_dropped", None)
        n = int(take()) if take is not None else 0
        lost = self._lost - self._lost_seen
        self._lost_seen += lost
        if n:
            self._resync = True  # a watcher missed deltas: a snapshot follows the next step
        self.dropped += n + lost
        return n + lost

    def _fail(self, e: BaseException) -> None:
        self.errors += 1
        self._resync = True  # the view may be half-updated: the next step is followed by a fresh snapshot
        try:
            text = f"{type(e).__name__}: {e}"[:500]
        except Exception:  # noqa: BLE001
            text = type(e).__name__
        if self.last_error is None:
            log.warning("kvscope: a step was not published: %s", text)
        self.last_error = text


def start_watch(sched) -> Watch | None:
    """A Watch publishing on KVSCOPE_VLLM_PUBLISH, or None (unset, or the socket could not bind)."""
    addr = os.environ.get(ENV_ADDR, "").strip()
    if not addr:
        return None
    try:
        from kvscope.vllm.launch.ports import offset_port
        from kvscope.protocol.transport import ZmqPublisher

        # one stream per data-parallel rank, on the base port + the rank, as vLLM's KV events
        rank = _dp_rank(sched)
        remote = os.environ.get(ENV_REMOTE) == "1"
        addr = offset_port(addr, rank)
        pub = ZmqPublisher(addr, queue_size=QUEUE_SIZE, allow_remote=remote, notice_joins=True,
                           heartbeat_s=HEARTBEAT_S)
        try:
            watch = Watch(sched, pub)
        except Exception:
            pub.close(0)
            raise
        log.info("kvscope: publishing vLLM's scheduler steps on %s", pub.addr)
        control = os.environ.get(ENV_CONTROL, "").strip()
        if control:
            try:
                from kvscope.vllm.inproc.control import WatchControl

                watch.control = WatchControl(offset_port(control, rank), watch.request_snapshot, allow_remote=remote)
            except Exception as e:  # noqa: BLE001 - without it watchers wait for the next periodic snapshot
                log.warning("kvscope: no control socket on %s: %s: %s", control, type(e).__name__, e)
        return watch
    except Exception as e:  # noqa: BLE001 - a bad address must not stop vLLM from serving
        log.warning("kvscope: not publishing on %s: %s: %s", addr, type(e).__name__, e)
        return None


def _dp_rank(sched) -> int:
    """The scheduler's data-parallel rank, as vLLM numbers its KV-event publishers (data_parallel_index)."""
    parallel = getattr(getattr(sched, "vllm_config", None), "parallel_config", None)
    for name in ("data_parallel_index", "data_parallel_rank"):
        rank = getattr(parallel, name, None)
        if isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < 4096:
            return rank
    return 0


class WatchedScheduler(Scheduler):
    """vLLM's Scheduler, publishing kvscope's events (see the module). With async scheduling on, an instance
    is a WatchedAsyncScheduler, as vLLM itself would pick AsyncScheduler."""

    _kvscope: Watch | None = None

    def __new__(cls, *args, **kwargs):
        if cls is WatchedScheduler and _async_on(args, kwargs):
            cls = WatchedAsyncScheduler
        return super().__new__(cls)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._kvscope = start_watch(self)

    def add_request(self, request) -> None:
        super().add_request(request)
        w = self._kvscope
        if w is not None:
            w.added(request)

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        w = self._kvscope
        if w is not None:
            w.scheduled(out)
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        result = super().update_from_output(scheduler_output, model_runner_output)
        w = self._kvscope
        if w is not None:
            w.updated(scheduler_output)
        return result

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            w, self._kvscope = self._kvscope, None
            if w is not None:
                w.close()


class WatchedAsyncScheduler(WatchedScheduler, AsyncScheduler):
    """vLLM's AsyncScheduler (async scheduling, vLLM's default), publishing kvscope's events."""
