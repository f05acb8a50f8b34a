"""The real model in the sim: smollm2-135m's catalog shape is the GGUF's own, traces recorded on the real
model (by name or by GGUF path) find it, and diagnose and race run on them as on any other model."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kvscope.analysis.calibrate import fit_caution, resolve_names
from kvscope.analysis.diagnose import diagnose_trace
from kvscope.analysis.report import format_text
from kvscope.cli import main
from kvscope.errors import KvscopeError
from kvscope.engine.loader.gguf import read_header
from kvscope.engine.sim import catalog
from kvscope.traces.reader import engine_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(ROOT, "traces", "smollm2-cpu.kvtrace")  # recorded on a quiet machine
# the trace shipped before it: the same run recorded beside some 20 other jobs (seconds per step)
LOADED_TRACE = os.path.join(ROOT, "tests", "data", "smollm2-cpu-loaded.kvtrace")
NAME = "smollm2-135m"
# the catalog's field for each transformers config name a GGUF header gives
FIELDS = {"num_hidden_layers": "num_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_heads",
          "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim", "intermediate_size": "intermediate_size",
          "vocab_size": "vocab_size", "max_position_embeddings": "max_position_embeddings"}


def write_llama_gguf(path, *, layers=30, tied=True) -> str:
    """A header-only GGUF with SmolLM2-135M's sizes (one small tensor: the sizes are all the sim reads)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_embedding_length(576)
    w.add_feed_forward_length(1536)
    w.add_head_count(9)
    w.add_head_count_kv(3)
    w.add_context_length(8192)
    w.add_vocab_size(49152)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    if not tied:
        w.add_tensor("output.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


# ---- the catalog shape ---------------------------------------------------------------------------
def test_catalog_shape_is_the_cached_gguf_header(smollm2_path):
    header = read_header(smollm2_path)
    shape = catalog.model(NAME)
    assert header.architecture == "llama"
    for field, attr in FIELDS.items():
        assert header.shape[field] == getattr(shape, attr), field
    assert header.tied_embeddings and shape.tie_word_embeddings  # the file has no output.weight
    assert abs(shape.total_params / 135e6 - 1) < 0.02  # "135M" on the model card
    assert catalog.catalog_name(smollm2_path) == NAME


def test_a_gguf_of_that_shape_maps_to_it_whatever_its_name(tmp_path):
    assert catalog.catalog_name(write_llama_gguf(tmp_path / "renamed.gguf")) == NAME
    # another shape is not it, whatever the file is called: the header decides
    assert catalog.catalog_name(write_llama_gguf(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf", layers=12)) is None
    assert catalog.catalog_name(write_llama_gguf(tmp_path / "untied.gguf", tied=False)) is None
    with pytest.raises(KvscopeError, match="unknown sim model"):
        catalog.model(str(tmp_path / "untied.gguf"))


@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-135M-Instruct", "/elsewhere/SmolLM2-135M-Instruct.Q4_1.gguf",
                                  "/elsewhere/smollm2-135m-instruct-q4_k_m.gguf", "/models/SmolLM2-135M-Instruct/"])
def test_names_of_the_checkpoint_map_to_it_without_the_file(name):
    assert catalog.catalog_name(name) == NAME


@pytest.mark.parametrize("name", ["/elsewhere/other.gguf", "SmolLM2-360M-Instruct.Q4_1.gguf", "", "gpt-9"])
def test_other_names_do_not(name):
    assert catalog.catalog_name(name) is None


def test_a_trace_recorded_on_a_gguf_path_calibrates_as_the_named_model():
    config = engine_trace(TRACE, "test").hello.config.as_dict()
    assert config["model"] == NAME
    path = "/somewhere/else/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_names({**config, "model": path}, None, None) == ("cpu", NAME)
    with pytest.raises(KvscopeError, match="not in the sim catalog"):
        resolve_names({**config, "model": "/somewhere/else/other.gguf"}, None, None)


def test_sim_backend_runs_the_shape(capsys):
    assert main(["serve", "--backend", "sim", "--model", NAME, "--gpu", "l4", "--num-requests", "4",
                 "--no-progress"]) == 0
    assert "output tok/s" in capsys.readouterr().out


# ---- diagnose on the shipped real-model trace ---------------------------------------------------
def test_diagnose_the_shipped_trace_with_a_calibrated_what_if():
    """Recorded quietly: the fit is tight, the sim's baseline lands on the trace, and no caution is printed."""
    d = diagnose_trace(TRACE, what_if=True)
    text = format_text(d)
    w = d.what_if
    assert d.backend == "model" and d.bottleneck, text
    assert w.ran and w.calibrated and w.calibration["model"] == NAME and w.calibration["gpu"] == "cpu", text
    assert w.requests == w.of_requests == 8
    assert w.calibration["mean_abs_rel_err"] < 0.2 and not w.caution, text


def test_a_trace_recorded_beside_other_jobs_fits_loosely_and_says_so():
    d = diagnose_trace(LOADED_TRACE, what_if=True)
    text = format_text(d)
    w = d.what_if
    assert d.backend == "model" and d.bottleneck and d.knobs, text
    top = d.knobs[0]
    assert top.baseline is not None and top.predicted is not None, text
    # recorded on a 2-core host running ~20 other jobs: the step times follow the work loosely, and it says so
    assert w.calibration["mean_abs_rel_err"] > 0.5
    assert "loose" in w.caution and f"caution: {w.caution}" in text


def test_diagnose_cli_on_the_shipped_trace(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert main(["diagnose", LOADED_TRACE, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cannot calibrate" not in text and f"calibrated the sim ({NAME} on cpu" in text
    data = json.loads(out.read_text())
    assert data["what_if"]["ran"] and data["knobs"][0]["predicted"] is not None
    assert data["what_if"]["caution"]


def test_a_tight_fit_has_no_caution():
    assert fit_caution(0.11, 0.9) == ""  # demo-cpu's fit
    assert "101%" in fit_caution(1.014, 0.722)


# ---- race --------------------------------------------------------------------------------------
def test_race_on_the_sim_shape_records_traces_that_diagnose(tmp_path, capsys):
    out, rows = tmp_path / "race", tmp_path / "race.json"
    assert main(["race", "--backend", "sim", "--model", NAME, "--gpu", "cpu", "--workload", "chat",
                 "--num-requests", "4", "--modes", "continuous,chunked", "--out", str(out), "--no-tui",
                 "--json", str(rows), "--no-progress"]) == 0
    result = json.loads(rows.read_text())
    assert result["model"] == NAME and [r["name"] for r in result["rows"]] == ["continuous", "chunked"]
    for row, path in zip(result["rows"], result["traces"]):
        assert row["output_tok_per_s"] > 0 and os.path.isfile(path)
        assert engine_trace(path, "test").hello.config.as_dict()["sim_model"] == NAME
        d = diagnose_trace(path, what_if=True)
        assert d.what_if.ran and not d.what_if.calibrated  # a sim trace replays with its own settings
