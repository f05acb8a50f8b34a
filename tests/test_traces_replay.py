"""ReplayClock: trace time vs wall time, speed, play/pause, due events (pure, no clock)."""

from __future__ import annotations

import pytest
from fakes.streams import make_events

from kvscope.protocol import ByeEvent, HelloEvent, RequestEvent, SnapshotEvent, StepEvent
from kvscope.traces.replay import MAX_SPEED, MIN_SPEED, ReplayClock, event_time


def _ev(t):
    return SnapshotEvent(0, t)


def test_event_time():
    assert event_time(StepEvent(1, 2.0, 0.5, 1)) == 2.5  # emitted when the step ends
    assert event_time(RequestEvent(1, 1, 1, 0, 3.0)) == 3.0
    assert event_time(ByeEvent(1, 4.0)) == 4.0
    assert event_time(HelloEvent(1, {}, 0.0)) is None


def test_plays_at_speed_and_pauses():
    c = ReplayClock([_ev(10.0), _ev(11.0), _ev(13.0)], now=100.0)
    assert not c.playing and c.position(100.0) == 10.0  # starts at the first event
    assert c.due(100.0) == [_ev(10.0)]
    assert c.due(500.0) == []  # paused: time does not move
    c.play(500.0)
    assert c.next_due_in(500.0) == pytest.approx(1.0)
    assert c.due(500.5) == []
    assert c.due(501.0) == [_ev(11.0)]
    c.set_speed(2.0, 501.0)
    assert c.next_due_in(501.0) == pytest.approx(1.0)  # 2 s of trace at 2x
    c.pause(501.5)
    assert c.position(600.0) == pytest.approx(12.0)
    assert c.next_due_in(600.0) is None
    c.play(600.0)
    assert c.due(600.5) == [_ev(13.0)]
    assert c.done and c.next_due_in(601.0) is None


def test_speed_is_clamped():
    c = ReplayClock([], now=0.0)
    assert c.set_speed(1000, 0.0) == MAX_SPEED
    assert c.set_speed(0, 0.0) == MIN_SPEED
    assert ReplayClock([], speed=-3).speed == MIN_SPEED


def test_limit_out_of_order_times_and_untimed_events():
    hello = HelloEvent(1, {}, 0.0)
    evs = [hello, _ev(5.0), RequestEvent(1, 1, 1, 0, 4.0), _ev(6.0)]
    c = ReplayClock(evs, now=0.0, playing=True)
    assert c.position(0.0) == 5.0
    assert c.due(0.0, limit=1) == [hello]
    assert c.due(0.0) == [evs[1], evs[2]]  # the late-stamped arrival is due at once
    assert c.due(1.0) == [evs[3]]


def test_single_step_and_jump():
    c = ReplayClock([_ev(1.0), _ev(5.0), _ev(9.0)], now=0.0)
    assert c.step(0.0) == _ev(1.0)
    assert c.step(0.0) == _ev(5.0) and c.position(0.0) == 5.0
    c.jump(100.0, 0.0)
    assert c.due(0.0) == [_ev(9.0)]
    assert c.step(0.0) is None


def test_load_after_seek_replays_a_whole_trace_in_order():
    hello, events, truth = make_events(60, seed=2)
    c = ReplayClock(now=0.0)
    c.load(events[10:], now=0.0)
    c.play(0.0)
    got, now = [], 0.0
    while not c.done:
        wait = c.next_due_in(now)
        now += wait if wait else 0.0
        got += c.due(now)
    assert got == events[10:]
    assert c.toggle(now) is False
