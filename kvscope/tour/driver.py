"""The tour's driver: one engine per scene, on a thread of its own, frozen at each cue.

The driver steps the engine itself (no child process, no sockets), so it can stop it exactly
at the step its cue holds: after every step it folds the step's events with the dashboard's own
reducer and asks the beat's cue. Arrivals are keyed to engine steps, so a frozen engine also
freezes the arrivals. The dashboard takes the events from ``poll()`` and reads ``status``; the
engine thread waits while more than MAX_BACKLOG events are unread, so the screen is never far
behind and memory stays bounded.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvscope.analysis.signals import StepLog
from kvscope.protocol.events import StepEvent
from kvscope.tour.script import Chapter, CueContext, Moment, Scene, prompts
from kvscope.tui.model.state import new_state, reduce

MAX_BACKLOG = 4096  # events the screen has not read yet before the engine thread waits for it
DIAGNOSIS_WINDOW = 2000
SIM_MODEL = "llama-3.3-70b-fp8"  # `--sim`: the lesson's model, as `kvscope demo --sim` serves it

# phases of TourStatus
LOADING, RUNNING, PAUSED, FROZEN, PLAYING_ON, OVER, THE_END, ERROR = (
    "loading", "running", "paused", "frozen", "playing on", "over", "the end", "error")


@dataclass(frozen=True, slots=True)
class TourOptions:
    model: str = "tiny"
    device: str = "auto"
    sim_gpu: str | None = None  # run the sim backend on this catalog GPU
    sim_pace: float | None = 1.0  # with sim_gpu: virtual time held to this x wall time (None: as fast as it goes)
    record_dir: str | None = None  # keep each scene's trace there (KEY.kvtrace)
    cpu_threads: int | None = None  # default: every core but one (the dashboard's)
    step_ms: float = 0.0  # hold each engine step to at least this long, so eyes can follow
    seed: int = 0

    def engine_base(self) -> dict[str, Any]:
        if self.sim_gpu is not None:
            return {"backend": "sim", "model": SIM_MODEL, "gpu": self.sim_gpu, "kv_cache_dtype": "fp8",
                    "sim_pace": self.sim_pace, "seed": self.seed}
        from kvscope.engine.config import usable_cores

        threads = self.cpu_threads or max(1, usable_cores() - 1)
        return {"model": self.model, "device": self.device, "cpu_threads": threads, "seed": self.seed}


@dataclass(frozen=True, slots=True)
class TourStatus:
    """What the caption panel shows; replaced whole by the engine thread, so reading it needs no lock."""

    chapter: int  # its number, 1-based
    chapters: int
    chapter_title: str
    scene: int  # 0-based within the chapter
    scenes: int
    scene_key: str
    title: str
    caption: str
    look: str
    phase: str
    said: str = ""  # the cue's line once it held (or why it did not)
    select: int | None = None
    missed: bool = False  # the scene ran out of work before its cue
    serial: int = 0


class HeldClock:
    """The engine's clock, stopped while the world is frozen: a pause must not count as a gap between a
    request's tokens. Wall time subtracts the time held; a paced virtual clock moves its wall origin."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self._held_at: float | None = None
        self._held_total = 0.0

    @property
    def virtual(self) -> bool:
        return self.inner.virtual

    @property
    def jumps(self) -> bool:
        return self.inner.jumps

    def now(self) -> float:
        return self.inner.now() if self.inner.virtual else self.inner.now() - self._held_total

    def advance(self, dt: float) -> None:
        self.inner.advance(dt)

    def sleep_until(self, t: float) -> None:
        self.inner.sleep_until(t if self.inner.virtual else t + self._held_total)

    def hold(self) -> None:
        if self._held_at is None:
            self._held_at = time.perf_counter()

    def release(self) -> None:
        if self._held_at is None:
            return
        held = time.perf_counter() - self._held_at
        self._held_at = None
        if not self.inner.virtual:
            self._held_total += held
        elif hasattr(self.inner, "_wall0"):  # a paced sim clock: it must not race to catch up
            self.inner._wall0 += held


class Watch:
    """The cue's view of a scene: the same reducer as the dashboard, the diagnosis window, the ITL max."""

    def __init__(self) -> None:
        self.state = new_state()
        self.log = StepLog(window=DIAGNOSIS_WINDOW)
        self.itl_max = 0.0

    def publish(self, ev) -> None:
        self.state = reduce(self.state, ev)
        self.log.add(ev)
        if type(ev) is StepEvent:
            for s in ev.itl:
                if s.gap > self.itl_max:
                    self.itl_max = s.gap

    def close(self) -> None:
        pass


