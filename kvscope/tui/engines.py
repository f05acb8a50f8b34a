"""The engines an overview watches, each reduced to one row: kvscope engines and vLLM servers alike.

A feed owns one source and what it has learnt from it. ``pump`` takes what arrived
(cheap, called a few times a second); ``row`` returns the typed summary the overview
table draws. A kvscope feed folds its events with the dashboard's own reducer, so its
full dashboard is one Enter away; a vLLM feed reads its metrics view.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

SPARK_POINTS = 24
SPARK_EVERY_S = 1.0


@dataclass(slots=True)
class EngineRow:
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


class KvscopeFeed:
    kind = "kvscope"

    def __init__(self, name: str, source: Any) -> None:
        from kvscope.tui.state import new_state

        self.name = name
        self.source = source
        self.state = new_state(conn=getattr(source, "connection", "connecting"))
        self._spark: deque = deque(maxlen=SPARK_POINTS)
        self._spark_t: float | None = None

    def pump(self, now: float) -> int:
        from kvscope.tui.state import reduce, set_connection

        events = self.source.poll()
        st = self.state
        for ev in events:
            st = reduce(st, ev)
        self.state = st
        set_connection(st, getattr(self.source, "connection", st.conn))
        if self._spark_t is None or now - self._spark_t >= SPARK_EVERY_S:
            self._spark_t = now
            self._spark.append(st.rates()[1])
        return len(events)

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
            preemptions=st.preemption_count, spark=list(self._spark),
        )

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if close is not None:
            close()


class VllmFeed:
    kind = "vllm"

    def __init__(self, name: str, source: Any) -> None:
        self.name = name
        self.source = source
        self._spark: deque = deque(maxlen=SPARK_POINTS)
        self._spark_t: float | None = None
        self._row: EngineRow | None = None

    def pump(self, now: float) -> int:
        with self.source.lock:
            m = self.source.state.metrics
            last = m.last
            gen = m.rate("generation_tokens")
            ttft = m.percentiles("time_to_first_token_seconds")[2]
            itl = m.percentiles("inter_token_latency_seconds")[2]
            total_pre = last.counters.get("num_preemptions") if last else None
            running = m.gauge("num_requests_running")
            waiting = m.gauge("num_requests_waiting")
            kv = m.gauge("kv_cache_usage_perc", "gpu_cache_usage_perc")
            err = m.last_error
        if self._spark_t is None or now - self._spark_t >= SPARK_EVERY_S:
            self._spark_t = now
            self._spark.append(gen or 0.0)
        self._row = EngineRow(
            name=self.name, kind=self.kind, setup="vLLM", connection="disconnected" if err or not last else "live",
            running=None if running is None else int(running), waiting=None if waiting is None else int(waiting),
            kv_used=kv, tok_per_s=gen, ttft_p99_s=ttft, itl_p99_s=itl,
            preemptions=None if total_pre is None else int(total_pre), spark=list(self._spark),
        )
        return 0

    def row(self) -> EngineRow:
        if self._row is None:
            self.pump(0.0)
        return self._row

    def close(self) -> None:
        self.source.close()
