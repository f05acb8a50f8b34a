"""kvscope race and compare: bench's rows from a race, side-by-side screens on one clock.

The fixture races a small workload through the four modes on the sim backend (about a
second) and records each run; the screens are driven with a fake clock.
"""

from __future__ import annotations

import os

import pytest

from kvscope.engine.config import EngineConfig

SIM = dict(backend="sim", model="qwen3-0.6b", gpu="h200", max_num_seqs=16, max_num_batched_tokens=256, seed=0)
WALL_KEYS = ("sim_wall_s", "sim_steps_per_s", "trace")


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def raced(tmp_path_factory):
    from kvscope import workload as wl
    from kvscope.bench.race import plan, run_race
    from kvscope.bench.sim import sim_workload

    out = tmp_path_factory.mktemp("race")
    config = EngineConfig(**SIM)
    spec = wl.load_spec("mixed")
    items = sim_workload(config, spec, 48, None)
    runs = plan(config, ["naive", "static", "continuous", "chunked"], [])
    rows = run_race(runs, items, str(out), sim=True, progress=False, log=lambda *a, **k: None)
    return config, spec, rows


def _paths(raced):
    return [row["trace"] for row in raced[2]]


def test_race_rows_equal_bench_rows(raced):
    from kvscope.bench.sim import run_sim_bench

    config, spec, rows = raced
    bench = run_sim_bench(config, spec, num_requests=48, log=lambda *a, **k: None)
    assert [r["name"] for r in rows] == [r["name"] for r in bench["rows"]] == ["naive", "static", "continuous",
                                                                              "chunked"]
    for ours, theirs in zip(rows, bench["rows"]):
        strip = {k: v for k, v in ours.items() if k not in WALL_KEYS}
        assert strip == {k: v for k, v in theirs.items() if k not in WALL_KEYS}
    assert all(os.path.getsize(r["trace"]) > 0 for r in rows)


def test_trace_figures_equal_the_run_rows(raced):
    """What the summary strip shows (figures from the trace alone) is the run's bench row."""
    from kvscope.traces.figures import figures_of
    from kvscope.traces.reader import TraceReader

    for row in raced[2]:
        trace = TraceReader(row["trace"])
        fig = figures_of(trace, trace.hello.config.block_size)
        for key in ("output_tok_per_s", "ttft_mean_s", "ttft_p99_s", "itl_p99_s", "kv_waste", "duration_s"):
            assert fig[key] == pytest.approx(row[key], rel=1e-9), key
        assert fig["preemptions"] == row["preemptions"]
        assert fig["output_tokens"] == row["output_tokens"] > 0


def test_race_plan_refuses_more_than_four_runs():
    from kvscope.bench.race import RaceError, plan

    with pytest.raises(RaceError, match="at most 4"):
        plan(EngineConfig(**SIM), ["naive", "static", "continuous"], ["fcfs", "sjf"])
    with pytest.raises(RaceError, match="unknown mode"):
        plan(EngineConfig(**SIM), ["bogus"], [])
    names = [p.name for p in plan(EngineConfig(**SIM), ["chunked"], ["fcfs", "sjf"])]
    assert names == ["chunked-fcfs", "chunked-sjf"]


def _app(paths, clock, **kw):
    from kvscope.tui.launch.compare import make_compare_app

    return make_compare_app(paths, clock=clock, auto_tick=False, **kw)


def _visible(app):
    from kvscope.tui.widgets.run_column import RunColumn

    return [c.index for c in app.screen.query(RunColumn) if c.display]


@pytest.mark.parametrize("size,runs,visible", [((80, 24), 2, 2), ((80, 24), 4, 2), ((160, 45), 2, 2),
                                                ((160, 45), 4, 4)])
