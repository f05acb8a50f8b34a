"""The sim against published runs: kvscope/bench/anchors.json, the table, the fitted defaults, the CLI."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import time

import pytest

from kvscope.bench.anchors import check_anchors, load_anchors, nano_vllm_bench_lengths, run_anchors
from kvscope.errors import KvscopeError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def table():
    cpu = time.process_time()
    result = run_anchors()
    return result, time.process_time() - cpu


def test_anchors_file_is_well_formed():
    data = load_anchors()
    anchors = data["anchors"]
    assert len(anchors) >= 8
    assert len({a["gpu"] for a in anchors}) >= 3 and len({a["model"] for a in anchors}) >= 3
    assert {a["split"] for a in anchors} == {"fit", "validate"}
    for a in anchors:
        assert a["engine_version"] and a["source"].count("https://") >= 1
    # The workload is nano-vllm's bench.py, draw for draw: its published total is 133,966 output tokens.
    wl = data["workloads"]["nano-vllm-bench"]
    prompts, outputs = nano_vllm_bench_lengths(wl)
    assert len(prompts) == len(outputs) == 256 and sum(outputs) == wl["output_tokens"] == 133966
    assert min(prompts) >= 100 and max(prompts) <= 1024


def test_catalog_has_the_anchors_gpus_and_models_with_sources():
    from kvscope.engine.sim import catalog

    for name in ("a800-80gb", "a100-pcie-80gb", "rtx-4070-laptop", "l40s"):
        g = catalog.gpu(name)
        assert "https://" in g.source and g.memory_bw > 0 and g.rate("bf16") > 0
    for name in ("qwen2.5-0.5b", "llama-3.2-1b", "qwen3-1.7b", "qwen3-4b"):
        m = catalog.model(name)
        assert "https://huggingface.co/" in m.source and abs(m.total_params / m.params - 1) < 0.02
    assert catalog.gpu_from_device_name("NVIDIA A800-SXM4-80GB") == "a800-80gb"
    assert catalog.gpu_from_device_name("NVIDIA A100 80GB PCIe") == "a100-pcie-80gb"
    assert catalog.gpu_from_device_name("NVIDIA L40S") == "l40s"
    assert catalog.gpu_from_device_name("NVIDIA GeForce RTX 4070 Laptop GPU") == "rtx-4070-laptop"
    assert catalog.model("Qwen/Qwen3-4B") is catalog.model("qwen3-4b")


@pytest.mark.parametrize("breakage", ["no-source", "bad-split", "unknown-gpu", "dup-id", "bad-engine", "not-a-dict"])
def test_malformed_anchors_are_one_line_errors(breakage):
    data = copy.deepcopy(load_anchors())
    a = data["anchors"][0]
    if breakage == "no-source":
        a["source"] = "somewhere"
    elif breakage == "bad-split":
        a["split"] = "train"
    elif breakage == "unknown-gpu":
        a["gpu"] = "tpu-v9"
    elif breakage == "dup-id":
        data["anchors"].append(dict(a))
    elif breakage == "bad-engine":
        data["engines"][a["engine"]]["block_size"] = 0
    else:
        data = [data]
    with pytest.raises(KvscopeError) as e:
        check_anchors(data, "anchors.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("anchors.json")


def test_table_gives_the_errors_docs_sim_states(table):
    """Each row's error is the one docs/SIM.md prints, within 1 point; the fitted set within 10%."""
    result, cpu_s = table
    assert cpu_s < 60  # the whole table in under a minute of CPU
    with open(os.path.join(ROOT, "docs", "SIM.md"), encoding="utf-8") as f:
        doc = f.read()
    rows = {r["id"]: r for r in result["rows"]}
    assert len(rows) == len(load_anchors()["anchors"])
    for aid, r in rows.items():
        m = re.search(rf"^\| {re.escape(aid)} \|.*\| ([+-−]\d+\.\d)% \|$", doc, re.M)
        assert m, f"docs/SIM.md has no row for {aid}"
        stated = float(m.group(1).replace("−", "-")) / 100
        assert abs(r["error"] - stated) <= 0.01, (aid, r["error"], stated)
        assert r["output_tokens"] == 133966
    assert all(abs(r["error"]) <= 0.10 for r in rows.values() if r["split"] == "fit")
    assert all(abs(r["error"]) <= 0.15 for r in rows.values() if r["split"] == "validate")
    for split, s in result["summary"].items():
        m = re.search(rf"^{split}: \d+ runs, mean \|error\| (\d+\.\d)%, max \|error\| (\d+\.\d)%$", doc, re.M)
        assert m, split
        assert abs(s["mean_abs_error"] - float(m.group(1)) / 100) <= 0.01
        assert abs(s["max_abs_error"] - float(m.group(2)) / 100) <= 0.01


def test_fit_recovers_the_defaults_and_the_table(table):
    """The shipped defaults are what the fit gives, and its per-step sums equal the sim's own runs."""
    from kvscope.bench.anchor_fit import fit
    from kvscope.engine.sim.cost import ENGINE_PROFILES, Efficiency

    got = fit()
    eff = Efficiency()
    assert got["eff_bw"] == pytest.approx(eff.eff_bw, rel=0.01)
    assert got["overhead_s"] == pytest.approx(eff.overhead_s, rel=0.01)
    assert got["profiles"]["vllm"]["overhead_s"] == pytest.approx(ENGINE_PROFILES["vllm"]["overhead_s"], rel=0.01)
    rows = {r["id"]: r for r in table[0]["rows"]}
    for aid, err in got["fit_errors"].items():
        assert err == pytest.approx(rows[aid]["error"], abs=0.003), aid


def _run(args, cwd):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "kvscope", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_cli_runs_an_anchors_file_and_refuses_a_bad_one(tmp_path):
    data = load_anchors()
    data["workloads"] = {"small": {"generator": "uniform", "num_seqs": 16, "input_len": [32, 64],
                                   "output_len": [16, 32], "seed": 1}}
    data["anchors"] = [dict(data["anchors"][2], id="small-run", workload="small", published=1000.0)]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "out.json"
    p = _run(["bench", "--backend", "sim", "--anchors", str(path), "--json", str(out)], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "small-run" in p.stdout and "published" in p.stdout
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["id"] == "small-run" and rows[0]["sim"] > 0
    assert rows[0]["error"] == pytest.approx(rows[0]["sim"] / 1000.0 - 1)
    data["anchors"][0]["split"] = "train"
    path.write_text(json.dumps(data))
    p = _run(["bench", "--backend", "sim", "--anchors", str(path)], tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