class _Outbox:
    """Events for the screen, read by ``TourDriver.poll`` on the UI thread."""

    def __init__(self) -> None:
        self.events: collections.deque = collections.deque()

    def publish(self, ev) -> None:
        self.events.append(ev)

    def close(self) -> None:
        pass


class _Stop(Exception):
    """The tour was closed while the engine thread waited."""


class TourDriver:
    """Plays the chapters. UI side: ``poll``, ``status``, ``next``, ``replay``, ``toggle_pause``, ``close``."""

    connection = "live"

    def __init__(self, chapters: tuple[Chapter, ...], options: TourOptions = TourOptions(), *,
                 start_chapter: int = 1) -> None:
        if not 1 <= start_chapter <= len(chapters):
            raise ValueError(f"chapter must be 1..{len(chapters)}, got {start_chapter}")
        self.chapters = chapters
        self.options = options
        self.findings: dict[str, dict[str, Any]] = {}
        self.error: str | None = None
        self.moments: list[tuple[str, int, Moment | None]] = []  # (scene key, beat, moment): what each cue found
        self._start = start_chapter - 1
        self._out = _Outbox()
        self._cmds: queue.Queue[str] = queue.Queue()
        self._closing = threading.Event()
        self._serial = 0
        self._paused_from = RUNNING
        first = chapters[self._start]
        self.status = self._status(first, 0, first.scenes[0], 0, LOADING, said="starting the engine …")
        self._thread = threading.Thread(target=self._main, name="kvscope-tour", daemon=True)

    # ---- the screen's side ------------------------------------------------------------
    def start(self) -> None:
        if not self._thread.is_alive() and not self._closing.is_set():
            self._thread.start()

    def poll(self) -> list:
        out = []
        events = self._out.events
        while events:
            out.append(events.popleft())
        return out

    def next(self) -> None:
        self._cmds.put("next")

    def replay(self) -> None:
        self._cmds.put("replay")

    def toggle_pause(self) -> None:
        self._cmds.put("pause")

    def close(self) -> None:
        self._closing.set()
        self._cmds.put("quit")
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    # ---- the engine thread ------------------------------------------------------------
    def _status(self, chapter: Chapter, si: int, scene: Scene, beat: int, phase: str, *, said: str = "",
                moment: Moment | None = None, missed: bool = False) -> TourStatus:
        b = scene.beats[beat]
        return TourStatus(chapter.number, len(self.chapters), chapter.title, si, len(chapter.scenes), scene.key,
                          b.title, b.caption, b.look, phase, said=moment.said if moment else said,
                          select=moment.select if moment else None, missed=missed)

    def _set(self, status: TourStatus) -> None:
        """Every change gets a new serial: the screen redraws the caption when it moves."""
        self._serial += 1
        self.status = dataclasses.replace(status, serial=self._serial)

    def _main(self) -> None:
        ci, si = self._start, 0
        try:
            while True:
                if ci >= len(self.chapters):
                    cmd = self._the_end()
                    if cmd == "replay":
                        ci, si = len(self.chapters) - 1, 0
                        continue
                    return
                cmd = self._play(ci, si)
                if cmd == "quit":
                    return
                if cmd == "replay":
                    si = 0
                    continue
                si += 1
                if si >= len(self.chapters[ci].scenes):
                    ci, si = ci + 1, 0
        except _Stop:
            return
        except Exception as e:  # noqa: BLE001 - shown on the screen, one line
            from kvscope.errors import KvscopeError

            self.error = str(e).splitlines()[0] if isinstance(e, KvscopeError) and str(e) else f"{type(e).__name__}: {e}"
            st = self.status
            self._set(dataclasses.replace(st, phase=ERROR, said=self.error))

    def _the_end(self) -> str:
        last = self.chapters[-1]
        self._set(TourStatus(last.number, len(self.chapters), "The end", 0, 1, "", "That was the tour",
                             "Every chapter ran on the real engine; `kvscope tour --record DIR` keeps each one's "
                             "trace for `kvscope replay` and `kvscope report`. ← plays the last chapter again, "
                             "q quits.", "", THE_END))
        while True:
            cmd = self._cmds.get()
            if cmd in ("replay", "quit"):
                return cmd

    def _take(self, block: bool) -> str | None:
        if self._closing.is_set():
            raise _Stop
        try:
            return self._cmds.get(block=block, timeout=0.2 if block else None)
        except queue.Empty:
            return None

    def _engine(self, scene: Scene):
        from kvscope.engine.config import EngineConfig
        from kvscope.engine.llm_engine import LLMEngine

        config = EngineConfig(**{**self.options.engine_base(), **scene.settings_for(self.findings)})
        engine = LLMEngine(config)
        engine.clock = HeldClock(engine.clock)
        return engine

    def _sinks(self, engine, scene: Scene, watch: Watch):
        from kvscope.protocol.sinks import FanOut

        sinks: list = [self._out, watch]
        if self.options.record_dir:
            from kvscope.traces.writer import TraceWriter

            path = os.path.join(self.options.record_dir, f"{scene.key}.kvtrace")
            sinks.append(TraceWriter(path, engine.hello(), snapshot_provider=engine.snapshot))
        return FanOut(sinks)

    def _play(self, ci: int, si: int) -> str:
        """One scene, beat by beat. Returns what ended it: next, replay or quit."""
        from kvscope.engine.sampling_params import SamplingParams

        chapter = self.chapters[ci]
        scene = chapter.scenes[si]
        self._set(self._status(chapter, si, scene, 0, LOADING, said="starting the engine …"))
        engine = self._engine(scene)
        watch = Watch()
        sink = self._sinks(engine, scene, watch)
        engine.attach(sink)
        todo = collections.deque(prompts(scene.arrivals, self.options.seed))
        beat, phase = 0, RUNNING
        settings = scene.settings_for(self.findings)
        self.findings[scene.key] = {}
        self._set(self._status(chapter, si, scene, beat, phase))
        try:
            while True:
                cmd = self._take(block=phase not in (RUNNING, PLAYING_ON))
                if cmd in ("quit", "replay"):
                    return cmd
                if cmd == "next":
                    if phase in (FROZEN, OVER) and beat + 1 < len(scene.beats):
                        beat, phase = beat + 1, RUNNING
                        engine.clock.release()
                        self._set(self._status(chapter, si, scene, beat, phase))
                        continue
                    return "next"
                if cmd == "pause":
                    phase = self._toggle(engine, chapter, si, scene, beat, phase)
                    continue
                if phase not in (RUNNING, PLAYING_ON):
                    continue
                while todo and (todo[0][0] <= engine.scheduler.step_count or not engine.has_unfinished()):
                    _, ids, a = todo.popleft()
                    engine.add_request(ids, SamplingParams(max_tokens=a.max_tokens, n=a.n, ignore_eos=True,
                                                           temperature=scene.temperature, seed=self.options.seed,
                                                           detokenize=False))
                drained = not engine.has_unfinished()
                if not drained:
                    t0 = time.perf_counter()
                    engine.step()
                    self._wait_for_screen()
                    rest = self.options.step_ms / 1e3 - (time.perf_counter() - t0)
                    if rest > 0:  # the engine's clock stops meanwhile: pacing is no gap between tokens
                        engine.clock.hold()
                        time.sleep(rest)
                        engine.clock.release()
                if phase == PLAYING_ON:
                    if drained:
                        phase = OVER
                        engine.clock.hold()
                        st = self.status
                        self._set(dataclasses.replace(st, phase=OVER))
                    continue
                ctx = CueContext(watch.state, watch.log, self.findings, watch.itl_max, settings)
                moment = scene.beats[beat].cue(ctx)
                if moment is None and not drained:
                    continue
                engine.clock.hold()
                phase = FROZEN
                self.moments.append((scene.key, beat, moment))
                if moment is not None:
                    self.findings[scene.key].update(moment.figures)
                    self._set(self._status(chapter, si, scene, beat, FROZEN, moment=moment))
                else:
                    self._set(self._status(chapter, si, scene, beat, FROZEN, missed=True,
                                           said="every request finished before this moment came: the cue never "
                                                "held (→ goes on, ← plays the chapter again)"))
        finally:
            engine.close("tour")
            sink.close()

    def _toggle(self, engine, chapter: Chapter, si: int, scene: Scene, beat: int, phase: str) -> str:
        """space: pause a running scene, resume a paused one, or let a frozen one play on past its cue."""
        st = self.status
        if phase in (RUNNING, PLAYING_ON):
            engine.clock.hold()
            self._paused_from = phase
            new = PAUSED
        elif phase == PAUSED:
            engine.clock.release()
            new = self._paused_from
        elif phase == FROZEN:
            engine.clock.release()
            new = PLAYING_ON
        else:
            return phase
        self._set(dataclasses.replace(st, phase=new))
        return new

    def _wait_for_screen(self) -> None:
        while len(self._out.events) > MAX_BACKLOG:
            if self._closing.is_set():
                raise _Stop
            time.sleep(0.005)
