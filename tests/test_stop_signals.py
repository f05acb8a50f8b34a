"""Ctrl-C stops `serve --forever` and `record` even when Python swallows the KeyboardInterrupt.

A Ctrl-C that lands while a `__del__` runs raises there, and Python only prints it ("Exception ignored in ...",
with a traceback) and goes on. That happened under load in the docs' `serve --forever` block: the server
served on until killed. The handler now also sets a flag the loop checks every step.
"""

from __future__ import annotations

import signal
import sys

import pytest

from kvscope.cli.stop_signals import StopSignals


class _CollectedDuringCtrlC:
    """An object whose finalizer is running when the Ctrl-C arrives."""

    def __del__(self) -> None:
        signal.raise_signal(signal.SIGINT)


def test_a_ctrl_c_swallowed_in_a_finalizer_still_reads_as_a_stop_and_prints_nothing(monkeypatch):
    printed = []
    monkeypatch.setattr(sys, "unraisablehook", printed.append)
    with StopSignals() as signals:
        _CollectedDuringCtrlC()  # finalized at once: the KeyboardInterrupt is raised inside __del__
        assert signals.requested
    assert printed == []  # a stop, not an error: no "Exception ignored" traceback
    assert sys.unraisablehook == printed.append  # restored on exit


def test_other_unraisable_errors_are_still_reported(monkeypatch):
    class Broken:
        def __del__(self):
            raise ValueError("a real bug in a finalizer")

    printed = []
    monkeypatch.setattr(sys, "unraisablehook", printed.append)
    with StopSignals():
        Broken()
    assert len(printed) == 1 and isinstance(printed[0].exc_value, ValueError)


def test_sigterm_stops_too_and_the_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as signals:
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
        assert signals.requested
    assert signal.getsignal(signal.SIGTERM) == before


def test_serve_forever_ends_on_a_ctrl_c_python_swallowed(monkeypatch, tmp_path):
    """The whole command, in this process: the interrupt lands in a finalizer during a step, and serve
    still stops at the next step, closes its trace with reason `interrupted` and exits 0."""
    from kvscope.cli.main import main
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.traces.reader import TraceReader

    real_step = LLMEngine.step
    steps = {"n": 0, "after_ctrl_c": 0}

    def step(self):
        steps["n"] += 1
        if steps["n"] == 20:
            _CollectedDuringCtrlC()
        elif steps["n"] > 20:
            steps["after_ctrl_c"] += 1
            if steps["after_ctrl_c"] > 200:  # the old code served on forever: fail instead of hanging
                raise AssertionError("serve --forever did not stop after a swallowed Ctrl-C")
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    trace = tmp_path / "run.kvtrace"
    assert main(["serve", "--device", "cpu", "--dtype", "float32", "--forever", "--record", str(trace)]) == 0
    assert steps["after_ctrl_c"] <= 1  # stopped before the next step, or just after it
    bye = [e for e in TraceReader(trace) if e.type == "bye"]
    assert [b.reason for b in bye] == ["interrupted"]
