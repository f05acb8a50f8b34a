"""The CPU thread defaults, as measured by benchmarks/thread_sweep.py: every core for the engine alone,
every core but one beside the demo's dashboard; reported in hello, and the same for the bench's peers."""

from __future__ import annotations

import pytest
import torch

from kvscope.engine.config import EngineConfig, usable_cores
from kvscope.engine.worker.model_backend import default_cpu_threads
from kvscope.tui.launch.demo import demo_command, demo_threads


@pytest.mark.parametrize("cores,alone,beside_dashboard", [(1, 1, 1), (2, 2, 1), (16, 16, 15)])
def test_defaults_by_core_count(cores, alone, beside_dashboard):
    assert default_cpu_threads(cores) == alone
    assert demo_threads(cores) == beside_dashboard


def test_usable_cores_is_the_affinity_mask():
    import os

    mask = getattr(os, "sched_getaffinity", None)
    assert usable_cores() == (len(mask(0)) if mask else os.cpu_count())


def test_the_demo_engine_leaves_its_dashboard_a_core_unless_told_otherwise():
    cmd = demo_command("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
    assert cmd[cmd.index("--cpu-threads") + 1] == str(demo_threads())
    cmd = demo_command("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", extra_args=("--cpu-threads", "7"))
    assert cmd[len(cmd) - 1 - cmd[::-1].index("--cpu-threads") + 1] == "7"  # argparse keeps the last


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_hello_reports_the_threads_chosen_and_the_peers_use_them(restore_threads):
    from kvscope.bench.peers import _hf_model
    from kvscope.engine.llm_engine import LLMEngine

    config = EngineConfig(model="tiny", device="cpu", num_blocks=64)
    engine = LLMEngine(config)
    try:
        cores = usable_cores()
        assert engine.hello().config.cpu.threads == cores == torch.get_num_threads()
        torch.set_num_threads(1 if cores > 1 else 2)
        _hf_model(config)
        assert torch.get_num_threads() == cores  # the peer runs with kvscope's thread count
    finally:
        engine.close()


def test_an_explicit_thread_count_wins(restore_threads):
    from kvscope.engine.llm_engine import LLMEngine

    config = EngineConfig(model="tiny", device="cpu", num_blocks=64, cpu_threads=1)
    engine = LLMEngine(config)
    try:
        assert engine.hello().config.cpu.threads == 1 == torch.get_num_threads()
    finally:
        engine.close()


# ---- the online thread choice (kvscope/engine/cpu/threads.py) -------------------------------------------
def _drive(tuner, seconds_per_work: dict[int, float], steps: int, work: float = 1.0) -> list[int]:
    """Run `steps` steps whose time per unit of work depends on the thread count in use; returns the counts."""
    used = []
    for _ in range(steps):
        tuner.before_step()
        used.append(tuner.current)
        tuner.after_step(seconds_per_work[tuner.current] * work, work)
    return used


def test_the_tuner_moves_to_one_thread_when_all_cores_collapse():
    from kvscope.engine.cpu.threads import ThreadTuner

    applied = []
    tuner = ThreadTuner([1, 2], applied.append, probe_pairs=4, first_gap=8)
    used = _drive(tuner, {2: 6.5, 1: 1.0}, 200)  # a competitor: two threads 6.5x slower (as measured beside a busy loop)
    assert tuner.best == 1 and applied[0] == 2
    assert used[-100:].count(2) <= 4  # and it stays there while it wins: one short probe at most
    # what the probes cost: well under 10% of the steps ran on the slow count
    assert used.count(2) < 0.1 * len(used) + 12  # the first window and probe before the switch


def test_the_tuner_keeps_every_core_when_they_win_and_probes_less_and_less():
    from kvscope.engine.cpu.threads import ThreadTuner

    tuner = ThreadTuner([1, 2], lambda n: None, probe_pairs=4, first_gap=8, max_gap=256)
    used = _drive(tuner, {2: 1.0, 1: 1.6}, 2000)
    assert tuner.best == 2 and tuner.switches == 0
    assert tuner.gap == 256
    assert used.count(1) < 0.05 * len(used)


def test_the_tuner_follows_a_competitor_that_comes_and_goes():
    from kvscope.engine.cpu.threads import ThreadTuner

    tuner = ThreadTuner([1, 2], lambda n: None, probe_pairs=4, first_gap=8, max_gap=64)
    _drive(tuner, {2: 1.0, 1: 1.6}, 300)
    assert tuner.best == 2
    _drive(tuner, {2: 6.5, 1: 1.1}, 300)  # the competitor starts
    assert tuner.best == 1
    _drive(tuner, {2: 1.0, 1: 1.6}, 300)  # and stops
    assert tuner.best == 2 and tuner.switches == 2


def test_steps_of_different_sizes_compare_by_their_priced_work():
    from kvscope.engine.cpu.threads import ThreadTuner

    # one thread gets the big steps and two threads the small ones; per unit of work two threads are faster
    tuner = ThreadTuner([1, 2], lambda n: None, probe_pairs=4, first_gap=8)
    for i in range(400):
        tuner.before_step()
        work = 10.0 if tuner.current == 1 else 1.0
        tuner.after_step(work * (1.0 if tuner.current == 2 else 1.5), work)
    assert tuner.best == 2


def test_without_cpu_threads_the_engine_tunes_and_with_it_does_not(restore_threads):
    from kvscope.engine.llm_engine import LLMEngine

    auto = LLMEngine(EngineConfig(model="tiny", device="cpu", num_blocks=64))
    fixed = LLMEngine(EngineConfig(model="tiny", device="cpu", num_blocks=64, cpu_threads=1))
    try:
        assert fixed.runner.tuner is None
        if usable_cores() > 1:
            assert auto.runner.tuner is not None and auto.runner.tuner.tuner.candidates == [usable_cores(), 1]
    finally:
        auto.close()
        fixed.close()


def test_idle_torch_threads_spin_briefly_unless_the_user_chose():
    import os
    import subprocess
    import sys

    code = ("import kvscope.engine.worker.model_backend, os; "
            "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None 20000"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_WAIT_POLICY": "PASSIVE"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "PASSIVE None"  # the user's policy, untouched
    out = subprocess.run([sys.executable, "-c", code], env={**env, "GOMP_SPINCOUNT": "5"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None 5"


def test_every_command_spins_briefly_even_one_that_imports_torch_early():
    """libgomp reads its wait policy once, when torch loads it: `kvscope bench` imported torch before the model
    backend (which sets it) and kept libgomp's long spins. libgomp's own report (OMP_DISPLAY_ENV) says what it
    got: a spin count of 20000 (its default, left unset, is 300000)."""
    import os
    import subprocess
    import sys

    code = "import kvscope.cli.bench, torch; torch.ones(8).sum()"  # the command line, then torch before the engine
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_DISPLAY_ENV": "VERBOSE"},
                         capture_output=True, text=True, check=True)
    assert "GOMP_SPINCOUNT = '20000'" in out.stderr
    bare = subprocess.run([sys.executable, "-c", "import torch; torch.ones(8).sum()"],
                          env={**env, "OMP_DISPLAY_ENV": "VERBOSE"}, capture_output=True, text=True, check=True)
    assert "GOMP_SPINCOUNT = '20000'" not in bare.stderr, "without kvscope, libgomp spins longer before it sleeps"


def test_the_tuner_compares_like_for_like_steps_when_time_is_not_proportional_to_work():
    """The tiny model's steps cost mostly a fixed host overhead, so seconds per priced unit of work swing
    with the batch (prefill-heavy stretches look cheap per unit, decode stretches dear). Comparing a probe
    window with a baseline window of other batches then decided by the batch, not the thread count (a loaded
    bench kept 2 threads at 440 tok/s against one thread's 827); adjacent pairs do not."""
    from kvscope.engine.cpu.threads import ThreadTuner

    factor = {2: 3.0, 1: 1.0}  # a competitor: two threads three times slower
    tuner = ThreadTuner([1, 2], lambda n: None)  # the engine's defaults
    used = []
    for step in range(300):
        work = 50.0 if (step // 6) % 2 == 0 else 1.0  # prefill stretches and decode stretches
        tuner.before_step()
        used.append(tuner.current)
        tuner.after_step((0.002 + 0.0001 * work) * factor[tuner.current], work)
    assert tuner.best == 1 and tuner.history[0][0] < 30  # found at the first probe, a few steps in
    # what a short loaded run pays: the steps before the first probe, its pairs, then two steps per
    # later probe of the clear loser (a run of a few hundred steps lost a quarter of its speed to
    # probes that started 32 steps in, restarted short after the switch and ran the loser 4 steps each)
    assert used.count(2) <= 22


def test_rare_long_stalls_count_because_they_are_the_loss():
    """A competitor costs a parallel step mostly when it deschedules one of its threads for a time slice:
    most two-thread steps run at full speed and one in three takes ten times as long. Two threads are
    then slower on the whole (4.0 per unit of work against one thread's 1.3), though a median of pairs,
    which the tuner used before, would see only the fast steps and keep them."""
    from kvscope.engine.cpu.threads import ThreadTuner

    tuner = ThreadTuner([1, 2], lambda n: None)  # the engine's defaults
    on_two = 0
    used = []
    for _ in range(300):
        tuner.before_step()
        used.append(tuner.current)
        if tuner.current == 2:
            on_two += 1
            cost = 10.0 if on_two % 3 == 0 else 1.0
        else:
            cost = 1.3
        tuner.after_step(cost, 1.0)
    assert tuner.best == 1 and tuner.history[0][0] < 30
    assert used[100:].count(2) <= 12, "later probes of the stalling count end after two pairs"


def test_a_clear_win_switches_after_two_pairs():
    from kvscope.engine.cpu.threads import ThreadTuner

    tuner = ThreadTuner([1, 2], lambda n: None)
    used = _drive(tuner, {2: 3.0, 1: 1.0}, 40)
    first_probe = used.index(1)
    assert tuner.best == 1 and tuner.history[0][0] == first_probe + 3, "decided on its second pair"
    assert used[first_probe + 3 :].count(2) == 0, "no third pair on the collapsed count"


# ---- other processes' load (kvscope/engine/cpu/load.py) --------------------------------------------------
def test_other_processes_load_is_the_machines_busy_time_less_this_process():
    from kvscope.engine.cpu.load import CpuSample, others_busy, read_busy_s

    a = CpuSample(busy_s=100.0, own_s=10.0, t=50.0)
    b = CpuSample(busy_s=103.0, own_s=11.0, t=51.0)  # 3 busy seconds in one second, one of them ours
    assert others_busy(a, b) == 2.0
    assert others_busy(a, CpuSample(100.5, 11.0, 51.0)) == 0.0, "never below zero (the two clocks' rounding)"
    assert others_busy(a, CpuSample(101.0, 10.0, 50.01)) is None, "too short a window to say"


def test_proc_stat_is_read_without_nice_idle_or_steal(tmp_path):
    from kvscope.engine.cpu.load import read_busy_s

    stat = tmp_path / "stat"
    stat.write_text("cpu  700 9000 200 5000 40 30 20 800 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    assert read_busy_s(str(stat), ticks=100) == (700 + 200 + 30 + 20) / 100
    for bad in ("", "intr 1 2 3\n", "cpu  a b c d e f g h\n", "cpu 1 2\n"):
        stat.write_text(bad)
        assert read_busy_s(str(stat)) is None
    assert read_busy_s(str(tmp_path / "missing")) is None


def test_a_busy_process_reads_as_about_a_core():
    """One CPU-bound child process, measured over half a second: at least half a core (it has a core to
    itself while this test sleeps; a busier machine only reads higher)."""
    import subprocess
    import sys
    import time

    from kvscope.engine.cpu.load import OtherLoad, read_busy_s

    if read_busy_s() is None:
        pytest.skip("no /proc/stat here")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # let it take its core
        load = OtherLoad()
        time.sleep(0.5)
        assert load.busy_cores() >= 0.5
    finally:
        busy.kill()
        busy.wait()


class _ScriptedLoad:
    """Other processes' cores, one reading per call, as the tuner asks for them."""

    def __init__(self, readings):
        self.readings = list(readings)
        self.calls = 0

    def busy_cores(self):
        self.calls += 1
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]


def test_the_tuner_starts_on_fewer_threads_where_a_core_was_busy_while_the_model_loaded():
    from kvscope.engine.cpu.threads import ThreadTuner

    applied = []
    tuner = ThreadTuner([1, 2], applied.append, load=_ScriptedLoad([1.0]))
    used = _drive(tuner, {2: 3.0, 1: 1.0}, 60)
    assert used[0] == 1 and tuner.history[0] == (0, 1) and applied[:2] == [2, 1]
    assert used[:20].count(2) == 2, "the first probe of both cores is a clear loss after two pairs"
    assert tuner.best == 1 and tuner.switches == 0

    quiet = ThreadTuner([1, 2], lambda n: None, load=_ScriptedLoad([0.1]))
    assert _drive(quiet, {2: 1.0, 1: 1.6}, 60)[0] == 2 and quiet.switches == 0


def test_a_competitor_that_arrives_late_brings_the_next_probe_forward():
    """Quiet for 600 steps (the gap between probes has grown to 128), then a competitor: the load reading
    sees it within LOAD_EVERY steps and the tuner probes at once, instead of up to 128 steps later."""
    from kvscope.engine.cpu.threads import LOAD_EVERY, ThreadTuner

    load = _ScriptedLoad([0.0])
    tuner = ThreadTuner([1, 2], lambda n: None, max_gap=128, load=load)
    _drive(tuner, {2: 1.0, 1: 1.6}, 600)
    assert tuner.best == 2 and tuner.gap == 128
    load.readings = [1.0]  # the competitor starts
    _drive(tuner, {2: 3.0, 1: 1.0}, 60)
    assert tuner.best == 1 and tuner.history[-1][0] <= 600 + LOAD_EVERY + 4, "read, probed (two pairs), switched"

    without = ThreadTuner([1, 2], lambda n: None, max_gap=128)  # the same, reading no load
    _drive(without, {2: 1.0, 1: 1.6}, 600)
    _drive(without, {2: 3.0, 1: 1.0}, 60)
    assert without.best == 2, "probes alone would not have looked yet"


def test_on_a_quiet_machine_two_lucky_pairs_do_not_switch():
    """Tiny steps are noisy: two pairs can make one thread look 2x faster by chance. Where the kernel says
    nobody else is busy, a probe runs its four pairs before deciding (here the last two undo the first)."""
    from kvscope.engine.cpu.threads import ThreadTuner

    def run(load):
        tuner = ThreadTuner([1, 2], lambda n: None, first_gap=8, max_gap=8, load=load)
        one_thread_steps = 0
        for _ in range(40):
            tuner.before_step()
            if tuner.current == 1:
                one_thread_steps += 1
                cost = 0.5 if one_thread_steps % 4 in (1, 2) else 2.5  # lucky twice, then not
            else:
                cost = 1.0
            tuner.after_step(cost, 1.0)
        return tuner

    assert run(_ScriptedLoad([0.0])).switches == 0
    assert run(None).switches >= 1, "without a reading, a clear case is still decided after two pairs"


def test_beside_a_competitor_it_stops_asking_every_core_until_the_load_changes():
    from kvscope.engine.cpu.threads import LOAD_EVERY, ThreadTuner

    load = _ScriptedLoad([1.0])
    tuner = ThreadTuner([1, 2], lambda n: None, load=load)
    used = _drive(tuner, {2: 3.0, 1: 1.0}, 400)
    assert tuner.best == 1 and used[0] == 1
    assert used.count(2) == 2, "one probe of every core (a clear loss after two pairs), then none"
    load.readings = [0.0]  # the competitor leaves
    _drive(tuner, {2: 1.0, 1: 1.6}, 60)
    assert tuner.best == 2 and tuner.history[-1][0] <= 400 + LOAD_EVERY + 8, "read, probed (four pairs), switched"


# ---- an explicit --cpu-threads N: a ceiling, left only beside a competitor ------------------
def test_an_explicit_count_is_held_on_a_quiet_machine_even_where_fewer_would_win():
    from kvscope.engine.cpu.threads import ThreadTuner

    for load in (_ScriptedLoad([0.0]), None):  # quiet, or no reading at all: exactly the count asked for
        tuner = ThreadTuner([1, 2], lambda n: None, load=load, only_beside_competitor=True)
        used = _drive(tuner, {2: 3.0, 1: 1.0}, 200)
        assert set(used) == {2} and tuner.switches == 0


def test_an_explicit_count_drops_beside_a_competitor_and_comes_back_when_it_leaves():
    from kvscope.engine.cpu.threads import LOAD_EVERY, ThreadTuner

    load = _ScriptedLoad([0.0])
    tuner = ThreadTuner([1, 2], lambda n: None, load=load, only_beside_competitor=True)
    assert set(_drive(tuner, {2: 1.0, 1: 1.6}, 100)) == {2}
    load.readings = [1.0]  # a busy loop starts: two threads now collapse
    used = _drive(tuner, {2: 3.0, 1: 1.0}, 200)
    assert tuner.best == 1 and used[-100:] == [1] * 100
    load.readings = [0.0]  # it leaves: back to the count asked for, without a probe
    used = _drive(tuner, {2: 1.0, 1: 1.6}, 2 * LOAD_EVERY)
    assert tuner.best == 2 and used[-LOAD_EVERY:] == [2] * LOAD_EVERY


def test_an_explicit_count_tunes_unless_the_user_fixes_it(restore_threads, monkeypatch):
    from kvscope.engine.cpu.threads import FIXED_THREADS_ENV
    from kvscope.engine.llm_engine import LLMEngine

    monkeypatch.delenv(FIXED_THREADS_ENV, raising=False)
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", num_blocks=64, cpu_threads=2))
    try:
        tuner = engine.runner.tuner.tuner
        assert tuner.candidates == [2, 1] and tuner.only_beside_competitor
        assert engine.hello().config.cpu.threads == 2
    finally:
        engine.close()
    monkeypatch.setenv(FIXED_THREADS_ENV, "1")
    fixed = LLMEngine(EngineConfig(model="tiny", device="cpu", num_blocks=64, cpu_threads=2))
    try:
        assert fixed.runner.tuner is None and torch.get_num_threads() == 2
    finally:
        fixed.close()
