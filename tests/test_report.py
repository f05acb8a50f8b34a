"""`kvscope report`: one self-contained page from traces, race/bench JSON and diagnose JSON."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from kvscope.cli import main
from kvscope.report.page import build
from kvscope.report.series import MAX_BUCKETS, RequestSample, StepSeries

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RACE_CPU = sorted(os.path.join(ROOT, "traces", "race-cpu", f) for f in os.listdir(os.path.join(ROOT, "traces", "race-cpu")))
RACE_JSON = os.path.join(ROOT, "benchmarks", "results", "race-cpu.json")
DIAGNOSE_JSON = os.path.join(ROOT, "benchmarks", "results", "diagnose", "kv-h100-70b.json")
TRACE_PLOTS = ("throughput", "latency", "queues", "kv", "tokens", "gantt")


def _plots(page: str) -> dict[str, str]:
    """Each figure's id and its inline SVG."""
    return dict(re.findall(r'<figure class="plot" id="([^"]+)">(<svg.*?</svg>)', page, flags=re.S))


def test_downsampling_keeps_extremes_and_totals_in_fixed_memory():
    s = StepSeries()
    n = 160_000
    for i in range(n):
        spike = 1000.0 if i == 123_457 else 1.0
        s.add(i * 0.01, i * 0.01 + 0.01, [spike] + [float(i)] * 16)
    assert len(s.buckets) <= MAX_BUCKETS
    assert s.steps == n
    mean, lo, hi = s.column("out_tokens")
    assert max(hi) == 1000.0 and min(lo) == 1.0  # a one-step spike survives 256x downsampling
    assert s.total("out_tokens") == n - 1 + 1000.0
    assert s.buckets[0].t0 == 0.0 and s.buckets[-1].t1 == pytest.approx(n * 0.01)
    assert sum(b.steps for b in s.buckets) == n


def test_the_gantt_sample_spreads_over_all_arrivals():
    sample = RequestSample(target=10)
    for r in range(1000):
        sample.arrive(r, float(r), 8)
    kept = sorted(sample.lines)
    assert 10 <= len(kept) <= 20
    assert kept[0] == 0 and kept[-1] >= 900  # the last arrivals are in it, not only the first
    assert len({b - a for a, b in zip(kept, kept[1:])}) == 1  # evenly spaced


def test_traces_race_json_and_diagnose_json_make_one_self_contained_page(tmp_path):
    out = tmp_path / "r.html"
    assert main(["report", *RACE_CPU, RACE_JSON, DIAGNOSE_JSON, "--html", str(out)]) == 0
    page = out.read_text()
    plots = _plots(page)
    for name in TRACE_PLOTS:
        assert name in plots and "<path" in plots[name], name
    assert any(k.startswith("bars-") for k in plots) and any(k.startswith("knobs-") for k in plots)
    # every run is in every multi-run plot's legend, and its figures are in the table
    for label in ("A naive", "B static", "C continuous", "D chunked"):
        assert label in plots["throughput"] and label in plots["latency"]
    assert "kv_capacity" in page and "--gpu-memory-utilization" in page
    # self-contained: no script, nothing to fetch (the SVG namespace is a name, not a request)
    assert "<script" not in page.lower()
    urls = set(re.findall(r'(?:src|href)\s*=\s*"([^"]*)"', page)) | set(re.findall(r"url\(([^)]*)\)", page))
    assert not [u for u in urls if not u.startswith("#")], urls
    assert not re.search(r"https?://(?!www\.w3\.org/)", page)


def test_the_same_inputs_give_the_same_bytes():
    assert build(RACE_CPU[:2]) == build(RACE_CPU[:2])


