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


def test_while_the_loop_checks_the_flag_a_first_signal_only_sets_it_and_a_second_raises():
    with StopSignals() as signals:
        signals.checked = True
        signal.raise_signal(signal.SIGTERM)  # nothing raised: no interrupt inside a half-done write
        assert signals.requested
        with pytest.raises(KeyboardInterrupt):  # a loop stuck in one step still stops
            signal.raise_signal(signal.SIGINT)


def test_serve_forever_ends_at_its_next_step_on_a_sigterm_and_closes_its_trace(monkeypatch, tmp_path):
    """SIGTERM in the middle of a step: the step finishes (nothing is cut off), serve stops before the
    next one, closes its trace with reason `interrupted` and exits 0."""
    from kvscope.cli.main import main
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.traces.reader import TraceReader

    real_step = LLMEngine.step
    steps = {"n": 0, "after": 0}

    def step(self):
        steps["n"] += 1
        if steps["n"] == 20:
            signal.raise_signal(signal.SIGTERM)
        elif steps["n"] > 20:
            steps["after"] += 1
            if steps["after"] > 200:
                raise AssertionError("serve --forever did not stop after SIGTERM")
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    trace = tmp_path / "run.kvtrace"
    assert main(["serve", "--device", "cpu", "--dtype", "float32", "--forever", "--record", str(trace)]) == 0
    assert steps["after"] == 0  # the step the signal landed in ran to its end, and no other began
    assert [e.type for e in TraceReader(trace)][-1] == "bye"
    assert [e.reason for e in TraceReader(trace) if e.type == "bye"] == ["interrupted"]
