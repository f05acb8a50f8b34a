"""`kvscope serve --engine vllm` without vLLM: the launcher's arguments, its errors, and its process handling.

A stand-in (tests/fakes/vllm_server.py), named by KVSCOPE_VLLM_PYTHON as vLLM's python is, is started exactly as
vLLM would be; it logs what it was given, serves the OpenAI stream and publishes an event stream, fails at
start, dies mid-run or ignores SIGTERM on request. The real vLLM runs in tests/test_vllm_live.py.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import tempfile

import pytest

from kvscope.vllm.launch import flags as vf
from kvscope.vllm.launch import ports as vp
from kvscope.vllm.launch import server as vs
from kvscope.cli import main
from kvscope.errors import KvscopeError
from tests._helpers import free_port, wait_for

FAKE = os.path.join(os.path.dirname(__file__), "fakes", "vllm_server.py")


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """An executable named by KVSCOPE_VLLM_PYTHON that runs the stand-in; a checkpoint directory; its log."""
    exe = tmp_path / "python"
    exe.write_text(f"#!{sys.executable}\nimport runpy\nrunpy.run_path({FAKE!r}, run_name='__main__')\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 1000, "eos_token_id": 2,
                                                   "max_position_embeddings": 512}))
    log = tmp_path / "standin.jsonl"
    monkeypatch.setenv(vf.PYTHON_ENV, str(exe))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the stand-in's logs stay in the test's folder
    return str(model), log


def _given(log) -> dict:
    return json.loads(log.read_text().splitlines()[0])


def _ports(n: int = 4) -> int:
    """A base port with n free ports after it (the events, control, KV-event and replay run)."""
    for _ in range(100):
        p = free_port()
        if all(vp.port_free("127.0.0.1", p + i) for i in range(n)) and p + n < 65536:
            return p
    raise AssertionError("no free run of ports")


def _serve(model: str, *extra: str, vllm: tuple[str, ...] = ()) -> list[str]:
    base = _ports()
    return ["serve", "--engine", "vllm", "--model", model, "--events", f"tcp://127.0.0.1:{base}", *extra,
            *(("--", *vllm) if vllm else ())]


# ---- the launcher's pieces ---------------------------------------------------------------------
def test_a_missing_venv_is_one_line_naming_make_vllm_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(vf.PYTHON_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KvscopeError, match="make vllm-cpu"):
        vf.vllm_python(root=str(tmp_path))
    monkeypatch.setattr(vf, "vllm_python", lambda root=None: (_ for _ in ()).throw(
        KvscopeError(f"vLLM's CPU build is not installed: {vf.INSTALL_HINT}")))
    assert main(["serve", "--engine", "vllm", "--model", "smollm2-135m"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "make vllm-cpu" in err[0] and "Traceback" not in err[0]


def test_a_named_python_that_is_not_executable_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(vf.PYTHON_ENV, str(tmp_path / "nope"))
    with pytest.raises(KvscopeError, match="not an executable file"):
        vf.vllm_python()


def test_the_venv_is_found_in_the_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv(vf.PYTHON_ENV, raising=False)
    py = tmp_path / vf.VENV / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/false\n")
    py.chmod(0o755)
    assert vf.vllm_python(root=str(tmp_path)) == str(py)


@pytest.mark.parametrize("args,flag", [(["--port", "9"], "--port"), (["--host=0.0.0.0"], "--host"),
                                       (["--scheduler_cls", "x.Y"], "--scheduler-cls"),
                                       (["--kv-events-config", "{}"], "--kv-events-config"),
                                       (["--model", "m"], "--model")])
def test_flags_kvscope_sets_are_refused_with_the_kvscope_flag_to_use(args, flag):
    with pytest.raises(KvscopeError, match=flag):
        vf.check_vllm_args(args)


def test_the_data_parallel_size_is_read_as_vllm_writes_it():
    assert vf.check_vllm_args(["--enforce-eager"]) == 1
    assert vf.check_vllm_args(["-dp", "2"]) == 2
    assert vf.check_vllm_args(["--data-parallel-size=3", "--max-num-seqs", "4"]) == 3
    for bad in (["-dp", "two"], ["--data-parallel-size", "0"]):
        with pytest.raises(KvscopeError, match="data-parallel-size"):
            vf.check_vllm_args(bad)


def test_rank_addresses_follow_vllms_offset_rule():
    assert vp.offset_port("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert vp.offset_port("tcp://127.0.0.1:5557", 3) == "tcp://127.0.0.1:5560"
    assert vp.offset_port("tcp://[::1]:7000", 1) == "tcp://[::1]:7001"
    assert vp.offset_port("tcp://127.0.0.1:0", 2) == "tcp://127.0.0.1:0"  # left to the OS
    assert vp.offset_port("inproc://cache", 1) == "inproc://cache_dp1"
    with pytest.raises(KvscopeError):
        vp.offset_port("ipc:///tmp/x", 1)


def test_kvscope_engine_flags_become_vllms_and_the_rest_are_refused():
    c = vf.engine_choice({"model": "m", "max_num_seqs": 16, "max_num_batched_tokens": 256, "block_size": 32,
                          "prefix_caching": False, "policy": "priority", "mode": "continuous", "seed": 5,
                          "enforce_eager": True, "dtype": "bfloat16", "cpu_threads": 2, "kv_cache_space": 3.0})
    flags = list(c.flags)
    pairs = dict(zip(flags, flags[1:]))
    assert pairs["--max-num-seqs"] == "16" and pairs["--max-num-batched-tokens"] == "256"
    assert pairs["--block-size"] == "32" and pairs["--seed"] == "5" and pairs["--scheduling-policy"] == "priority"
    assert "--no-enable-prefix-caching" in flags and "--no-enable-chunked-prefill" in flags
    assert "--enforce-eager" in flags
    assert (c.dtype, c.cpu_threads, c.kv_cache_gib) == ("bfloat16", 2, 3)
    assert vf.engine_choice({}).dtype in ("float32", "bfloat16")  # kvscope's own choice for this CPU
    for bad, word in (({"policy": "sjf"}, "--policy"), ({"mode": "static"}, "--mode"),
                      ({"quantization": "gguf"}, "--quantization"), ({"kv_cache_space": 1.5}, "whole GiB"),
                      ({"backend": "sim"}, "--backend")):
        with pytest.raises(KvscopeError, match=word):
            vf.engine_choice(bad)


def test_threads_bind_one_slice_of_cpus_per_rank():
    assert vf.cpu_binding(None, 1, [0, 1]) is None  # vLLM's own choice
    assert vf.cpu_binding(2, 1, [0, 1]) == "0,1"
    assert vf.cpu_binding(None, 2, [0, 1]) == "0|1"  # one core each, not both on core 0
    assert vf.cpu_binding(1, 2, [4, 6, 8]) == "4|6"
    with pytest.raises(KvscopeError, match="need 4 CPUs"):
        vf.cpu_binding(2, 2, [0, 1])


def test_the_kv_cache_default_is_kvscopes_cpu_rule_shared_by_the_ranks():
    gib = 1 << 30
    assert vf.default_kv_cache_gib(1, available=20 * gib) == 4  # half, capped at 4 GiB
    assert vf.default_kv_cache_gib(2, available=20 * gib) == 2
    assert vf.default_kv_cache_gib(1, available=3 * gib) == 1
    assert vf.default_kv_cache_gib(4, available=1 * gib) == 1  # at least one GiB each


def test_the_error_line_is_the_cause_not_the_pointer_to_it(tmp_path):
    log = tmp_path / "v.log"
    log.write_text("(APIServer pid=1) INFO 12-07 13:00:49 [a.py:1] starting\n"
                   "(VllmWorker-0 pid=9) ERROR 12-07 13:11:15 [m.py:953] Traceback (most recent call last):\n"
                   '(VllmWorker-0 pid=9) ERROR 12-07 13:11:15 [m.py:953]   File "x.py", line 3, in f\n'
                   "(VllmWorker-0 pid=9) ERROR 12-07 13:11:15 [m.py:953] ValueError: Available memory is low\n"
                   "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert vs.error_line(str(log)) == "ValueError: Available memory is low"
    log.write_text("just a line\nthe last line\n")
    assert vs.error_line(str(log)) == "the last line"
    assert vs.error_line(str(tmp_path / "absent.log")) == "(no output)"


# ---- the process ------------------------------------------------------------------------------
def _spec(model: str, **kw) -> vs.LaunchSpec:
    base = _ports()
    args = dict(python=os.environ[vf.PYTHON_ENV], model_dir=model, served_model_name="m", host="127.0.0.1",
                port=free_port(), events_addr=f"tcp://127.0.0.1:{base}", kv_events_addr=f"tcp://127.0.0.1:{base + 2}",
                kv_replay_addr=f"tcp://127.0.0.1:{base + 3}")
    args.update(kw)
    return vs.LaunchSpec(**args)


def test_vllms_flags_arrive_as_given_with_no_shell_between(standin, tmp_path):
    model, log = standin
    odd = "$(touch " + str(tmp_path / "pwned") + "); echo 'quoted' \"x\""
    spec = _spec(model, vllm_args=("--enforce-eager", "--chat-template", odd), cpu_bind="0", kv_cache_gib=2,
                 engine_flags=("--max-num-seqs", "4"), dtype="float32")
    with vs.VllmServer(spec) as server:
        server.wait_ready(timeout_s=60)
    given = _given(log)
    argv = given["argv"]
    assert argv[:2] == ["-m", vs.API_SERVER]
    assert argv[-3:] == ["--enforce-eager", "--chat-template", odd]  # the user's flags last, so they win
    assert argv[argv.index("--scheduler-cls") + 1] == vs.WATCHED_SCHEDULER
    assert argv.index("--shutdown-timeout") < argv.index("--enforce-eager")  # a drain, unless the user says otherwise
    assert argv[argv.index("--max-num-seqs") + 1] == "4" and argv[argv.index("--dtype") + 1] == "float32"
    cfg = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert cfg == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": spec.kv_events_addr,
                   "replay_endpoint": spec.kv_replay_addr}
    assert given["env"]["KVSCOPE_VLLM_PUBLISH"] == spec.events_addr
    assert given["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0" and given["env"]["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert given["env"]["VLLM_USE_AOT_COMPILE"] == "0"  # the compile cache vLLM's CPU build can load
    assert not (tmp_path / "pwned").exists()


def test_the_users_own_thread_binding_wins(standin, monkeypatch):
    model, log = standin
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with vs.VllmServer(_spec(model, cpu_bind="0|1")) as server:
        server.wait_ready(timeout_s=60)
    assert _given(log)["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_a_vllm_that_fails_to_start_is_one_line_with_its_cause_and_log(standin, monkeypatch):
    model, _ = standin
    monkeypatch.setenv("FAKE_VLLM_FAIL", "Available memory on node 0 is less than desired")
    server = vs.VllmServer(_spec(model)).start()
    with pytest.raises(vs.VllmStartError) as e:
        server.wait_ready(timeout_s=60)
    msg = str(e.value)
    assert "ValueError: Available memory on node 0 is less than desired" in msg
    assert server.log_path in msg and os.path.isfile(server.log_path) and "\n" not in msg
    server.stop()


def test_stop_ends_the_whole_group_even_when_sigterm_is_ignored(standin, monkeypatch):
    model, _ = standin
    monkeypatch.setenv("FAKE_VLLM_IGNORE_TERM", "1")
    server = vs.VllmServer(_spec(model)).start()
    server.wait_ready(timeout_s=60)
    pid = server.proc.pid
    code = server.stop(grace_s=0.5)
    assert code == -signal.SIGKILL
    assert not vs._group_alive(pid)


# ---- the command ------------------------------------------------------------------------------
def test_serve_runs_the_workload_over_vllms_api_and_prints_a_summary(standin, capsys):
    model, log = standin
    assert main(_serve(model, "--workload", "chat", "--num-requests", "6", "--max-num-seqs", "4",
                       vllm=("--enforce-eager",))) == 0
    out, err = capsys.readouterr()
    assert "requests               6" in out or "requests  " in out
    assert "(measured by the client, over vLLM's API)" in out
    assert "2 (vLLM's /metrics)" in out  # the stand-in's preemption counter
    argv = _given(log)["argv"]
    assert argv[argv.index("--max-num-seqs") + 1] == "4" and argv[-1] == "--enforce-eager"
    assert "vLLM ready" in err and "kvscope tui" in err and "vLLM stopped (code 0)" in err


def test_serve_says_where_it_listens_and_how_to_watch(standin, capsys):
    model, _ = standin
    base = _ports()
    assert main(["serve", "--engine", "vllm", "--model", model, "--events", f"tcp://127.0.0.1:{base}",
                 "--workload", "chat", "--num-requests", "2"]) == 0
    err = capsys.readouterr().err
    assert f"kvscope tui --connect tcp://127.0.0.1:{base} --control tcp://127.0.0.1:{base + 1}" in err
    assert f"--kv-events tcp://127.0.0.1:{base + 2} --kv-replay tcp://127.0.0.1:{base + 3}" in err


def test_a_vllm_that_dies_mid_run_is_one_line_and_the_recording_stays_readable(standin, monkeypatch, tmp_path,
                                                                                capsys):
    from kvscope.traces.reader import TraceReader

    model, _ = standin
    monkeypatch.setenv("FAKE_VLLM_DIE_AFTER", "3")
    trace = tmp_path / "run.kvtrace"
    assert main(_serve(model, "--http", f"127.0.0.1:{free_port()}", "--record", str(trace))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvscope: error: vLLM exited (code 3): RuntimeError: the engine core died (log: ")
    reader = TraceReader(str(trace))
    assert reader.complete and not reader.warnings  # closed with its index, though no bye came
    assert sum(1 for ev in reader if ev.type == "step") > 0


def test_a_vllm_that_fails_at_start_ends_serve_with_one_line(standin, monkeypatch, capsys):
    model, _ = standin
    monkeypatch.setenv("FAKE_VLLM_FAIL", "no memory")
    assert main(_serve(model, "--http", f"127.0.0.1:{free_port()}")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvscope: error: vLLM exited while starting (code 1): ValueError: no memory (log: ")


@pytest.mark.parametrize("args,word", [
    (["--json", "x.json"], "--json"), (["--control", "ipc:///tmp/x"], "tcp://HOST:PORT"),
    (["--quantization", "gguf"], "--quantization"), (["--", "--port", "1"], "--port"),
    (["--model", "tiny"], "built into kvscope"), (["--", "-dp", "x"], "data-parallel-size")])
def test_bad_flags_are_one_line(standin, capsys, args, word):
    model, _ = standin
    argv = ["serve", "--engine", "vllm", "--model", model, *args]
    if "--model" in args:
        argv = ["serve", "--engine", "vllm", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and word in err[0] and err[0].startswith("kvscope: error:")


def test_vllm_flags_without_engine_vllm_are_refused(capsys):
    assert main(["serve", "--model", "tiny", "--", "--enforce-eager"]) == 2
    assert "go with --engine vllm" in capsys.readouterr().err


# ---- the bench peer ---------------------------------------------------------------------------
def test_the_bench_peer_sends_every_request_at_once_and_compares_greedy_tokens(standin, monkeypatch):
    from kvscope.bench import vllm_peer
    from kvscope.engine.config import EngineConfig
    from kvscope.workload.generate import WorkloadRequest

    model, log = standin
    monkeypatch.setattr(vf, "checkpoint", lambda m, dtype: model)
    items = [WorkloadRequest(0.0, [5, 6, 10 * (i + 1)], max_tokens=4 + i) for i in range(4)]
    # the stand-in's greedy tokens are prompt[-1] + k: two requests agree, one differs at token 2, one is missing
    reference = {(5, 6, 10): [10, 11, 12, 13], (5, 6, 20): [20, 21, 99, 23, 24], (5, 6, 30): [30, 31, 32, 33, 34, 35]}
    row = vllm_peer.vllm_row(EngineConfig(model="smollm2-135m", max_num_seqs=4, max_num_batched_tokens=256), items,
                             threads=1, reference=reference, log=lambda m: None)
    assert row.name == "vllm" and row.output_tokens == sum(it.max_tokens for it in items)
    assert row.ttft_p99_s >= row.ttft_p50_s > 0 and row.output_tok_per_s > 0
    assert (row.extra["greedy_compared"], row.extra["greedy_same"], row.extra["greedy_first_diff_p50"]) == (3, 2, 2)
    assert row.preemptions == 0  # vLLM's counter, before and after the run (the stand-in's stays at 2)
    given = [json.loads(ln) for ln in log.read_text().splitlines()][0]
    argv = given["argv"]
    assert argv[argv.index("--max-num-seqs") + 1] == "4" and argv[argv.index("--max-num-batched-tokens") + 1] == "256"
    assert "--no-enable-prefix-caching" in argv and given["env"]["VLLM_CPU_OMP_THREADS_BIND"] is not None


def test_the_bench_peer_refuses_a_model_vllm_cannot_load(standin):
    from kvscope.bench import vllm_peer
    from kvscope.engine.config import EngineConfig

    with pytest.raises(KvscopeError, match="built into kvscope"):
        vllm_peer.check_available(EngineConfig(model="tiny"))


# ---- the demo ---------------------------------------------------------------------------------
def test_the_demo_on_vllm_is_serve_forever_with_vllms_flags_last():
    from kvscope.cli.main import build_parser
    from kvscope.tui.launch.demo import vllm_demo_command

    cmd = vllm_demo_command("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    assert cmd[1:4] == ["-m", "kvscope.cli", "serve"]
    args = build_parser().parse_args(cmd[3:])  # what the child's serve parses
    assert (args.engine, args.forever, args.workload, args.model) == ("vllm", True, "demo", "smollm2-135m")
    assert (args.events, args.control) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    assert args.vllm_args == ["--max-model-len", "2048"] and vf.check_vllm_args(args.vllm_args) == 1


def test_the_demo_on_vllm_without_its_venv_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(vf.PYTHON_ENV, str(tmp_path / "absent"))
    assert main(["demo", "--engine", "vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "make vllm-cpu" in err[0]
    assert main(["demo", "--engine", "vllm", "--sim"]) == 2
    assert "leave out --sim" in capsys.readouterr().err


def test_kv_events_are_relayed_unchanged_from_vllms_inside_port_to_loopback():
    """vLLM 0.32 connects its KV-event PUB to a non-wildcard endpoint: the relay binds there and republishes."""
    import zmq

    inside, outside = f"tcp://127.0.0.1:{_ports(1)}", f"tcp://127.0.0.1:{_ports(1)}"
    relay = vp.KvEventsRelay([(inside, outside)])
    ctx = zmq.Context.instance()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    try:
        pub.connect(inside)  # as vLLM's ZmqEventPublisher does with tcp://127.0.0.1:P
        sub.connect(outside)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        frames = [b"", (7).to_bytes(8, "big"), b"\x93payload"]
        got = []

        def arrived() -> bool:
            pub.send_multipart(frames)  # PUB/SUB drops until the subscription has travelled up the relay
            if sub.poll(50):
                got.append(sub.recv_multipart())
            return bool(got)

        assert wait_for(arrived, timeout=30)
        assert got[0] == frames
    finally:
        pub.close(0)
        sub.close(0)
        relay.close()
    with pytest.raises(ValueError):
        vp.KvEventsRelay([(inside, "tcp://0.0.0.0:5999")])  # loopback only unless allowed


def test_the_vllm_venv_is_looked_for_at_the_checkout_root(tmp_path, monkeypatch):
    """Without $KVSCOPE_VLLM_PYTHON, .venv-vllm is found beside the kvscope package (where `make vllm-cpu`
    puts it), whatever the working directory."""
    from kvscope.vllm.launch import flags

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert flags.checkout_root() == root
    monkeypatch.delenv(flags.PYTHON_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    here = os.path.join(root, flags.VENV, "bin", "python")
    if os.path.isfile(here):
        assert flags.vllm_python() == here
    else:
        with pytest.raises(KvscopeError, match="make vllm-cpu"):
            flags.vllm_python()
