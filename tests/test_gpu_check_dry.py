"""benchmarks/gpu_check.py --dry-run walks every section on CPU (tiny shapes, Triton interpreter, tiny model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_dry_run_writes_its_json_shape_and_survives_a_failing_section(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--dry-run", "--out",
                           str(tmp_path), "--sections", "correctness,bogus,decode,e2e:chunked"], capture_output=True, text=True, env=env,
                          timeout=300)
    # "bogus" fails in its own child process; the sections after it still run
    assert proc.returncode == 1, proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu-check-dry-run.json").read_text())
    assert list(result["errors"]) == ["bogus"], result["errors"]
    assert {"gpu", "versions", "decode", "e2e"} <= result.keys()
    assert result["versions"]["torch"] and result["versions"]["triton"]
    assert result["correctness"] and all(r["ok"] for r in result["correctness"])
    assert {"write_kv", "paged_attention", "paged_attention window=24", "decode splits=4",
            "prefill"} <= {r["kernel"] for r in result["correctness"]}
    assert len(result["decode"]) == 4
    for row in result["decode"]:
        assert {"B", "ctx", "ms", "gbps", "sdpa_gbps", "copy_gbps"} <= row.keys()
        assert row["ms"] > 0 and row["gbps"] > 0
    assert [r["name"] for r in result["e2e"]] == ["chunked"]
    assert all(r["output_tok_per_s"] > 0 for r in result["e2e"])
    # the roofline of the chunked run's own steps, at the device's measured peaks
    assert result["roofline"]["peaks"]["flops_per_s"] > 0 and result["roofline"]["peaks"]["bytes_per_s"] > 0
    assert result["e2e"][0]["roofline_s"] > 0 and result["e2e"][0]["roofline_pct"] > 0
    assert os.path.getsize(result["trace"]["path"]) > 0
