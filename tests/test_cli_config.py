"""The CLI's engine flags come from EngineConfig: one flag per field, help from the field's
metadata, every enumerated flag with its choices, and the config's own defaults."""

from __future__ import annotations

import ast
import dataclasses
import os

import pytest

from kvscope.cli import build_parser
from kvscope.cli.common import engine_config as _engine_config
from kvscope.engine.config import (BACKENDS, DTYPES, KV_CACHE_DTYPES, MODES, POLICIES, PREEMPTION_MODES,
                                   EngineConfig)
from kvscope.engine.sim.catalog import GPUS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _actions(command: str) -> dict[str, object]:
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return {a.dest: a for a in sub.choices[command]._actions}


@pytest.mark.parametrize("command", ["serve", "bench", "race"])
def test_every_config_field_is_a_flag_with_its_help(command):
    actions = _actions(command)
    for f in dataclasses.fields(EngineConfig):
        assert f.name in actions, f"--{f.name.replace('_', '-')} missing from {command}"
        action = actions[f.name]
        assert action.option_strings[0] == "--" + f.name.replace("_", "-")
        assert f.metadata["help"] in action.help
        assert action.default is None  # so the config's default applies, and presets see what was given


def test_enumerated_flags_list_their_choices():
    actions = _actions("serve")
    assert tuple(actions["mode"].choices) == MODES
    assert tuple(actions["dtype"].choices) == DTYPES
    assert tuple(actions["backend"].choices) == BACKENDS
    assert tuple(actions["preemption"].choices) == PREEMPTION_MODES
    assert tuple(actions["kv_cache_dtype"].choices) == KV_CACHE_DTYPES
    assert tuple(actions["gpu"].choices) == tuple(GPUS)  # config.SIM_GPUS, kept equal to the catalog
    # a policy may also be module:Class, so argparse cannot check it; the help lists the built-ins
    assert actions["policy"].metavar == "{" + ",".join(POLICIES + ("module:Class",)) + "}"


def test_no_flag_means_the_config_default_and_flags_reach_the_config():
    parse = build_parser().parse_args
    assert _engine_config(parse(["serve"])) == EngineConfig()
    config = _engine_config(parse(["serve", "--mode", "static", "--num-blocks", "1e3", "--swap-space", "0.5",
                                   "--enforce-eager", "--no-prefix-caching", "--backend", "model"]))
    assert (config.mode, config.num_blocks, config.swap_space, config.enforce_eager) == ("static", 1000, 0.5, True)


def test_commands_that_need_no_engine_load_no_torch():
    import subprocess
    import sys

    code = ("import sys; from kvscope.cli import main; main(['trace-info', sys.argv[1]]); "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('kvscope.engine.loader.models', "
            "'kvscope.engine.llm_engine', 'kvscope.engine.sim.catalog'))]; print('LOADED', bad)")
    out = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "traces", "calib-cpu.kvtrace")],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert "LOADED []" in out.stdout, out.stdout + out.stderr


def test_argparse_is_used_by_the_cli_only():
    users = []
    for folder, _, files in os.walk(os.path.join(ROOT, "kvscope")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            tree = ast.parse(open(path, encoding="utf-8").read())
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if "argparse" in names:
                    users.append(os.path.relpath(path, ROOT))
    # kvscope/tui/screenshots.py is the developer script behind `make screenshots`, not a user command
    assert all(u.startswith("kvscope/cli/") or u == "kvscope/tui/screenshots.py" for u in users), users
