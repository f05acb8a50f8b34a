"""kvscope's terminal UI (Textual). Textual is imported lazily, only when an app runs.

Entry points (used by ``kvscope.cli``)::

    run_live(events_addr, control_addr, palette="default")
    run_replay(path, palette="default", *, speed=1.0, start_step=None, paused=False)
    run_demo(palette="default", device="auto", *, events_addr=..., control_addr=..., model="tiny")
"""

from __future__ import annotations


def run_live(*args, **kwargs):
    from kvscope.tui.launch import run_live as f

    return f(*args, **kwargs)


def run_replay(*args, **kwargs):
    from kvscope.tui.launch import run_replay as f

    return f(*args, **kwargs)


def run_demo(*args, **kwargs):
    from kvscope.tui.launch.demo import run_demo as f

    return f(*args, **kwargs)


__all__ = ["run_live", "run_replay", "run_demo"]
