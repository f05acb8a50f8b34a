"""A vLLM: its /metrics and KV events, watched live (adapters.vllm_source.VllmSource) or played from
a `kvscope record --vllm` trace (adapters.vllm_replay.VllmTraceSource, a cursor the player moves).

The source's threads (live) or the player's seeks (recorded) fill a VllmState under a
lock; ``pump`` copies what the screen draws only when it moved.
"""

from __future__ import annotations

import math

import os
import time
from typing import TYPE_CHECKING, Union

from kvscope.tui.feeds.base import EngineControls, EngineRow, FeedHealth, Notice, Spark
from kvscope.tui.model.state import CONN_DISCONNECTED, CONN_LIVE, CONN_REPLAY

if TYPE_CHECKING:
    from kvscope.vllm.watch.replay import VllmTraceSource
    from kvscope.vllm.watch.source import ReplayPosition, VllmSource, VllmState
    from kvscope.analysis.diagnose import Diagnosis
    from kvscope.tui.model.player import PlayerStatus

TOP_EVERY_S = 1.0  # the top-prefix list is the one costly piece: once a second is plenty



def _finite(v):
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


class VllmFeed:
    kind = "vllm"

    def __init__(self, source: "Union[VllmSource, VllmTraceSource]", *, name: str = "") -> None:
        from kvscope.vllm.watch.replay import VllmTraceSource

        self.source = source
        self.recorded = isinstance(source, VllmTraceSource)
        self.name = name or (os.path.basename(source.path) if self.recorded else (source.url or source.state.kv_addr))
        self.address = "" if self.recorded else self.name
        self.view: "VllmState | None" = None  # the copy the screen draws
        self.top: list | None = None
        self._drawn = -1
        self._top_at = float("-inf")
        self.spark = Spark()
        self._row: EngineRow | None = None

    @property
    def controls(self) -> EngineControls | None:
        return None  # vLLM's scheduler is watched, not steered

    @property
    def version(self) -> tuple:
        return (self._drawn, self.top is not None and len(self.top))

    def pump(self, now: float) -> int:
        src = self.source
        with src.lock:
            st = src.state
            moved = st.version != self._drawn
            if moved:
                self._drawn = st.version
                self.view = st.copy()
            if now - self._top_at >= TOP_EVERY_S:
                self._top_at = now
                self.top = st.cache.top_prefixes()
        if moved or self._row is None:
            self._row = self._make_row(now)
        return 0

    def refresh_top(self) -> None:
        """Draw the prefix list on the next pump (a screenshot wants it now)."""
        self._top_at = float("-inf")

    def replay_position(self, status: "PlayerStatus") -> "ReplayPosition | None":
        """The header's replay label for a recorded vLLM, at the player's status."""
        if not self.recorded:
            return None
        from kvscope.vllm.watch.source import ReplayPosition

        src = self.source
        return ReplayPosition(os.path.basename(src.path), status.playing, status.done, status.speed, src.t,
                              src.summary.t_last or 0.0, src.step, src.last_step)

    def _make_row(self, now: float) -> EngineRow:
        m = self.view.metrics
        last = m.last
        gen = m.rate("generation_tokens")
        self.spark.add(now, _finite(gen) or 0.0)
        running = _finite(m.gauge("num_requests_running"))  # a server may send NaN or ±Inf: drawn as none
        waiting = _finite(m.gauge("num_requests_waiting"))
        total_pre = _finite(last.counters.get("num_preemptions")) if last else None
        return EngineRow(
            name=self.name, kind=self.kind, setup="vLLM", connection=self.health().connection,
            running=None if running is None else int(running), waiting=None if waiting is None else int(waiting),
            kv_used=_finite(m.gauge("kv_cache_usage_perc", "gpu_cache_usage_perc")), tok_per_s=_finite(gen),
            ttft_p99_s=_finite(m.percentiles("time_to_first_token_seconds")[2]),
            itl_p99_s=_finite(m.percentiles("inter_token_latency_seconds")[2]),
            preemptions=None if total_pre is None else int(total_pre), spark=list(self.spark.points),
            health=self.health(),
        )

    def health(self) -> FeedHealth:
        v = self.view
        if v is None:
            return FeedHealth(CONN_REPLAY if self.recorded else "connecting", 0, 0, False)
        if self.recorded:
            conn = CONN_REPLAY
        else:
            conn = CONN_DISCONNECTED if v.metrics.last_error or not v.metrics.last else CONN_LIVE
        return FeedHealth(conn, v.kv.missed, v.kv.malformed, v.kv.missed > 0)

    def take_notices(self) -> list[Notice]:
        return []

    def diagnose(self) -> "Diagnosis | None":
        """The same verdict `kvscope diagnose` gives a recorded vLLM, over the scrapes the view holds
        (no what-if here: that is the command's). None until two scrapes have arrived."""
        from kvscope.vllm.diagnose.run import diagnose_state
        from kvscope.analysis.diagnose import NoSteps

        if self.view is None:
            return None
        try:
            return diagnose_state(self.view, source=f"{'recorded' if self.recorded else 'live'} vLLM {self.name}")
        except NoSteps:
            return None

    def row(self) -> EngineRow:
        if self._row is None:
            self.pump(time.monotonic())
        return self._row

    def reset_stats(self) -> None:
        pass

    def close(self) -> None:
        self.source.close()
