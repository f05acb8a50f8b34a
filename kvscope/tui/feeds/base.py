"""The Feed protocol, and the one fold loop every kvscope event feed shares.

``EventFeed.pump`` drains its source and folds the events with the state reducer (and
into the diagnosis window), so a live engine, a trace and each column of a compare are
reduced by the same loop, and a replay to step N shows what live showed at step N.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvscope.tui.model.state import new_state, reduce, reset_stats, set_connection

if TYPE_CHECKING:
    from kvscope.analysis.diagnose import Diagnosis

DIAGNOSIS_WINDOW = 2000  # steps the diagnosis panel judges
SPARK_POINTS = 24
SPARK_EVERY_S = 1.0


class DiagnosisUnavailable(Exception):
    """This feed has no diagnosis (one line for the user)."""


@dataclass(frozen=True, slots=True)
class FeedHealth:
    """How well the stream is arriving: what the header and the overview show."""

    connection: str  # live, replay, connecting, disconnected
    dropped: int  # events lost (by the engine's publisher or this view's bounded queues)
    malformed: int  # frames the decoder refused
    stale: bool  # steps were missed: the picture may be off until the next snapshot


@dataclass(frozen=True, slots=True)
class Notice:
    """A message the App shows as a toast once."""

    text: str
    severity: str = "information"  # information, warning, error
    timeout: float = 3.0
    key: str = ""  # a later notice with the same key replaces this one's toast (control replies: no pile)


@dataclass(slots=True)
class EngineRow:
    """One engine in the overview table."""

    name: str
    kind: str  # "kvscope" or "vllm"
    setup: str  # mode · policy (kvscope) or the model served (vllm)
    connection: str
    running: int | None
    waiting: int | None
    kv_used: float | None  # 0..1
    tok_per_s: float | None
    ttft_p99_s: float | None
    itl_p99_s: float | None
    preemptions: int | None
    spark: list[float] = field(default_factory=list)
    health: FeedHealth | None = None
    goodput_tok_per_s: float | None = None  # with an SLO: the run's goodput (docs/GOODPUT.md)


class EngineControls(Protocol):
    """A live engine's control channel (LiveFeed has one; replays and vLLM do not)."""

    @property
    def paused(self) -> bool: ...

    def request(self, cmd: str) -> None: ...

    def request_snapshot(self) -> bool: ...


class Feed(Protocol):
    name: str
    kind: str  # "kvscope" or "vllm"
    address: str  # what it watches, for the header ("" when it is a file)

    @property
    def controls(self) -> EngineControls | None: ...

    @property
    def version(self) -> tuple: ...  # changes whenever there is something new to draw

    def pump(self, now: float) -> int: ...  # take what arrived; returns events applied

    def health(self) -> FeedHealth: ...

    def take_notices(self) -> list[Notice]: ...

    def diagnose(self) -> "Diagnosis | None": ...  # None: no steps yet; raises DiagnosisUnavailable

    def row(self) -> EngineRow: ...

    def reset_stats(self) -> None: ...

    def close(self) -> None: ...


class Spark:
    """The overview's trend column: one tok/s point a second."""

    def __init__(self) -> None:
        self.points: deque = deque(maxlen=SPARK_POINTS)
        self._t: float | None = None

    def add(self, now: float, value: float) -> None:
        if self._t is None or now - self._t >= SPARK_EVERY_S:
            self._t = now
            self.points.append(value)


class EventFeed:
    """kvscope events from any source with ``poll() -> list[Event]`` and ``connection``."""

    kind = "kvscope"
    loading: str | None = None  # a progress line while an engine this view started loads (LiveFeed)

    def __init__(self, source: Any, *, name: str = "", address: str = "",
                 diagnosis_window: int = DIAGNOSIS_WINDOW, slo: Any = None) -> None:
        from kvscope.analysis.signals import StepLog

        self.source = source
        self.name = name
        self.address = address
        self.state = new_state(conn=self._connection(), slo_override=slo)  # slo: --slo, else the run's own
        self.log = StepLog(window=diagnosis_window)  # the `d` panel's sliding window of steps
        self.events_applied = 0
        self.spark = Spark()
        self._notices: list[Notice] = []
        self._notice_shown = ""

    @property
    def controls(self) -> EngineControls | None:
        return None

    @property
    def version(self) -> tuple:
        return (id(self.state), self.state.version, self.paused)

    @property
    def paused(self) -> bool:
        return False


    def _connection(self) -> str:
        return self.source.connection

    def _poll(self) -> list:
        return self.source.poll()

    # -- the one fold loop -------------------------------------------------------------
    def pump(self, now: float) -> int:
        events = self._poll()
        st = self.state
        log = self.log
        for ev in events:
            st = reduce(st, ev)
            log.add(ev)
        self.state = st
        self.events_applied += len(events)
        self._after_fold(st)
        if st.notice and st.notice != self._notice_shown:
            self._notice_shown = st.notice
            self._notices.append(Notice(st.notice, "warning", 10))
        set_connection(st, self._connection())
        self.spark.add(now, st.rates()[1])
        return len(events)

    def _after_fold(self, st) -> None:
        """What a source knows beside its events (drops, replies); live feeds fill it in."""

    def take_notices(self) -> list[Notice]:
        out, self._notices = self._notices, []
        return out

    def health(self) -> FeedHealth:
        st = self.state
        return FeedHealth(st.conn, st.dropped + st.local_dropped, st.malformed, st.stale)

    def diagnose(self) -> "Diagnosis | None":
        from kvscope.analysis.diagnose import NoSteps, judge

        try:
            return judge(self.log, source="live")
        except NoSteps:
            return None

    def reset_stats(self) -> None:
        reset_stats(self.state)

    def row(self) -> EngineRow:
        st = self.state
        kv = st.kv
        cfg = st.config
        return EngineRow(
            name=self.name, kind=self.kind,
            setup=f"{cfg.mode or '?'} · {cfg.policy or '?'}" if cfg is not None else "-",
            connection=st.conn, running=len(st.running), waiting=len(st.waiting),
            kv_used=kv.used / kv.total if kv.total else None, tok_per_s=st.rates()[1],
            ttft_p99_s=st.ttft.quantile(0.99) if st.ttft.n else None,
            itl_p99_s=st.itl.quantile(0.99) if st.itl.n else None,
            preemptions=st.preemption_count, spark=list(self.spark.points), health=self.health(),
            goodput_tok_per_s=st.goodput.figures().goodput_tok_per_s if st.goodput.slo else None,
        )

    def close(self) -> None:
        self.source.close()
