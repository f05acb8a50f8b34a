"""Inside a real `vllm serve`: vLLM's own scheduler, publishing kvscope's per-step events.

    KVSCOPE_VLLM_PUBLISH=tcp://127.0.0.1:5557 \\
        vllm serve MODEL --scheduler-cls kvscope.adapters.vllm_watch.WatchedScheduler
    kvscope tui --connect tcp://127.0.0.1:5557          # or: kvscope record FILE --connect ADDR --control ""

``WatchedScheduler`` and ``WatchedAsyncScheduler`` subclass vLLM's ``Scheduler`` and
``AsyncScheduler``: every decision is vLLM's (each method calls vLLM's first and returns its
result untouched). After ``schedule()`` and ``update_from_output()`` they turn vLLM's state into
kvscope's protocol events with the builder ``--scheduler vllm`` uses
(kvscope.adapters.vllm_events: request ids, queues, physical block tables as net deltas, the
batch, prefix hits, preemptions, why the head of WAITING waits, finishes with their latencies)
and hand them to a ZmqPublisher, which encodes and sends on its own thread.

vLLM picks ``AsyncScheduler`` when async scheduling is on (its default) and ``Scheduler`` when
off; a ``--scheduler-cls`` replaces that choice, so ``WatchedScheduler`` makes it again: built
with async scheduling on, it is a ``WatchedAsyncScheduler``.

Without ``KVSCOPE_VLLM_PUBLISH`` nothing is built: no socket, no thread, and each override is one
attribute test around vLLM's method. With it, the watch never breaks vLLM: no exception leaves an
override (one is counted, logged once, and the next step is a snapshot, from which a watcher
starts afresh); the publisher's queue is bounded, a full queue drops the event and counts it (the
next step's ``dropped``), and a drop is followed by a snapshot too. The same address binds only on
loopback unless ``KVSCOPE_VLLM_ALLOW_REMOTE=1``. The stat-logger plugin (kvscope.adapters.vllm_plugin)
stands down when the scheduler class is this one, so the two do not race for the address.
"""

from __future__ import annotations

import logging
import os
import time

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

ENV_ADDR = "KVSCOPE_VLLM_PUBLISH"  # the stat-logger plugin's variable (kvscope.adapters.vllm_plugin.ENV_ADDR)
ENV_REMOTE = "KVSCOPE_VLLM_ALLOW_REMOTE"
BACKEND = "vllm-scheduler"  # hello.config.backend: a real vLLM's own scheduler (knobs in vLLM's flags)
QUEUE_SIZE = 8192  # events waiting for the publisher's thread; past this they are dropped and counted
SNAPSHOT_EVERY = 256  # steps between snapshots (+ hello): a late joiner (tui, record) starts from one
log = logging.getLogger("kvscope.vllm_watch")


def _async_on(args: tuple, kwargs: dict) -> bool:
    cfg = kwargs.get("vllm_config", args[0] if args else None)
    return bool(getattr(getattr(cfg, "scheduler_config", None), "async_scheduling", False))


