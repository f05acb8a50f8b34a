"""The CPU thread defaults, as measured by bench/thread_sweep.py: every core for the engine alone,
every core but one beside the demo's dashboard; reported in hello, and the same for the bench's peers."""

from __future__ import annotations

import pytest
import torch

from kvscope.engine.config import EngineConfig, usable_cores
from kvscope.engine.model_backend import default_cpu_threads
from kvscope.tui.demo import demo_command, demo_threads


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
        assert engine.hello().config.cpu_threads == cores == torch.get_num_threads()
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
        assert engine.hello().config.cpu_threads == 1 == torch.get_num_threads()
    finally:
        engine.close()
