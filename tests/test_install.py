"""A non-editable install works: the wheel carries what the package reads (the C++ sources, the anchors, the
presets, the styles), and the commands run from it, away from the source tree.

The wheel is built from this checkout (`pip wheel --no-deps --no-build-isolation`, no network) and installed
with `pip install --no-deps --target`: the dependencies are this interpreter's, the package is the wheel's.
Every command runs in an empty folder with only the installed copy on its path, and each checks that the
kvscope it imported is the installed one.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(ROOT, "traces", "demo-cpu.kvtrace")
HEADLESS = (
    "import asyncio, sys\n"
    "from textual.app import App\n"
    "def headless(self, *a, **k):  # the real app, headless: until its feed shows {steps} steps, then quit\n"
    "    async def go():\n"
    "        async with self.run_test() as pilot:\n"
    "            for _ in range(600):\n"
    "                await pilot.pause(0.1)\n"
    "                if self.feeds[0].state.steps_seen >= {steps}:\n"
    "                    break\n"
    "            assert self.feeds[0].state.steps_seen >= {steps}, self.feeds[0].state.steps_seen\n"
    "            assert self.repaints >= 1\n"
    "    asyncio.run(go())\n"
    "App.run = headless\n"
)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    wheels = tmp_path_factory.mktemp("wheel")
    target = tmp_path_factory.mktemp("site")
    src = tmp_path_factory.mktemp("src")  # a copy: a build in the checkout would leave build/ behind, stale later
    shutil.copytree(os.path.join(ROOT, "kvscope"), src / "kvscope", ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml", "README.md", "LICENSE"):
        if os.path.exists(os.path.join(ROOT, f)):
            shutil.copy(os.path.join(ROOT, f), src / f)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(wheels), str(src)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = glob.glob(os.path.join(wheels, "kvscope-*.whl"))
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                           wheel], capture_output=True, text=True, timeout=600)
    assert inst.returncode == 0, inst.stderr[-2000:]
    return str(target), wheel


def _run(site_dir: str, cwd, *args: str, code: str | None = None, timeout: int = 300) -> str:
    env = dict(os.environ, PYTHONPATH=site_dir, PYTHONSAFEPATH="1")
    env.pop("KVSCOPE_EVENTS", None)
    cmd = [sys.executable, "-c", code] if code is not None else [sys.executable, "-m", "kvscope", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(cwd), timeout=timeout)
    assert proc.returncode == 0, (args or code, proc.stdout[-1500:], proc.stderr[-2000:])
    return proc.stdout


def test_the_wheel_carries_what_the_package_reads(site):
    _, wheel = site
    names = set(zipfile.ZipFile(wheel).namelist())
    for csrc in glob.glob(os.path.join(ROOT, "kvscope", "kernels", "cpu", "csrc", "*")):
        assert f"kvscope/kernels/cpu/csrc/{os.path.basename(csrc)}" in names
    assert "kvscope/bench/anchors.json" in names
    assert any(n.startswith("kvscope/bench/presets/") for n in names)
    assert any(n.startswith("kvscope/workload/presets/") for n in names)
    assert any(n.startswith("kvscope/tui/styles/") and n.endswith(".tcss") for n in names)
    assert "kvscope/adapters/vllm_watch.py" in names  # --scheduler-cls's old dotted path


def test_the_installed_package_is_the_one_imported(site, tmp_path):
    site_dir, _ = site
    out = _run(site_dir, tmp_path, code="import kvscope; print(kvscope.__file__)")
    assert out.strip().startswith(site_dir), out


def test_serve_trace_info_and_replay_run_from_the_install(site, tmp_path):
    site_dir, _ = site
    trace = shutil.copy(TRACE, tmp_path / "demo.kvtrace")
    _run(site_dir, tmp_path, "serve", "--backend", "sim", "--model", "qwen3-0.6b", "--num-requests", "4",
         "--no-progress", "--record", "sim.kvtrace")
    assert "steps" in _run(site_dir, tmp_path, "trace-info", "sim.kvtrace")
    _run(site_dir, tmp_path, code=HEADLESS.format(steps=1) +
         f"from kvscope.cli import main\nassert main(['replay', {str(trace)!r}]) == 0\n")


def test_diagnose_names_a_bottleneck_from_the_install(site, tmp_path):
    site_dir, _ = site
    out = _run(site_dir, tmp_path, "diagnose", TRACE, "--no-what-if")
    assert "bottleneck" in out.lower(), out[-1500:]


def test_bench_anchors_reads_the_shipped_anchors(site, tmp_path):
    site_dir, _ = site
    out = _run(site_dir, tmp_path, "bench", "--backend", "sim", "--anchors")
    assert "a800-qwen3-0.6b-vllm" in out, out[-1500:]


def test_the_cpu_kernels_build_key_and_library_come_from_the_installed_sources(site, tmp_path):
    """The installed copy hashes its own csrc/ into the same build key as the source tree, so it finds the
    build `make test` made (or makes one), loads it and runs the attention op."""
    site_dir, _ = site
    code = (
        "import kvscope.kernels.cpu.library as L, os\n"
        "assert L.__file__.startswith(os.environ['PYTHONPATH'])\n"
        "path = L.load()\n"
        "assert path is not None, 'the CPU kernels did not build'\n"
        "print(L.build_dir(L.flag_sets()[0]))\n")
    installed = _run(site_dir, tmp_path, code=code, timeout=900).strip().splitlines()[-1]
    from kvscope.kernels.cpu import library

    assert os.path.basename(installed) == os.path.basename(library.build_dir(library.flag_sets()[0]))


def test_the_demo_runs_from_the_install(site, tmp_path):
    """`kvscope demo`: the engine child is started from the installed copy too, and the dashboard sees it live."""
    site_dir, _ = site
    code = HEADLESS.format(steps=3) + "from kvscope.cli import main\nassert main(['demo']) == 0\n"
    _run(site_dir, tmp_path, code=code, timeout=300)