class Watch:
    """Builds and publishes the events of one vLLM scheduler. Every entry point swallows its errors."""

    def __init__(self, sched, publisher, wall_start: float | None = None) -> None:
        from kvscope.adapters.vllm_incremental import IncrementalBuilder

        self.sched = sched
        self.publisher = publisher
        self.wall_start = time.time() if wall_start is None else wall_start
        self.builder = IncrementalBuilder(sched)
        self.steps = 0  # events built
        self.errors = 0
        self.last_error: str | None = None
        self.dropped = 0  # events the publisher dropped (all time)
        self._starts: dict[int, float] = {}  # id(scheduler output) -> wall time schedule() returned it
        self._preempted: set[str] = set()  # preempted by a schedule() whose step is not published yet
        self._resync = False  # the next step is followed by a snapshot and the hello
        self.hello = self._hello()
        try:  # the stream starts with the hello and a snapshot, as a kvscope engine's does
            self._send(self.hello)
            self._snapshot(time.time())
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    # ---- what vLLM calls (through the scheduler's overrides) ---------------------------------
    def added(self, request) -> None:
        try:
            b = self.builder
            vid = request.request_id
            if vid not in b._announced:
                b._announced.add(vid)
                ev = b.request_event(request)
                ev.arrival = max(0.0, ev.arrival - self.wall_start)
                self._send(ev)
        except Exception as e:  # noqa: BLE001 - nothing may reach vLLM
            self._fail(e)

    def scheduled(self, out) -> None:
        try:
            self._starts[id(out)] = time.time()
            if out.preempted_req_ids:
                self._preempted.update(out.preempted_req_ids)
            self.builder.after_schedule(out)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def updated(self, out) -> None:
        t_end = time.time()
        try:
            t_start = self._starts.pop(id(out), t_end)
            dropped = self._take_dropped()
            if dropped:
                self._resync = True  # a watcher missed deltas: a snapshot follows this step
            # with async scheduling the next schedule() ran before this update: the state the step describes
            # already holds its preemptions, so they are this step's (each is published once)
            preempted, self._preempted = self._preempted, set()
            ev = self.builder.step(_Preempted(out, preempted), t_start, t_end, dropped)
            ev.t = max(0.0, ev.t - self.wall_start)
            self.steps += 1
            self._send(ev)
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        # a snapshot with step S is the state after step S (docs/PROTOCOL.md): it follows the step's event
        if self._resync or self.steps % SNAPSHOT_EVERY == 0:
            try:
                self._snapshot(t_end)
                self._send(self.hello)
            except Exception as e:  # noqa: BLE001
                self._fail(e)

    def close(self) -> None:
        try:
            from kvscope.protocol.events import ByeEvent

            self._send(ByeEvent(self.builder.step_count, max(0.0, time.time() - self.wall_start), "stopped"))
            self.publisher.close()
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    # ---- inside ----------------------------------------------------------------------------
    def _snapshot(self, t: float) -> None:
        self._resync = False
        snap = self.builder.snapshot(self.builder.step_count, max(0.0, t - self.wall_start))
        for r in snap.requests:
            r.arrival = max(0.0, r.arrival - self.wall_start)
        self._send(snap)

    def _hello(self):
        from kvscope.adapters.vllm_plugin import engine_info
        from kvscope.protocol.events import PROTOCOL_VERSION, HelloEvent
        from kvscope.protocol.events import engine_info as to_info

        info = engine_info(self.sched.vllm_config)
        info.update({k: v for k, v in self.builder.hello_config().items() if v is not None})
        info["backend"] = BACKEND
        return HelloEvent(PROTOCOL_VERSION, to_info(info), self.wall_start)

    def _send(self, ev) -> None:
        self.publisher.publish(ev)

    def _take_dropped(self) -> int:
        take = getattr(self.publisher, "take_dropped", None)
        n = int(take()) if take is not None else 0
        self.dropped += n
        return n

    def _fail(self, e: BaseException) -> None:
        self.errors += 1
        self._resync = True  # the builder's state may be half-updated: the next step starts from a snapshot
        if self.last_error is None:
            log.warning("kvscope: a step was not published: %s: %s", type(e).__name__, e)
        self.last_error = f"{type(e).__name__}: {e}"[:500]


class _Preempted:
    """A scheduler output whose preempted_req_ids are those of every schedule() since the last step."""

    __slots__ = ("_out", "preempted_req_ids")

    def __init__(self, out, preempted: set[str]) -> None:
        self._out = out
        self.preempted_req_ids = preempted

    def __getattr__(self, name: str):
        return getattr(self._out, name)


def start_watch(sched) -> Watch | None:
    """A Watch publishing on KVSCOPE_VLLM_PUBLISH, or None (unset, or the socket could not bind)."""
    addr = os.environ.get(ENV_ADDR, "").strip()
    if not addr:
        return None
    try:
        from kvscope.protocol.transport import ZmqPublisher

        pub = ZmqPublisher(addr, queue_size=QUEUE_SIZE, allow_remote=os.environ.get(ENV_REMOTE) == "1")
        try:
            watch = Watch(sched, pub)
        except Exception:
            pub.close(0)
            raise
        log.info("kvscope: publishing vLLM's scheduler steps on %s", pub.addr)
        return watch
    except Exception as e:  # noqa: BLE001 - a bad address must not stop vLLM from serving
        log.warning("kvscope: not publishing on %s: %s: %s", addr, type(e).__name__, e)
        return None


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
