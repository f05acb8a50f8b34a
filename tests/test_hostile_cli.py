"""Careless and hostile command lines: exit status 2 and exactly one line on stderr, never a
traceback, and never after minutes of work (sizes and paths are checked before the run)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from _helpers import free_port

from kvscope.cli import main
from kvscope.errors import KvscopeError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_line_exit_2(argv: list[str], capsys, needle: str) -> str:
    assert main(argv) == 2  # checked before the run: the tests that matter check memory, not the clock
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0], lines[0]
    return lines[0]


QUICK = [
    (["serve", "--num-blocks", "1e9"], "num_blocks must be an integer in [1, 2,097,152]"),
    (["serve", "--num-blocks", "1e12", "--backend", "sim", "--model", "llama-3.3-70b-fp8"], "num_blocks must be"),
    (["serve", "--swap-space", "inf"], "not a finite number"),
    (["serve", "--swap-space", "nan"], "not a finite number"),
    (["serve", "--swap-space", "1e6"], "swap_space must be a number in [0, 1024] GiB"),
    (["serve", "--max-num-batched-tokens", "1e30"], "max_num_batched_tokens must be an integer"),
    (["serve", "--max-model-len", "-1"], "max_model_len must be an integer"),
    (["serve", "--num-requests", "1e12"], "outside"),
    (["serve", "--mode", "fast"], "invalid choice: 'fast'"),
    (["serve", "--dtype", "int4"], "invalid choice: 'int4'"),
    (["serve", "--policy", "lifo"], "unknown policy 'lifo'"),
    (["serve", "--tp", "1e12", "--backend", "sim", "--model", "llama-3.3-70b-fp8"], "tp must be an integer"),
    (["serve", "--gpu", "bogus"], "invalid choice: 'bogus'"),
    (["serve", "--workload", "nope"], "unknown workload 'nope'"),
    (["serve", "--events", "tcp://127.0.0.1:6301", "--control", "tcp://127.0.0.1:6301"], "different addresses"),
    (["serve", "--events", "ipc:///no/such/dir/kvscope.sock"], "no directory /no/such/dir"),
    (["serve", "--events", "tcp://0.0.0.0:6302"], "not a loopback address"),
    (["serve", "--control", "garbage"], "bad address 'garbage'"),
    (["serve", "--json", "/no/such/dir/out.json"], "cannot write /no/such/dir/out.json"),
    (["serve", "--record", "/no/such/dir/t.kvtrace"], "cannot write /no/such/dir/t.kvtrace"),
    (["bench", "--json", "/no/such/dir/out.json"], "cannot write"),
    (["bench", "--modes", "chunked,turbo"], "unknown mode 'turbo'"),
    (["bench-features", "--experiments", "nope"], "unknown experiment 'nope'"),
    (["bench-features", "--json", "/no/such/dir/x.json"], "cannot write"),
    (["bench-features", "--seed", "9223372036854775808"], "is outside [0, 9223372036854775807]"),
    (["serve", "--seed", "-9223372036854775809"], "seed must be an integer"),
    (["record", "x.kvtrace", "--connect", "garbage"], "bad address 'garbage'"),
    (["record", "x.kvtrace", "--connect", "tcp://127.0.0.1:99999"], "bad port"),
    (["record", "/no/such/dir/x.kvtrace"], "cannot write"),
    (["record", "x.kvtrace", "--duration", "inf"], "not a finite number"),
    (["serve", "--http", "127.0.0.1:0", "--served-model-name", "tiny", " "], "a model name cannot be empty"),
    (["tui", "--connect", "udp://127.0.0.1:1"], "unsupported transport"),
    (["demo", "--sim", "--gpu", "bogus"], "invalid choice: 'bogus'"),
    (["replay", "/no/such/file.kvtrace"], "cannot read /no/such/file.kvtrace"),
    (["replay", __file__], "not a kvscope trace"),
    (["trace-info", "/no/such/file.kvtrace"], "No such file or directory"),
    (["trace-info", ROOT], "Is a directory"),
    (["calibrate", "/no/such/file.kvtrace"], "No such file or directory"),
    (["bench", "--preset", "nope"], "unknown bench preset 'nope'"),
    (["diagnose", "x.kvtrace", "--window", "1e30"], "argument --window: 1e30 is outside [1, 1099511627776]"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
]


@pytest.mark.parametrize("argv, needle", QUICK, ids=[" ".join(a) for a, _ in QUICK])
def test_hostile_values_are_one_line_exit_2(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_line_exit_2(argv, capsys, needle)


def test_address_in_use_is_one_line(capsys):
    port = free_port()
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    try:
        for flag in ("--events", "--control"):
            one_line_exit_2(["serve", flag, f"tcp://127.0.0.1:{port}", "--num-requests", "1"], capsys,
                            f"cannot bind tcp://127.0.0.1:{port}")
    finally:
        holder.close()


def test_num_blocks_beyond_memory_is_refused_before_allocating(capsys):
    # under the bookkeeping cap, over this machine's memory for the tiny model's fp32 KV
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    line = one_line_exit_2(["serve", "--device", "cpu", "--num-blocks", "2000000", "--num-requests", "1"], capsys,
                           "num_blocks 2000000 needs")
    assert "GiB of KV cache" in line
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 2 << 20, "refused before the 61 GiB were allocated, not after trying"


@pytest.mark.parametrize("change, needle", [
    (lambda p: p["engine"].update(policy="os:getcwd"), "a module:Class policy can be given only with --policy"),
    (lambda p: p["engine"].update(colour="red"), "unknown engine setting 'colour'"),
    (lambda p: p.update(colour="red"), "unknown field `colour`"),
    (lambda p: p["engine"].update(num_blocks="12"), "num_blocks must be an integer"),
    (lambda p: p["engine"].update(num_blocks=10**12), "num_blocks must be an integer"),
    (lambda p: p.update(modes=["chunked", "warp"]), "modes must be a list of"),
    (lambda p: p["workload"].update(arrival={"kind": "warp"}), "arrival.kind must be one of"),
])
def test_bench_preset_files_are_data(change, needle, capsys, tmp_path):
    from importlib import resources

    preset = json.loads(resources.files("kvscope.bench").joinpath("presets", "lesson.json").read_text())
    change(preset)
    path = tmp_path / "preset.json"
    path.write_text(json.dumps(preset))
    one_line_exit_2(["bench", "--preset", str(path)], capsys, needle)


def test_a_preset_never_imports_the_module_it_names(tmp_path, monkeypatch):
    """The policy field of a preset file names a module in the current directory: it is not imported."""
    from importlib import resources

    from kvscope.bench.preset import load_preset

    (tmp_path / "evil_policy.py").write_text("import pathlib\npathlib.Path('IMPORTED').write_text('yes')\n"
                                             "class P:\n    def order(self, w, s):\n        return w\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    preset = json.loads(resources.files("kvscope.bench").joinpath("presets", "lesson.json").read_text())
    preset["engine"]["policy"] = "evil_policy:P"
    (tmp_path / "p.json").write_text(json.dumps(preset))
    with pytest.raises(KvscopeError, match="only with --policy"):
        load_preset(str(tmp_path / "p.json"))
    assert not (tmp_path / "IMPORTED").exists()


@pytest.mark.parametrize("body, needle", [
    ({"base": "chat", "colour": "red"}, "unknown key 'colour'"),
    ({"base": "chat", "num_requests": "12"}, "num_requests must be an integer"),
    ({"base": "chat", "num_requests": 10**12}, "num_requests must be <= 1000000"),
    ({"base": "chat", "policy": "os:system"}, "unknown key 'policy'"),
    ({"base": "chat", "prompt_len": {"kind": "const", "value": 10**9}}, "prompt_len.value must be <="),
    ("[" * 100_000, "invalid JSON"),
    ({"base": "chat", "priority_levels": [0, -(2**63)]}, "priority_levels[1] must be >= -9223372036854775807"),
    ({"base": "chat", "priority_levels": [2**64 - 1]}, "priority_levels[0] must be <= 9223372036854775807"),
    ({"base": "chat", "seed": 2**64}, "seed must be <= 9223372036854775807"),
])
def test_workload_files_are_data(body, needle, capsys, tmp_path):
    path = tmp_path / "w.json"
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    one_line_exit_2(["serve", "--workload", str(path)], capsys, needle)


def test_deeply_nested_mixture_is_one_line(capsys, tmp_path):
    dist = {"kind": "const", "value": 3}
    for _ in range(200):
        dist = {"kind": "mixture", "components": [{"weight": 1, "dist": dist}]}
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"base": "chat", "prompt_len": dist}))
    one_line_exit_2(["serve", "--workload", str(path)], capsys, "nests mixtures more than 8 deep")


def test_a_bug_keeps_its_traceback(monkeypatch):
    """Only user mistakes are one line: a ValueError from a bug is not swallowed as a usage error."""
    import kvscope.traces.info as info

    def broken(*a, **k):
        raise ValueError("a bug")

    monkeypatch.setattr(info, "trace_info", broken)
    with pytest.raises(ValueError, match="a bug"):
        main(["trace-info", __file__])
    assert not issubclass(KvscopeError, ValueError)


def test_process_level_no_traceback_and_demo_engine_failure_is_reported(tmp_path):
    """As a user runs it: a separate process, and the demo's engine failing at start-up."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-m", "kvscope", "serve", "--swap-space", "inf"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr

    from kvscope.tui.launch.demo import run_demo

    with pytest.raises(KvscopeError) as e:  # it returns (with a generous timeout inside), never hangs
        run_demo(device="cpu", events_addr=f"tcp://127.0.0.1:{free_port()}",
                 control_addr=f"tcp://127.0.0.1:{free_port()}", extra_args=("--block-size", "0"),
                 log_path=str(tmp_path / "engine.log"))
    message = str(e.value)
    assert "\n" not in message and "the engine exited with code 2" in message
    assert "block_size must be an integer in [1, 1,024], got 0" in message


