"""What a tour chapter is made of: scenes, each with engine settings, scripted arrivals and a cue."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

# where a caption points: the dashboard widget ids (kvscope.tui.screens.dashboard)
LOOKS = ("running", "waiting", "preempted", "blockmap", "batch", "latency")
TOKEN_LO = 3  # token ids of scripted prompts: away from the ids special tokens use at either end
TOKEN_SPAN = 240  # inside the tiny model's byte vocabulary, and every real model's


@dataclass(frozen=True, slots=True)
class Arrival:
    """``count`` requests submitted just before engine step ``at_step`` (0: before the first step).

    Arrivals are keyed to engine steps, not seconds: the same script admits the same requests at
    the same point of the schedule on any machine."""

    at_step: int = 0
    prompt_len: int = 32
    max_tokens: int = 16
    count: int = 1
    n: int = 1  # parallel samples of one prompt (they share its blocks, copy-on-write)
    prefix_len: int = 0  # leading tokens every arrival with a prefix shares (a "system prompt")


@dataclass(frozen=True, slots=True)
class Moment:
    """What a cue found: the line the caption says at the freeze, the request to light up, and
    figures later scenes compare against."""

    said: str
    select: int | None = None
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CueContext:
    """What a cue may read: the reduced state the dashboard shows, the diagnosis window, the figures
    earlier scenes found, and the driver's own tallies."""

    state: Any  # kvscope.tui.model.state.TuiState, folded from this scene's events
    log: Any  # kvscope.analysis.signals.StepLog of this scene
    findings: dict[str, dict[str, Any]]  # scene key -> Moment.figures
    itl_max: float  # the largest gap between two tokens of one request seen in this scene (s)
    settings: dict[str, Any]  # the scene's engine settings, as run


Cue = Callable[[CueContext], "Moment | None"]


@dataclass(frozen=True, slots=True)
class Beat:
    """A later moment of the same run: after the first cue's freeze, → lets the engine go on to this one."""

    title: str
    caption: str
    look: str
    cue: Cue


@dataclass(frozen=True, slots=True)
class Scene:
    key: str  # names its trace: DIR/KEY.kvtrace with --record
    title: str
    caption: str  # two or three short sentences: what is about to happen and where to look
    look: str  # the widget outlined (one of LOOKS)
    settings: dict[str, Any] | Callable[[dict], dict[str, Any]]  # EngineConfig fields (or from findings)
    arrivals: tuple[Arrival, ...]
    cue: Cue
    temperature: float = 0.0
    then: tuple[Beat, ...] = ()

    @property
    def beats(self) -> tuple[Beat, ...]:
        return (Beat(self.title, self.caption, self.look, self.cue), *self.then)

    def settings_for(self, findings: dict) -> dict[str, Any]:
        return dict(self.settings(findings) if callable(self.settings) else self.settings)


@dataclass(frozen=True, slots=True)
class Chapter:
    number: int
    title: str
    scenes: tuple[Scene, ...]


def prompts(arrivals: tuple[Arrival, ...], seed: int = 0) -> list[tuple[int, list[int], Arrival]]:
    """(step, token ids, arrival) for every request, in submission order: deterministic, with one shared
    prefix for every arrival that asks for one and unique tokens after it."""
    rng = random.Random(seed)
    longest = max((a.prefix_len for a in arrivals), default=0)
    prefix = [TOKEN_LO + rng.randrange(TOKEN_SPAN) for _ in range(longest)]
    out = []
    for a in sorted(arrivals, key=lambda a: a.at_step):
        for _ in range(a.count):
            own = [TOKEN_LO + rng.randrange(TOKEN_SPAN) for _ in range(a.prompt_len - a.prefix_len)]
            out.append((a.at_step, prefix[:a.prefix_len] + own, a))
    return out