@pytest.mark.anyio
async def test_columns_fit_and_move_while_playing(raced, size, runs, visible):
    from kvscope.tui.widgets.run_column import RunHeader, RunNumbers

    clock = FakeClock()
    app = _app(_paths(raced)[:runs], clock)
    async with app.run_test(size=size) as pilot:
        assert _visible(app) == list(range(visible))
        steps0 = [st.step for st in app.states]
        for _ in range(4):
            clock.t += 0.5
            app.pump()
            await pilot.pause()
        assert all(st.step > s0 for st, s0 in zip(app.states, steps0)), "every column moves while playing"
        for i in _visible(app):
            header = app.screen.query_one(f"#run-header-{i}", RunHeader).render().plain
            assert [f.run for f in app.feeds][i].config["mode"] in header and "RUN" in header and "WAIT" in header
            numbers = app.screen.query_one(f"#run-numbers-{i}", RunNumbers).render().plain
            assert "TTFT" in numbers and "ITL" in numbers and "tok/s" in numbers and "done" in numbers
        strip = app.screen.query_one("#compare-summary").render().plain
        assert all(f"{r.label} {r.name}" in strip for r in [f.run for f in app.feeds])
        assert "★" in strip


@pytest.mark.anyio
async def test_paging_and_tab_reach_every_column_at_80x24(raced):
    clock = FakeClock()
    app = _app(_paths(raced), clock)
    async with app.run_test(size=(80, 24)) as pilot:
        seen = set()
        for _ in range(4):
            seen.update(_visible(app))
            assert app.screen.focused is not None and app.screen.focused.index in _visible(app)
            await pilot.press("tab")
        assert seen == {0, 1, 2, 3}
        await pilot.press("right_square_bracket")
        assert _visible(app) == [2, 3]


@pytest.mark.anyio
async def test_seek_keeps_every_column_at_the_same_moment(raced):
    clock = FakeClock()
    app = _app(_paths(raced), clock, playing=False)
    async with app.run_test(size=(160, 45)) as pilot:
        for target in (3.0, 1.0, 6.5):
            app.player.seek_time(target)
            app.pump()
            await pilot.pause()
            for run, st, track in zip([f.run for f in app.feeds], app.states, app.player.tracks):
                # Each column shows the last step that ended by the shared moment, no later one.
                shown = track.step_at(target)
                if shown is None:
                    continue
                assert st.step == shown
                end = st.last_batch.t + st.last_batch.dur - track.origin
                assert end <= target + 1e-9
                nxt = track.keys.index(end) + 1 if end in track.keys else None
                if nxt is not None and nxt < len(track.keys):
                    assert track.keys[nxt] > target


@pytest.mark.anyio
async def test_step_alignment_shows_the_same_step_number(raced):
    clock = FakeClock()
    app = _app(_paths(raced)[2:], clock, playing=False, align="step")
    async with app.run_test(size=(160, 45)) as pilot:
        app.player.seek(200)
        app.pump()
        await pilot.pause()
        assert [st.step for st in app.states] == [200, 200]


@pytest.mark.anyio
async def test_enter_opens_the_focused_runs_dashboard_at_the_same_moment(raced):
    from kvscope.tui.screens.compare import RunDashboard
    from kvscope.tui.widgets import BlockMap

    clock = FakeClock()
    app = _app(_paths(raced), clock, playing=False)
    async with app.run_test(size=(120, 36)) as pilot:
        app.player.seek_time(4.0)
        app.pump()
        await pilot.press("tab")
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, RunDashboard) and app.screen.index == 1
        app.redraw(force=True)
        await pilot.pause()
        assert app.screen.query_one(BlockMap).state is app.states[1]
        step = app.states[1].step
        await pilot.press("escape")
        assert not isinstance(app.screen, RunDashboard)
        assert app.states[1].step == step


@pytest.mark.anyio
async def test_damaged_trace_gets_a_column_that_says_so(raced, tmp_path):
    good = _paths(raced)[3]
    bad = tmp_path / "garbage.kvtrace"
    bad.write_bytes(b"this is not a trace at all" * 10)
    clock = FakeClock()
    app = _app([good, str(bad)], clock)
    async with app.run_test(size=(80, 24)) as pilot:
        header = app.screen.query_one("#run-header-1").render().plain
        assert "cannot read" in header
        clock.t += 1.0
        app.pump()
        await pilot.pause()
        assert app.states[0].step > 0, "the readable run still plays"