# ---- output paths: one rule for every command that writes (kvscope.output_paths) ------------
SIM = ["--backend", "sim", "--model", "qwen3-0.6b", "--num-requests", "2"]
OUTPUTS = [
    (["export", "t.kvtrace", "--perfetto", "t.kvtrace"], "it is an input of this command"),
    (["export", "t.kvtrace", "--requests", "./t.kvtrace"], "it is an input of this command"),
    (["export", "t.kvtrace", "--perfetto", "same.json", "--steps", "same.json"], "name the same file"),
    (["export", "t.kvtrace", "--steps", "old.json"], "it already holds JSON, not CSV"),
    (["export", "t.kvtrace", "--perfetto", "other.kvtrace"], "it already holds a .kvtrace trace, not JSON"),
    (["export", "t.kvtrace", "--perfetto", "weights.bin"], "it already holds a binary file"),
    (["diagnose", "t.kvtrace", "--json", "t.kvtrace", "--no-what-if"], "it is an input of this command"),
    (["calibrate", "t.kvtrace", "--json", "t.kvtrace"], "it is an input of this command"),
    (["calibrate", "t.kvtrace", "--validate", "other.kvtrace", "--json", "other.kvtrace"], "it is an input"),
    (["bench", *SIM, "--json", "other.kvtrace"], "it already holds a .kvtrace trace, not JSON"),
    (["bench", *SIM, "--workload", "w.json", "--json", "w.json"], "it is an input of this command"),
    (["bench-features", "--json", "weights.bin"], "it already holds a binary file"),
    (["serve", *SIM, "--record", "old.json"], "it already holds JSON, not a .kvtrace trace"),
    (["serve", *SIM, "--json", "t.kvtrace"], "it already holds a .kvtrace trace, not JSON"),
    (["serve", *SIM, "--json", "x.json", "--record", "x.json"], "it is an input of this command"),
    (["record", "old.json", "--duration", "0.1"], "it already holds JSON, not a .kvtrace trace"),
    (["record", "notes.txt", "--duration", "0.1"], "it already holds text other than CSV"),
    (["race", *SIM, "--no-tui", "--json", "t.kvtrace"], "it already holds a .kvtrace trace"),
    (["race", *SIM, "--no-tui", "--modes", "chunked", "--out", "."], "it already holds JSON"),
]


