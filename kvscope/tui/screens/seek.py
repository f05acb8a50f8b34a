"""A one-line prompt for replay seeks: a step number, or a time such as 12.5s."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label


def parse_target(text: str, kind: str = "step") -> tuple[str, float] | None:
    """'120' -> ('step', 120); '12.5s' or 't 12.5' -> ('time', 12.5); None if unreadable."""
    s = text.strip().lower()
    if not s:
        return None
    if s.startswith("t"):
        kind, s = "time", s[1:].strip()
    if s.endswith("ms"):
        kind, s, scale = "time", s[:-2], 1e-3
    elif s.endswith("s"):
        kind, s, scale = "time", s[:-1], 1.0
    else:
        scale = 1.0
    try:
        v = float(s)
    except ValueError:
        return None
    if kind == "step":
        return ("step", float(int(v)))
    return ("time", v * scale)


def seek_to(replay, target: tuple[str, float] | None) -> bool:
    """Apply a SeekScreen answer to anything with ``seek(step)`` and ``seek_time(t)``; False if none."""
    if not target or replay is None:
        return False
    what, value = target
    if what == "time":
        replay.seek_time(value)
    else:
        replay.seek(int(value))
    return True


class SeekScreen(ModalScreen[tuple[str, float] | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, kind: str = "step") -> None:
        super().__init__()
        self.kind = kind

    def compose(self) -> ComposeResult:
        with Vertical(id="seek-box"):
            if self.kind == "time":
                yield Label("Seek to trace time (seconds, e.g. 12.5):")
            else:
                yield Label("Seek to step (or a time such as 12.5s):")
            yield Input(placeholder="step" if self.kind == "step" else "seconds", id="seek-input")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(parse_target(event.value, self.kind))

    def action_cancel(self) -> None:
        self.dismiss(None)
