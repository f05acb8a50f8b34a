"""`kvscope tour`, driven headless with Textual's Pilot through every chapter: at each freeze the caption is
on screen and the chapter's phenomenon is in the dashboard's own state (the App's reduced state, not the
driver's). Once on the tiny model with a busy process beside the engine, once on the sim."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import time

import pytest
from _helpers import DEADLINE_S, async_wait_for

from kvscope.cli import main
from kvscope.protocol.events import BLOCKED_STATIC
from kvscope.tour import cues
from kvscope.tour.chapters import CHAPTERS, LONG_PROMPT
from kvscope.tour.driver import FROZEN, THE_END, TourOptions
from kvscope.tour.run import make_tour_app
from kvscope.tui.screens.tour import LOOK_CLASS
from kvscope.tui.widgets.caption import CaptionPanel

# The tour's length (meant to stay under 5 minutes) is measured and printed, not asserted: speed lives in
# benchmarks (python -m kvscope.tour.screenshots prints it), never in a timed test.

SCENES = [(c.number, s.key, b) for c in CHAPTERS for s in c.scenes for b in range(len(s.beats))]


def _long(st):
    return next(r for r in list(st.requests.values()) + list(st.finished.values()) if r.prompt_len == LONG_PROMPT)


def check_phenomenon(key: str, beat: int, app, findings: dict) -> None:
    """What each moment must show on the dashboard: read from the App's state, the one the widgets draw."""
    st = app.state
    if key == "1-blocks":
        assert len(st.tables[0]) > math.ceil(st.get(0).prompt_len / st.block_size)
        assert app.selected == 0  # the request the caption talks about is the one lit
    elif key == "2a-continuous":
        assert st.finished_count >= 1 and st.last_batch.prefill > 0 and len(st.running) >= 2
        assert st.config.mode == "continuous"
    elif key == "2b-static":
        assert st.admission.reason == BLOCKED_STATIC and st.waiting and st.config.mode == "static"
    elif key == "3a-chunked" and beat == 0:
        assert st.last_batch.prefill > 0 and st.last_batch.decode > 0 and _long(st).chunks_done >= 3
    elif key == "3a-chunked":
        long = _long(st)
        assert long.decoding and long.total_chunks >= LONG_PROMPT // st.config.max_num_batched_tokens
        assert max(s.prefill + s.decode for s in st.history) <= st.config.max_num_batched_tokens
    elif key == "3b-whole":
        long = _long(st)
        assert long.decoding and long.total_chunks == 1
        assert any(s.prefill >= LONG_PROMPT for s in st.history)  # the one big step every decoder waited for
    elif key == "4a-recompute":
        assert st.preemption_count > 0 and st.preempted
    elif key == "4b-swap":
        assert st.swap_out_count > 0 and st.swapped and st.kv.swap_used > 0
    elif key == "5-prefix":
        assert st.hit_count > 0 and st.kv.hit_tokens >= 128
    elif key == "6-parallel":
        assert 4 in st.blocks.refcount and st.kv.cow_copies >= 1  # blocks shared four ways; the last one copied
    elif key == "7a-reserved":
        assert st.kv.reserve_waste > 0 and cues.waste(st) > 0.5
    elif key == "7b-paged":
        assert st.kv.reserve_waste == 0 and cues.waste(st) < 0.1 < findings["7a-reserved"]["waste"]
    elif key == "8a-diagnose" and beat == 0:
        d = app.feeds[0].diagnose()  # the `d` panel's own verdict, from the dashboard's window
        assert d.bottleneck == findings[key]["bottleneck"] == "kv_capacity"
        assert findings[key]["knob"] in [k.flag for k in d.knobs]
    elif key == "8a-diagnose":
        assert st.finished_count == 16 and st.preemption_count > 0
    elif key == "8b-what-if":
        before = findings["8a-diagnose"]
        assert st.finished_count == 16 and st.preemption_count < before["preemptions"]
    else:
        raise AssertionError(f"no check for {key} beat {beat}")


async def walk(options: TourOptions, *, extra_keys: bool = False) -> float:
    """Press → as soon as each moment is on screen; check each. Returns the tour's seconds."""
    app, driver = make_tour_app(options)
    t0 = time.monotonic()
    async with app.run_test(size=(120, 40)) as pilot:
        seen = []
        for number, key, beat in SCENES:
            ok = await async_wait_for(lambda: driver.status.phase == FROZEN and driver.status.scene_key == key
                                      and app.screen.shown_serial == driver.status.serial
                                      and not driver._out.events, timeout=DEADLINE_S)
            assert ok, f"chapter {number} ({key}) never froze: {driver.status}, error {driver.error}"
            await pilot.pause()
            status = driver.status
            assert not status.missed, status.said
            text = app.screen.query_one(CaptionPanel).text
            assert f"Chapter {number}/{len(CHAPTERS)}" in text and status.said[:40] in text
            assert app.engine_paused  # the header says the world is frozen
            assert app.screen.query_one(f"#{status.look}").has_class(LOOK_CLASS)
            check_phenomenon(key, beat, app, driver.findings)
            seen.append((key, beat))
            if extra_keys and key == "2a-continuous":
                await _replay(pilot, app, driver)
            await pilot.press("right")
        assert await async_wait_for(lambda: driver.status.phase == THE_END)
        assert len(seen) == len(SCENES)
        elapsed = time.monotonic() - t0
        await pilot.press("q")
    return elapsed


async def _replay(pilot, app, driver) -> None:
    """← plays the chapter again from its first run, to the same moment."""
    serial = driver.status.serial
    await pilot.press("left")
    assert await async_wait_for(lambda: driver.status.serial > serial + 1 and driver.status.phase == FROZEN
                                and driver.status.scene_key == "2a-continuous" and not driver._out.events
                                and app.screen.shown_serial == driver.status.serial)
    await pilot.pause()
    check_phenomenon("2a-continuous", 0, app, driver.findings)


@pytest.fixture
def busy_process():
    """A process spinning beside the engine: the tour must not depend on how fast the engine runs."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield proc
    proc.kill()
    proc.wait()


def test_tour_on_the_cpu_with_a_busy_process_beside_it(busy_process):
    pytest.importorskip("torch")
    elapsed = asyncio.run(walk(TourOptions(model="tiny", device="cpu"), extra_keys=True))
    print(f"tour on the cpu beside a busy process: {elapsed:.1f} s")


def test_tour_on_the_sim_records_a_trace_per_scene(tmp_path):
    elapsed = asyncio.run(walk(TourOptions(sim_gpu="h100-sxm5", record_dir=str(tmp_path))))
    print(f"tour on the sim: {elapsed:.1f} s")
    keys = {s.key for c in CHAPTERS for s in c.scenes}
    assert {f[:-len(".kvtrace")] for f in os.listdir(tmp_path)} == keys
    from kvscope.analysis.diagnose import diagnose_trace

    d = diagnose_trace(str(tmp_path / "8a-diagnose.kvtrace"), what_if=False)
    assert d.bottleneck == "kv_capacity"  # the recorded chapter diagnoses as the live one did


def test_tour_refuses_bad_flags_in_one_line(capsys, tmp_path):
    assert main(["tour", "--chapter", "9"]) == 2
    assert "outside [1, 8]" in capsys.readouterr().err
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["tour", "--record", str(f)]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["tour", "--sim", "--gpu", "nope"]) == 2