@pytest.mark.parametrize("argv, needle", OUTPUTS, ids=[" ".join(a) for a, _ in OUTPUTS])
def test_an_output_over_an_input_or_a_file_of_another_kind_is_refused(argv, needle, capsys, tmp_path,
                                                                       monkeypatch):
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copy(os.path.join(ROOT, "traces", "calib-cpu.kvtrace"), "t.kvtrace")
    shutil.copy("t.kvtrace", "other.kvtrace")
    (tmp_path / "old.json").write_text('{"kept": true}\n')
    (tmp_path / "A-chunked.kvtrace").write_text('{"not": "a trace"}\n')  # what race would write in --out .
    (tmp_path / "weights.bin").write_bytes(b"\x00\x01\x02" * 100)
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "w.json").write_text(json.dumps({"base": "chat", "num_requests": 2}))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    one_line_exit_2(argv, capsys, needle)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing written, nothing lost


def test_the_same_kind_is_overwritten_and_export_still_writes(capsys, tmp_path, monkeypatch):
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copy(os.path.join(ROOT, "traces", "calib-cpu.kvtrace"), "t.kvtrace")
    (tmp_path / "p.json").write_text('{"old": 1}')
    (tmp_path / "s.csv").write_text("step,t\n")
    assert main(["export", "t.kvtrace", "--perfetto", "p.json", "--steps", "s.csv"]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["traceEvents"]
    assert (tmp_path / "s.csv").read_text().count("\n") > 100


def test_export_refuses_its_own_input_as_a_library_call_too(tmp_path):
    import shutil

    from kvscope.output_paths import OutputPathError
    from kvscope.serve.export import export_trace

    path = tmp_path / "t.kvtrace"
    shutil.copy(os.path.join(ROOT, "traces", "calib-cpu.kvtrace"), path)
    data = path.read_bytes()
    with pytest.raises(OutputPathError, match="it is an input"):
        export_trace(str(path), perfetto=str(path))
    assert path.read_bytes() == data
