"""benchmarks/gpu_check.py on a CPU: the --dry-run walk-through of every section (tiny shapes, Triton
interpreter, tiny model), the imports the GPU image allows, and the step-split bookkeeping with fake
timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")

# The GPU image's python has torch, triton and transformers, not these: a sitecustomize that refuses them
# (children inherit it through PYTHONPATH, as gpu_check runs each section in a child process).
BLOCKER = '''import os, sys
BLOCKED = tuple(os.environ["GPU_CHECK_TEST_BLOCK"].split(","))
class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not installed on the GPU image")
        return None
sys.meta_path.insert(0, _Refuse())
'''


def run_dry(tmp_path, sections: str, blocked: str):
    block_dir = tmp_path / "block"
    block_dir.mkdir(exist_ok=True)
    (block_dir / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, TRITON_INTERPRET="1", GPU_CHECK_TEST_BLOCK=blocked,
               PYTHONPATH=os.pathsep.join([str(block_dir), ROOT, os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--out", str(out), "--sections", sections],
                          capture_output=True, text=True, env=env, timeout=300)
    return proc, json.loads((out / "gpu-check-dry-run.json").read_text())


def test_gpu_check_dry_run_writes_its_json_shape_and_survives_a_failing_section(tmp_path):
    proc, result = run_dry(tmp_path, "correctness,bogus,decode,e2e:chunked", blocked="zmq,textual")
    # "bogus" fails in its own child process; the sections after it still run
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert list(result["errors"]) == ["bogus"], result["errors"]
    assert {"gpu", "versions", "decode", "e2e", "step_split"} <= result.keys()
    assert result["versions"]["torch"] and result["versions"]["triton"]
    assert result["correctness"] and all(r["ok"] for r in result["correctness"])
    assert {"write_kv", "paged_attention", "paged_attention window=24", "decode splits=4",
            "prefill"} <= {r["kernel"] for r in result["correctness"]}
    # 2 batch sizes x 2 contexts as dispatched, and the one-pass kernel forced where split-K was chosen
    assert [(r["B"], r["ctx"], r["kernel"], r["forced"]) for r in result["decode"]] == [
        (1, 40, "one-pass", False), (3, 40, "one-pass", False), (1, 300, "split-k", False),
        (1, 300, "one-pass", True), (3, 300, "one-pass", False)]
    for row in result["decode"]:
        assert {"B", "ctx", "num_splits", "ms", "gbps", "sdpa_gbps", "vs_sdpa", "copy_gbps", "graph_ms",
                "vs_sdpa_graph"} <= row.keys()
        assert row["ms"] > 0 and row["gbps"] > 0
        assert row["graph_ms"] is None  # no CUDA graphs on a CPU
    assert [r["name"] for r in result["e2e"]] == ["chunked"]
    assert all(r["output_tok_per_s"] > 0 for r in result["e2e"])
    # the roofline of the chunked run's own steps, at the device's measured peaks
    assert result["roofline"]["peaks"]["flops_per_s"] > 0 and result["roofline"]["peaks"]["bytes_per_s"] > 0
    assert result["e2e"][0]["roofline_s"] > 0 and result["e2e"][0]["roofline_pct"] > 0
    assert os.path.getsize(result["trace"]["path"]) > 0
    # every step of the chunked run, split at its forward's launch, per kind, beside its roofline
    split = result["step_split"]["chunked"]
    assert {"decode", "all"} <= split.keys() and set(split) <= {"decode", "mixed", "prefill", "all"}
    assert split["all"]["steps"] == sum(split[k]["steps"] for k in split if k != "all")
    for g in split.values():
        assert g["device_s"] > 0 and g["roofline_s"] > 0 and g["graph_steps"] == 0
        assert g["host_before_s"] + g["launch_s"] + g["host_after_s"] == pytest.approx(g["wall_s"], rel=1e-6)


def test_gpu_check_needs_no_pyzmq_textual_or_msgspec_for_its_kernel_sections(tmp_path):
    """Without msgspec the kernel table still runs, and the e2e section says what it lacks."""
    proc, result = run_dry(tmp_path, "decode,e2e:chunked", blocked="zmq,textual,msgspec")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(result["decode"]) == 5
    assert list(result["errors"]) == ["e2e:chunked"]
    assert "needs msgspec" in result["errors"]["e2e:chunked"]


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class FakeEvent:
    """A CUDA event stand-in: record() notes the device time the test has set."""

    device_now = 0.0

    def record(self):
        self.at = FakeEvent.device_now

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return end.at - self.at


def fake_out(decodes: int, prefills: int):
    return SimpleNamespace(decodes=[0] * decodes, other_seqs=[0] * prefills, pad_rows=[],
                           shape=(decodes, prefills))


def test_step_split_bookkeeping_and_json_with_fake_timings(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    from kvscope.engine.worker.step_timer import StepTimer

    clock = FakeClock()
    timer = StepTimer(make_event=FakeEvent, clock=clock, shape_of=lambda out: out.shape)

    def step(out, before, launch, device, after, graph=False):
        timer.step_begins()
        clock.t += before / 1e3
        timer.forward_begins(out, graph=graph)
        FakeEvent.device_now += 0.0
        start_dev = FakeEvent.device_now
        clock.t += launch / 1e3
        FakeEvent.device_now = start_dev + device
        timer.forward_ends()
        # the host waits for the device (sampling), then works on
        clock.t += max(0.0, device - launch) / 1e3 + after / 1e3
        timer.step_ends()

    step(fake_out(4, 0), before=2.0, launch=0.1, device=4.0, after=8.0, graph=True)  # a graph replay
    step(fake_out(4, 0), before=2.0, launch=0.1, device=6.0, after=6.0, graph=True)
    step(fake_out(2, 1), before=3.0, launch=9.0, device=7.0, after=5.0)  # eager: launching outlasts the GPU
    timer.step_begins()
    timer.step_ends()  # an empty step: no forward, not counted

    check = gpu_check.Check(str(tmp_path), dry_run=True)
    split = check.record_step_split("chunked", timer, price=lambda shape: 1e-3 * (shape[0] + 2 * shape[1]))
    written = json.loads((tmp_path / "gpu-check-dry-run.json").read_text())["step_split"]["chunked"]
    assert written == json.loads(json.dumps(split))
    dec, mixed, every = written["decode"], written["mixed"], written["all"]
    assert (dec["steps"], dec["graph_steps"], mixed["steps"], every["steps"]) == (2, 2, 1, 3)
    assert "prefill" not in written
    assert dec["host_before_ms"]["mean"] == pytest.approx(2.0)
    assert dec["device_ms"]["mean"] == pytest.approx(5.0) and dec["device_ms"]["p90"] == pytest.approx(6.0)
    assert dec["host_after_ms"]["mean"] == pytest.approx(7.0)
    assert dec["wall_ms"]["mean"] == pytest.approx(2.0 + 5.0 + 7.0)  # before + max(launch, device) + after
    assert mixed["launch_ms"]["mean"] == pytest.approx(9.0) and mixed["device_ms"]["mean"] == pytest.approx(7.0)
    assert mixed["wall_ms"]["mean"] == pytest.approx(3.0 + 9.0 + 5.0)
    assert dec["device_share"] == pytest.approx(10.0 / 28.0)
    assert dec["host_share"] == pytest.approx((4.0 + 14.0) / 28.0)
    assert dec["roofline_s"] == pytest.approx(8e-3) and mixed["roofline_s"] == pytest.approx(4e-3)
    assert every["roofline_pct"] == pytest.approx(100 * 12e-3 / 45e-3)
    assert dec["device_vs_roofline"] == pytest.approx(10.0 / 8.0)