@pytest.mark.anyio
async def test_different_workloads_get_a_visible_notice(raced, tmp_path):
    from kvscope import workload as wl
    from kvscope.bench.race import plan, run_race
    from kvscope.bench.sim import sim_workload

    config = EngineConfig(**SIM)
    items = sim_workload(config, wl.load_spec("chat"), 12, None)
    other = run_race(plan(config, ["chunked"], []), items, str(tmp_path), sim=True, progress=False,
                     log=lambda *a, **k: None)[0]["trace"]
    app = _app([_paths(raced)[3], other], FakeClock())
    async with app.run_test(size=(80, 24)):
        notice = app.screen.query_one("#compare-notice")
        assert notice.display and "different workloads" in str(notice.render())


def test_cli_refuses_more_than_four_traces_in_one_line(raced, capsys):
    from kvscope.cli import main

    paths = _paths(raced)
    assert main(["compare", *paths, paths[0]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "2 to 4 traces" in err[0]
    assert main(["compare", paths[0]]) == 2


def test_race_no_tui_json_is_bench_shaped(tmp_path, capsys):
    import json

    from kvscope.cli import main

    out = tmp_path / "race.json"
    argv = ["race", "--backend", "sim", "--model", "qwen3-0.6b", "--gpu", "h200", "--workload", "chat",
            "--num-requests", "12", "--modes", "continuous,chunked", "--no-tui", "--no-progress",
            "--json", str(out), "--out", str(tmp_path / "traces")]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert [r["name"] for r in result["rows"]] == ["continuous", "chunked"]
    assert all(os.path.exists(p) for p in result["traces"])
    assert "chunked" in capsys.readouterr().out
    assert main(argv[:-4] + ["--json", str(tmp_path / "missing" / "x.json")]) == 2


@pytest.mark.anyio
async def test_d_opens_the_focused_runs_diagnosis(raced):
    from kvscope.tui.screens import DiagnosisScreen

    clock = FakeClock()
    app = _app(_paths(raced)[:2], clock, playing=False)
    async with app.run_test(size=(120, 36)) as pilot:
        app.player.seek_time(4.0)
        app.pump()
        await pilot.press("tab", "d")
        await pilot.pause()
        assert isinstance(app.screen, DiagnosisScreen) and app.screen.feed is app.feeds[1]
        assert "bottleneck:" in str(app.screen.query_one("#diagnosis-body").render())
        await pilot.press("escape")
        await pilot.press("enter", "d")  # and from that run's own dashboard
        await pilot.pause()
        assert isinstance(app.screen, DiagnosisScreen) and app.screen.feed is app.feeds[1]


@pytest.mark.anyio
async def test_compare_says_what_was_simulated_and_opens_at_the_start(raced):
    """The seconds between making the app and its first frame (a race computing, Textual starting) are not
    played past: the columns open at the runs' start, whatever the clock did meanwhile."""
    clock = FakeClock()
    app = _app(_paths(raced), clock)
    clock.t += 30.0  # longer than every run
    async with app.run_test(size=(160, 45)) as pilot:
        await pilot.pause()
        assert app.player.playing and app.player.status().t == app.player.status().start_t
        assert all(st.finished_count == 0 for st in app.states), "no run is drained at the first frame"
        setup = app.screen.query_one("#compare-setup").render().plain
        assert "simulated: qwen3-0.6b on h200 (tp 1" in setup and "KV pool" in setup
        clock.t += 0.5
        app.pump()
        assert app.player.status().t > app.player.status().start_t  # and then it plays


def test_race_keep_arrivals_serves_the_workloads_arrival_times(tmp_path):
    import json

    from kvscope.cli import main
    from kvscope.traces.reader import TraceReader

    def arrivals(extra):
        out = tmp_path / f"race{len(extra)}.json"
        argv = ["race", "--backend", "sim", "--model", "qwen3-0.6b", "--gpu", "h200", "--workload", "chat",
                "--num-requests", "12", "--modes", "chunked", "--no-tui", "--no-progress", "--json", str(out),
                "--out", str(tmp_path / f"traces{len(extra)}"), *extra]
        assert main(argv) == 0
        trace = json.loads(out.read_text())["traces"][0]
        return [e.arrival for e in TraceReader(trace) if e.type == "request"]

    at_once, spread = arrivals([]), arrivals(["--keep-arrivals"])
    assert len(at_once) == len(spread) == 12
    assert max(at_once) - min(at_once) == 0.0
    assert max(spread) - min(spread) > 0.5  # chat: Poisson at 8 requests/s
