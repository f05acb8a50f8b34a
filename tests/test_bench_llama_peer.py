"""`kvscope bench --peers llama-cpp`: an optional extra, with one-line errors before any row runs."""

from __future__ import annotations

import sys

import pytest


def test_without_llama_cpp_python_the_bench_says_how_to_install_it(monkeypatch, capsys):
    from kvscope.cli.main import main

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    assert main(["bench", "--model", "tiny", "--device", "cpu", "--peers", "llama-cpp", "--modes", "chunked",
                 "--num-requests", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "llama-cpp-python" in err[0]
    assert 'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF"' in err[0]


def test_llama_cpp_needs_the_same_gguf_file(monkeypatch, capsys, tmp_path):
    from kvscope.bench.llama_peer import gguf_path
    from kvscope.engine.config import EngineConfig
    from kvscope.errors import KvscopeError

    with pytest.raises(KvscopeError, match="--model PATH.gguf"):
        gguf_path(EngineConfig(model="tiny"))
    with pytest.raises(KvscopeError, match="no GGUF file"):
        gguf_path(EngineConfig(model=str(tmp_path / "missing.gguf")))
    real = tmp_path / "m.gguf"
    real.write_bytes(b"GGUF")
    assert gguf_path(EngineConfig(model=str(real))) == str(real)


def test_llama_cpp_is_a_peer_name_but_not_a_default():
    from kvscope.bench import peers
    from kvscope.bench.modes import BenchOptions

    assert "llama-cpp" in peers.PEERS
    assert BenchOptions().peers == ["hf-static", "hf-generate-batch"]


def test_a_named_real_model_runs_llama_cpp_on_its_cached_gguf(monkeypatch, tmp_path):
    """`--model smollm2-135m --peers llama-cpp` is the same file both engines load: the cached GGUF."""
    from kvscope.bench.llama_peer import gguf_path
    from kvscope.engine.loader import named_models
    from kvscope.engine.config import EngineConfig

    monkeypatch.setenv(named_models.CACHE_ENV, str(tmp_path))
    target = named_models.cached_path("smollm2-135m")
    (tmp_path / "smollm2-135m").mkdir()
    with open(target, "wb") as f:  # a file of the pinned size counts as cached: nothing is fetched
        f.truncate(named_models.NAMED_MODELS["smollm2-135m"].file_size)
    assert gguf_path(EngineConfig(model="smollm2-135m")) == target


def test_the_16_bit_llama_cpp_peers_and_the_weights_column():
    from kvscope.bench import peers
    from kvscope.bench.report import rows_table

    assert {"llama-cpp-bf16", "llama-cpp-f16"} <= set(peers.PEERS) and "llama-cpp-bf16" in peers.PEER_CHECKS
    row = dict(name="x", output_tok_per_s=1.0, ttft_mean_s=0.1, ttft_p99_s=0.2, itl_p99_s=0.01, preemptions=None,
               kv_waste=None)
    result = dict(workload="chat", model="m", device="cpu", num_requests=1, max_num_seqs=1,
                  rows=[{**row, "name": "single-stream", "weights_mb_per_token": 269.1},
                        {**row, "name": "llama-cpp", "weights_mb_per_token": 96.6}, row])
    lines = rows_table(result).splitlines()
    assert lines[1].split()[-1] == "weights/token"
    assert lines[3].endswith("269 MB") and lines[4].endswith("97 MB") and lines[5].endswith("-")


def test_llama_cpp_runs_under_the_users_openmp_settings_not_kvscopes(monkeypatch):
    """kvscope's passive wait (its earlier choice) made llama.cpp 3x slower in kvscope's own process: its child
    gets the user's environment, with what kvscope set for itself taken out and what the user set kept."""
    from kvscope import openmp_wait

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(openmp_wait, "_set_here", set())
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as before torch loads
    openmp_wait.prefer_short_spin_wait()
    assert __import__("os").environ["GOMP_SPINCOUNT"] == openmp_wait.SPIN_COUNT
    assert "GOMP_SPINCOUNT" not in openmp_wait.user_environment()
    monkeypatch.setattr(openmp_wait, "_set_here", set())
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's own choice is theirs everywhere
    openmp_wait.prefer_short_spin_wait()
    assert openmp_wait.user_environment()["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "GOMP_SPINCOUNT" not in openmp_wait.user_environment()


def test_the_llama_cpp_child_serves_one_at_a_time_and_reports_its_times():
    """The child's own loop (serve_all) on a stand-in for Llama.generate: TTFT, ITL and tokens per request."""
    from kvscope.bench.llama_peer import serve_all

    class FakeLlama:
        def reset(self):
            pass

        def generate(self, prompt, **kw):
            while True:
                yield 7

    out = serve_all(FakeLlama(), [([1, 2], 3), ([3], 2)])
    assert out["tokens"] == 5 and len(out["ttft"]) == 2 and len(out["itl"]) == 3
    assert out["ttft"][0] <= out["ttft"][1] <= out["span"]


def test_a_peer_killed_by_a_signal_says_which_and_what_to_do():
    """A llama-cpp-python built for another CPU dies of SIGILL in the child: "exit status -4" told nobody why."""
    import signal

    from kvscope.bench.llama_peer import _exit_status

    assert _exit_status(1) == "exit status 1"
    assert _exit_status(-signal.SIGKILL) == "killed by SIGKILL"
    ill = _exit_status(-signal.SIGILL)
    assert ill.startswith("killed by SIGILL") and "rebuild" in ill and "\n" not in ill