def test_a_race_json_brings_its_traces(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the race JSON names its traces relative to the repository
    page = build([RACE_JSON])
    plots = _plots(page)
    assert "gantt" in plots and "D chunked" in plots["throughput"]


def test_a_damaged_trace_gets_a_notice_and_the_others_still_plot(tmp_path):
    damaged = tmp_path / "cut.kvtrace"
    data = open(RACE_CPU[3], "rb").read()
    damaged.write_bytes(data[: len(data) // 2])  # cut mid-chunk, no index
    junk = tmp_path / "junk.kvtrace"
    junk.write_bytes(b"KVTRACE\0" + b"\xff" * 200)
    page = build([RACE_CPU[0], str(damaged), str(junk)])
    assert 'class="notice"' in page
    assert "C " in page and "junk.kvtrace: not plotted" in page
    assert "A naive" in _plots(page)["throughput"] and "B chunked" in _plots(page)["throughput"]


def test_mistakes_are_one_line(tmp_path, capsys):
    trace = tmp_path / "t.kvtrace"
    shutil.copy(RACE_CPU[0], trace)
    before = trace.read_bytes()
    assert main(["report", str(trace), "--html", str(trace)]) == 2  # the output is the input
    assert trace.read_bytes() == before
    assert main(["report", RACE_CPU[0], "--html", str(trace)]) == 2  # an existing file that is no page
    assert trace.read_bytes() == before
    notjson = tmp_path / "x.json"
    notjson.write_text("[" * 50_000)
    assert main(["report", str(notjson), "--html", str(tmp_path / "o.html")]) == 2
    other = tmp_path / "y.json"
    other.write_text('{"hello": 1}')
    assert main(["report", str(other), "--html", str(tmp_path / "o.html")]) == 2
    assert main(["report", *RACE_CPU, RACE_CPU[0], "--html", str(tmp_path / "o.html")]) == 2  # five traces
    assert main(["report", str(tmp_path / "missing.kvtrace"), "--html", str(tmp_path / "o.html")]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("kvscope: error:")]
    assert len(lines) == 6 and "Traceback" not in err
    assert not (tmp_path / "o.html").exists()


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def test_the_page_renders_in_headless_chromium_with_a_quiet_console(tmp_path):
    browser = _chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI: `make test` installs it (scripts/ensure-chromium.sh)")
        pytest.skip("no chromium here: `make test` installs it (scripts/ensure-chromium.sh)")
    out = tmp_path / "r.html"
    assert main(["report", *RACE_CPU, DIAGNOSE_JSON, "--html", str(out)]) == 0
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                           "--v=0", "--virtual-time-budget=5000", "--dump-dom", out.as_uri()],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    for name in TRACE_PLOTS:
        assert re.search(rf'<figure class="plot" id="{name}"><svg', dom), name
    console = [x for x in proc.stderr.splitlines() if "CONSOLE" in x or ":INFO:CONSOLE" in x]
    assert console == []


TOP = 1.7976931348623157e308
HOSTILE_JSON = {
    "rows-at-the-largest-float": {"rows": [{"name": "a", "output_tok_per_s": TOP, "ttft_p99_s": TOP}]},
    "knob-prediction-at-the-largest-float": {
        "bottleneck": "kv", "knobs": [{"flag": "--num-blocks", "predicted": {"output_tok_per_s": TOP}}],
        "what_if": {"baseline": {"output_tok_per_s": 1.0}}},
    "fields-of-the-wrong-type": {"bottleneck": {"a": []}, "knobs": [{"flag": [], "predicted": "fast"}],
                                 "measure_next": 5},
}


@pytest.mark.parametrize("name", list(HOSTILE_JSON))
def test_a_hostile_json_input_still_makes_a_page(name, tmp_path, capsys):
    import json

    (tmp_path / "in.json").write_text(json.dumps(HOSTILE_JSON[name]))
    assert main(["report", "--html", str(tmp_path / "r.html"), str(tmp_path / "in.json")]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")


@pytest.mark.parametrize("field", ["secondary", "evidence", "knobs"])
@pytest.mark.parametrize("value", ["x", {"a": 1}, 5])
def test_a_list_field_of_another_type_is_one_line(field, value, tmp_path, capsys):
    """A list field holding an int, or any non-list, is one line."""
    import json

    (tmp_path / "in.json").write_text(json.dumps({"bottleneck": "kv", field: value}))
    assert main(["report", "--html", str(tmp_path / "r.html"), str(tmp_path / "in.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0] and not (tmp_path / "r.html").exists()


def test_a_bench_json_of_many_rows_draws_the_first_ones_and_counts_the_rest(tmp_path):
    import json

    from kvscope.report.page import MAX_ROWS

    rows = [{"name": f"row-{i}-" + "x" * 5000, "output_tok_per_s": float(i)} for i in range(MAX_ROWS + 50)]
    (tmp_path / "in.json").write_text(json.dumps({"rows": rows}))
    page = build([str(tmp_path / "in.json")])
    assert "50 more rows than the 256 shown are left out" in page
    assert f"row-{MAX_ROWS - 1}-" in page and f"row-{MAX_ROWS}-" not in page
