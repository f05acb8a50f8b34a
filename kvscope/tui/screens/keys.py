"""The player's keys, the same on every screen that replays (a kvscope trace, a compare, a recorded vLLM):

    space  play / pause          ← / →  one step (a recorder tick for vLLM) back / on
    shift+← / shift+→  a tenth of the run back / on
    shift+Home / shift+End  start / end (Home / End too, where no request list has the cursor)
    g / t  seek to a step / a time    p  next preemption    + / -  speed ×0.1 … ×100
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from textual.binding import Binding

from kvscope.tui.model.player import BIG_JUMP
from kvscope.tui.screens.base import Command, FeedView
from kvscope.tui.screens.seek import SeekScreen, seek_to

if TYPE_CHECKING:
    from kvscope.tui.model.player import Player

REPLAY_KEYS = [
    Binding("space", "player('toggle')", "Play"),
    Binding("right", "player('step_forward')", "Step"),
    Binding("left", "player('step_back')", "Back", show=False),
    Binding("g", "seek_prompt('step')", "Seek"),
    Binding("t", "seek_prompt('time')", "Time", show=False),
    Binding("plus,equals_sign", "player('faster')", "Speed±"),
    Binding("minus", "player('slower')", "Slow", show=False),
    Binding("shift+right", f"jump({BIG_JUMP})", "Jump on", show=False),
    Binding("shift+left", f"jump(-{BIG_JUMP})", "Jump back", show=False),
    Binding("shift+home,home", "player('to_start')", "Start", show=False),
    Binding("shift+end,end", "player('to_end')", "End", show=False),
]
PREEMPT_KEY = Binding("p", "player('next_preemption')", "Preempt")


class PlayerKeys(FeedView):
    """The actions behind REPLAY_KEYS, for a screen holding ``self.player``."""

    player: "Player"

    def action_player(self, name: str) -> None:
        p = self.player
        moves = {"toggle": p.toggle, "step_forward": p.step_forward, "step_back": p.step_back,
                 "faster": p.faster, "slower": p.slower, "to_start": p.to_start, "to_end": p.to_end}
        if name == "next_preemption":
            step = p.next_preemption()
            if step is None:
                self.kvscope.notify("no preemption after this step", timeout=2)
            else:
                self.kvscope.pump()
                self.show_preemption(step)
                return
        elif name in moves:
            moves[name]()
        self.kvscope.pump()

    def show_preemption(self, step: int) -> None:
        """After `p` landed on ``step``: say so (the dashboard also puts the cursor on the victim)."""
        self.kvscope.toast(f"step {step}: preemption", timeout=3, key="preemption")

    def action_jump(self, fraction: float) -> None:
        self.player.jump(fraction)
        self.kvscope.pump()

    def action_seek_prompt(self, kind: str) -> None:
        def done(target) -> None:
            if seek_to(self.player, target):
                self.kvscope.pump()

        self.kvscope.push_screen(SeekScreen(kind), done)

    def player_commands(self, preemption: bool = True) -> Iterable[Command]:
        yield ("Play / pause", "Replay", lambda: self.action_player("toggle"))
        yield ("Seek to step…", "Jump to a step", lambda: self.action_seek_prompt("step"))
        yield ("Seek to time…", "Jump to a trace time", lambda: self.action_seek_prompt("time"))
        if preemption:
            yield ("Next preemption", "Jump to the next step with a preemption",
                   lambda: self.action_player("next_preemption"))
        yield ("Faster", "Replay speed up", lambda: self.action_player("faster"))
        yield ("Slower", "Replay speed down", lambda: self.action_player("slower"))
