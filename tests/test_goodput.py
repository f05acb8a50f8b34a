"""Goodput and cost per token (docs/GOODPUT.md): vLLM's SLO definitions, one judge for every view.

A small sim race (four modes, 40 requests, about a second) is recorded with an SLO; its
traces are then replayed through the dashboard's state, the report's row tally and
/metrics with two SLO settings, and every view must agree to the request.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from kvscope.goodput import (
    NO_SLO,
    GoodputTally,
    RequestRecord,
    SloError,
    judge,
    parse_slo,
    usd_per_mtok,
)
from kvscope.engine.config import EngineConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM = dict(backend="sim", model="qwen3-0.6b", gpu="l4", max_num_seqs=16, max_num_batched_tokens=256, seed=0)
RECORDED = "ttft:400 tpot:30"


# ---- the definitions ---------------------------------------------------------------------------
def test_parse_slo_takes_vllms_keys_in_any_form():
    assert parse_slo(["ttft:500", "tpot:50"]).describe() == "ttft:500 tpot:50"
    assert parse_slo("e2el:2000,ttft:1.5").describe() == "ttft:1.5 e2el:2000"
    assert parse_slo(None) == NO_SLO and not NO_SLO
    assert parse_slo(["tpot:50"]).to_wire() == {"slo_tpot_ms": 50.0}


@pytest.mark.parametrize("bad, says", [
    ("ttft", "expected KEY:MILLISECONDS"), ("itl:5", "unknown key"), ("ttft:-1", "milliseconds in"),
    ("ttft:nan", "milliseconds in"), ("ttft:1e12", "milliseconds in"), ("ttft:x", "not a number"), ("ttft:1 ttft:2", "given twice"),
])
def test_bad_slo_is_one_line(bad, says):
    with pytest.raises(SloError, match=says) as e:
        parse_slo(bad)
    assert "\n" not in str(e.value)


def test_tpot_and_goodness_follow_vllm():
    r = RequestRecord(1, ttft=0.2, e2e=1.2, output_len=11, reason="length")
    assert r.tpot == pytest.approx(0.1)  # (e2e - ttft) / (output_tokens - 1)
    assert RequestRecord(2, 0.2, 0.2, 1).tpot == 0.0
    assert judge(r, parse_slo("ttft:200 tpot:100")).good  # equal to the target meets it
    j = judge(r, parse_slo("ttft:500 tpot:99"))
    assert not j.good and [k for k, _, _ in j.missed] == ["tpot"]
    assert not judge(RequestRecord(3, 0.01, 0.02, 2, "abort"), parse_slo("ttft:500")).good
    assert judge(r, NO_SLO).good


def test_tally_goodput_and_cost():
    t = GoodputTally(parse_slo("ttft:300"))
    t.add(RequestRecord(1, 0.1, 1.0, 10), end_t=1.0)
    t.add(RequestRecord(2, 0.5, 2.0, 30), end_t=2.0)
    f = t.figures()
    assert (f.requests, f.good_requests, f.good_tokens, f.duration_s) == (2, 1, 10, 2.0)
    assert f.goodput_tok_per_s == 5.0 and f.output_tok_per_s == 20.0 and f.met == {"ttft": 0.5}
    assert usd_per_mtok(3.6, 1000.0) == pytest.approx(1.0)  # 3.6 M tokens an hour for $3.60
    assert usd_per_mtok(None, 1000.0) is None and usd_per_mtok(2.0, 0.0) is None


# ---- one race, every view --------------------------------------------------------------------
@pytest.fixture(scope="module")
def raced(tmp_path_factory):
    from kvscope import workload as wl
    from kvscope.bench.harness import add_cost
    from kvscope.bench.race import plan, race_result, run_race
    from kvscope.bench.sim import sim_workload

    out = tmp_path_factory.mktemp("race")
    config = EngineConfig(**SIM)
    items = sim_workload(config, wl.load_spec("mixed"), 40, None)
    runs = plan(config, ["naive", "static", "continuous", "chunked"], [])
    rows = run_race(runs, items, str(out), sim=True, progress=False, log=lambda *a, **k: None,
                    slo=parse_slo(RECORDED))
    return add_cost(race_result(runs, rows, items, "sim", sim=True, workload="mixed"), 2.0)


def _dashboard(path, slo):
    from kvscope.tui.launch import make_replay_app

    app = make_replay_app(path, playing=False, index_in_background=False, slo=slo, auto_tick=False)
    feed = app.feeds[0]
    feed.cursor.FORWARD_LIMIT = 0  # the far seek: a restart from a snapshot, goodput handed over
    feed.cursor.seek(feed.cursor.steps[-1])
    while feed.pump(time.monotonic()):
        pass
    return feed.state


def _report_row(path, slo):
    from kvscope.goodput import resolve_slo
    from kvscope.traces.figures import figures_of
    from kvscope.traces.reader import TraceReader

    trace = TraceReader(path)
    return figures_of(trace, trace.hello.config.block_size, slo=resolve_slo(slo, trace.hello.config))


def test_the_trace_records_its_slo(raced):
    from kvscope.goodput import slo_of
    from kvscope.traces.reader import TraceReader

    for row in raced["rows"]:
        assert slo_of(TraceReader(row["trace"]).hello.config).describe() == RECORDED
        assert row["slo"] == RECORDED


def test_two_slos_two_goodputs_and_every_view_agrees_to_the_request(raced):
    row = next(r for r in raced["rows"] if r["name"] == "chunked")
    seen = set()
    for slo in (None, parse_slo("tpot:25")):  # None: the recorded SLO
        st = _dashboard(row["trace"], slo)
        rep = _report_row(row["trace"], slo)
        dash = st.goodput.figures()
        assert dash.slo == rep["slo"] == (RECORDED if slo is None else "tpot:25")
        assert (dash.good_requests, dash.good_tokens, dash.requests) == \
            (rep["good_requests"], rep["good_tokens"], rep["judged_requests"])
        assert dash.goodput_tok_per_s == pytest.approx(rep["goodput_tok_per_s"], rel=1e-9)
        seen.add(rep["good_requests"])
        from kvscope.report.series import read_trace  # `kvscope report`'s own pass over the trace

        page = read_trace(row["trace"], "A", slo).figures()
        assert (page["slo"], page["good_requests"], page["good_tokens"]) == (dash.slo, dash.good_requests,
                                                                             dash.good_tokens)
        if slo is None:  # bench's row (race runs bench's function) judged the same requests
            assert (row["good_requests"], row["good_tokens"]) == (rep["good_requests"], rep["good_tokens"])
            assert row["goodput_tok_per_s"] == pytest.approx(rep["goodput_tok_per_s"], rel=1e-9)
    assert len(seen) == 2, "two SLO settings must give two goodputs on this trace"


def test_metrics_count_the_same_good_requests(raced):
    from kvscope.serve.metrics import PrometheusSink
    from kvscope.traces.reader import TraceReader

    row = next(r for r in raced["rows"] if r["name"] == "continuous")
    sink = PrometheusSink("m")
    trace = TraceReader(row["trace"])
    sink.publish(trace.hello)
    for ev in trace:
        sink.publish(ev)
    text = sink.exposition()[0].decode()
    assert f'kvscope:goodput_requests_total{{engine="0",model_name="m"}} {float(row["good_requests"])}' in text
    assert f'kvscope:goodput_tokens_total{{engine="0",model_name="m"}} {float(row["good_tokens"])}' in text
    assert 'kvscope:slo_target_seconds{engine="0",model_name="m",slo="ttft"} 0.4' in text


def test_race_rows_rank_by_goodput_and_cost(raced):
    from kvscope.bench.report import ranking_lines, rows_table

    table = rows_table(raced)
    assert "goodput" in table and "$/Mtok" in table and "$/Mgood" in table
    lines = ranking_lines(raced)
    by_good = next(x for x in lines if x.startswith("ranked by goodput"))
    order = sorted(raced["rows"], key=lambda r: -r["goodput_tok_per_s"])
    assert by_good.endswith(" > ".join(r["name"] for r in order))
    for r in raced["rows"]:
        assert r["usd_per_mtok"] == pytest.approx(2.0 / (r["output_tok_per_s"] * 3600 / 1e6))
        assert r["goodput_tok_per_s"] <= r["output_tok_per_s"] + 1e-9


def test_lesson_race_ranked_by_goodput_and_dollars_per_mtok():
    """The shipped race-lesson traces: the four modes ranked by tok/s, by goodput and by $/Mtok."""
    from kvscope.bench.harness import add_cost
    from kvscope.bench.report import ranking_lines

    d = os.path.join(ROOT, "traces", "race-lesson")
    rows = []
    for name in sorted(os.listdir(d)):
        r = _report_row(os.path.join(d, name), parse_slo("tpot:70"))
        r["name"] = name.split("-", 1)[1].removesuffix(".kvtrace")
        rows.append(r)
    lines = ranking_lines(add_cost({"rows": rows}, 4.0))
    for title in ("ranked by tok/s", "ranked by goodput", "ranked by $/Mtok", "ranked by $/Mgood"):
        line = next(x for x in lines if x.startswith(title))
        assert all(m in line for m in ("naive", "static", "continuous", "chunked")), line
    cheapest = min(rows, key=lambda r: r["usd_per_mtok"])
    assert cheapest["name"] == max(rows, key=lambda r: r["output_tok_per_s"])["name"]


# ---- diagnose -----------------------------------------------------------------------------------
def test_diagnose_never_recommends_a_knob_its_what_if_says_lowers_goodput():
    from kvscope.analysis.diagnose import diagnose_trace

    path = os.path.join(ROOT, "traces", "race-lesson", "D-chunked.kvtrace")
    d = diagnose_trace(path, slo=parse_slo("tpot:70"))
    assert d.slo == "tpot:70" and any("tpot" in x and "FAILS" in x for x in d.slo_findings)
    predicted = [k for k in d.knobs if k.predicted is not None]
    assert predicted, "the what-if predicted nothing"
    for k in predicted:
        assert k.predicted.goodput_tok_per_s >= k.baseline.goodput_tok_per_s, k.flag
    goods = [k.predicted.goodput_tok_per_s for k in predicted]
    assert goods == sorted(goods, reverse=True)
    assert any(r.startswith("not recommended: --max-num-batched-tokens") for r in d.refusals), d.refusals


def test_rank_by_goodput_refuses_a_throughput_win_that_loses_goodput():
    from kvscope.analysis.diagnose import rank_by_goodput
    from kvscope.analysis.figures import RunFigures
    from kvscope.analysis.knobs import Knob

    def figs(tok, good):
        return RunFigures(output_tok_per_s=tok, ttft_p50_s=None, ttft_p99_s=None, itl_p99_s=None, preemptions=0,
                          goodput_tok_per_s=good)

    base = figs(100.0, 80.0)
    faster = Knob(flag="--max-num-seqs", from_=8, to=64, why="", baseline=base, predicted=figs(150.0, 40.0))
    kept = Knob(flag="--mode", from_="continuous", to="chunked", why="", baseline=base, predicted=figs(95.0, 90.0))

    class D:
        knobs = [faster, kept]
        refusals: list = []
        slo = "ttft:100"

    rank_by_goodput(D)
    assert D.knobs == [kept]
    assert "--max-num-seqs 8 -> 64 would raise tok/s" in D.refusals[0]


# ---- the command line ---------------------------------------------------------------------------
def _cli(*args):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "kvscope", *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=ROOT)


@pytest.mark.parametrize("cmd", [["bench", "--backend", "sim"], ["replay", "x.kvtrace"], ["diagnose", "x.kvtrace"],
                                 ["serve", "--backend", "sim"], ["race", "--no-tui"]])
def test_a_bad_slo_is_a_one_line_usage_error(cmd):
    p = _cli(*cmd, "--slo", "itl:50")
    assert p.returncode == 2 and "unknown key 'itl'" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_hostile_slo_in_a_hello_is_refused_by_the_decoder():
    import msgspec

    from kvscope.protocol.codec import ProtocolError, decode

    hello = {"type": "hello", "version": 1, "wall_start": 0.0, "config": {"model": "m", "slo_ttft_ms": -5.0}}
    with pytest.raises(ProtocolError):
        decode(msgspec.msgpack.encode(hello))
    hello["config"]["slo_ttft_ms"] = 500.0
    assert decode(msgspec.msgpack.encode(hello)).config.slo.ttft_ms == 500.0


# ---- the screens --------------------------------------------------------------------------------
def test_header_and_request_detail_show_goodput(raced):
    asyncio.run(_header_and_detail(raced))


async def _header_and_detail(raced):
    from kvscope.tui import fmt
    from kvscope.tui.launch import make_replay_app
    from kvscope.tui.screens import RequestDetailScreen
    from kvscope.tui.widgets import HeaderBar
    from kvscope.tui.widgets.request import RequestSummary

    row = next(r for r in raced["rows"] if r["name"] == "static")
    app = make_replay_app(row["trace"], playing=False, index_in_background=False, slo=parse_slo("tpot:25"),
                          auto_tick=False)
    feed = app.feeds[0]
    async with app.run_test(size=(160, 40)) as pilot:
        feed.cursor.seek(feed.cursor.steps[-1])
        while app.pump():
            pass
        await pilot.pause()
        fig = feed.state.goodput.figures()
        text = app.screen.query_one(HeaderBar).render().plain
        assert f"goodput {fmt.rate(fig.goodput_tok_per_s)}/{fmt.rate(fig.output_tok_per_s)} tok/s" in text
        assert f"tpot {fig.met['tpot'] * 100:.0f}%" in text
        missed = next(r for r in feed.state.finished.values() if r.judgement is not None and not r.judgement.good)
        app.push_screen(RequestDetailScreen(feed, missed.req))
        await pilot.pause()
        detail = " ".join(w.render().plain for w in app.screen.query(RequestSummary))
        assert "SLO missed (tpot +" in detail


def test_a_trace_written_with_the_largest_slo_reads_back(tmp_path):
    from kvscope.goodput import MAX_SLO_MS, slo_of
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.traces.reader import TraceReader
    from kvscope.traces.writer import TraceWriter

    engine = LLMEngine(EngineConfig(**SIM))
    engine.hello_extra = parse_slo([f"ttft:{MAX_SLO_MS:g}", "e2el:0"]).to_wire()
    path = str(tmp_path / "t.kvtrace")
    TraceWriter(path, engine.hello(), snapshot_provider=engine.snapshot).close()
    assert slo_of(TraceReader(path).hello.config).describe() == "ttft:1e+09 e2el:0"
    with pytest.raises(SloError):
        parse_slo(f"ttft:{MAX_SLO_MS * 1.01:g}")  # what the reader would refuse never reaches the writer


def test_compare_strip_and_columns_show_goodput_and_cost(raced):
    asyncio.run(_compare(raced))


async def _compare(raced):
    from kvscope.tui.launch.compare import make_compare_app
    from kvscope.tui.widgets.run_column import RunNumbers

    paths = [r["trace"] for r in raced["rows"]]
    app = make_compare_app(paths, clock=lambda: 100.0, auto_tick=False, slo=parse_slo("tpot:25"), cost_per_hour=2.0)
    async with app.run_test(size=(200, 45)) as pilot:
        for feed in app.feeds:
            feed.cursor.seek(feed.cursor.steps[-1])
        while app.pump():
            pass
        await pilot.pause()
        strip = app.screen.query_one("#compare-summary").render().plain
        assert "goodput" in strip and "SLO met" in strip and "$/Mtok" in strip
        for run in (f.run for f in app.feeds):
            assert run.figures["slo"] == "tpot:25" and run.figures["usd_per_mtok"] > 0
        numbers = app.screen.query_one("#run-numbers-0", RunNumbers).render().plain
        assert " good " in numbers
        st = app.feeds[0].state
        assert st.goodput.good_tokens == app.feeds[0].run.figures["good_tokens"]


def test_a_knob_that_wins_throughput_and_loses_goodput_is_refused_only_with_an_slo():
    from kvscope.analysis.diagnose import diagnose_trace

    path = os.path.join(ROOT, "traces", "race-lesson", "C-continuous.kvtrace")
    plain = diagnose_trace(path)
    assert plain.knobs[0].flag == "--gpu-memory-utilization" and not plain.slo
    d = diagnose_trace(path, slo=parse_slo("tpot:70"))
    assert "--gpu-memory-utilization" not in [k.flag for k in d.knobs]
    refused = next(r for r in d.refusals if r.startswith("not recommended: --gpu-memory-utilization"))
    assert "would raise tok/s" in refused
    gmu = next(k for k in plain.knobs if k.flag == "--gpu-memory-utilization")
    assert gmu.predicted.output_tok_per_s > gmu.baseline.output_tok_per_s


def test_overview_row_shows_goodput_beside_tok_s(raced):
    from kvscope.tui.feeds import ReplayFeed
    from kvscope.tui.screens.overview import row_cells
    from kvscope.tui.sources.replay import ReplayController, open_trace

    trace = open_trace(raced["rows"][0]["trace"])
    cursor = ReplayController(trace, playing=False, slo=parse_slo("e2el:1e6"))
    feed = ReplayFeed(cursor, name="a", slo=parse_slo("e2el:1e6"))
    cursor.seek(cursor.steps[-1])
    while feed.pump(time.monotonic()):
        pass
    row = feed.row()
    assert row.goodput_tok_per_s == pytest.approx(feed.state.goodput.figures().output_tok_per_s)  # all good

    class Pal:
        ok = bad = warn = bar = "white"

    assert "(good " in str(row_cells(row, Pal)[5])
