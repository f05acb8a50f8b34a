"""Sim bench presets (`kvscope bench --preset NAME|FILE`): JSON data, checked before anything runs.

Two kinds, told apart by their keys: a *modes* preset ("engine", "workload", "modes") runs the
four modes on the sim, as the lesson's comparison does; a *fragmentation* preset
("reserve_tokens", ...) is arithmetic over sampled lengths. Presets are data: an unknown key
or a wrong type is one line, and the engine's policy must be a built-in one (a module:Class
policy comes from the command line only). The built-in presets ship inside the package
(kvscope/bench/presets/), so an installed kvscope finds them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from typing import Any

import msgspec

from kvscope.engine.config import MODES, EngineConfig, config_from_data
from kvscope.errors import KvscopeError

BUILTIN = ("lesson", "fragmentation")
MAX_FILE_BYTES = 1 << 20


class Reference(msgspec.Struct, forbid_unknown_fields=True):
    source: str = ""
    output_tok_per_s: dict[str, float] = {}
    itl_p99_s: dict[str, float] = {}


class ModesPreset(msgspec.Struct, forbid_unknown_fields=True):
    engine: dict[str, Any]
    workload: dict[str, Any]
    description: str = ""
    modes: list[str] = msgspec.field(default_factory=lambda: list(MODES))
    reference: Reference | None = None


class SimShape(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    kv_cache_dtype: str | None = None


class FragmentationPreset(msgspec.Struct, forbid_unknown_fields=True):
    num_requests: int
    output_len: dict[str, Any]
    reserve_tokens: int
    block_size: int = 16
    prompt_tokens: int = 0
    seed: int = 0
    description: str = ""
    sim: SimShape | None = None
    kv_budget_gib: float = 40.0


@dataclass
class BenchPreset:
    name: str
    kind: str  # "modes" or "fragmentation"
    data: ModesPreset | FragmentationPreset
    config: EngineConfig | None = None  # modes presets: the engine, validated


def _read(name: str) -> tuple[str, bytes]:
    if name in BUILTIN:
        return name, resources.files(__package__).joinpath("presets", f"{name}.json").read_bytes()
    if not os.path.isfile(name):
        raise KvscopeError(f"unknown bench preset {name!r} (choose from {', '.join(BUILTIN)} or a .json file)")
    with open(name, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise KvscopeError(f"bench preset {name}: larger than {MAX_FILE_BYTES >> 10} KiB")
    return os.path.splitext(os.path.basename(name))[0], data


def load_preset(name: str) -> BenchPreset:
    """A built-in preset by name, or a preset file; every problem is one KvscopeError line."""
    label, raw = _read(name)
    try:
        top = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError) as e:
        raise KvscopeError(f"bench preset {name}: invalid JSON: {str(e)[:200]}") from None
    if not isinstance(top, dict):
        raise KvscopeError(f"bench preset {name}: expected a JSON object")
    kind, schema = ("fragmentation", FragmentationPreset) if "reserve_tokens" in top else ("modes", ModesPreset)
    try:
        data = msgspec.convert(top, schema)
    except msgspec.ValidationError as e:
        raise KvscopeError(f"bench preset {name}: {str(e)[:200]}") from None
    if kind == "fragmentation":
        _check_fragmentation(name, data)
        return BenchPreset(label, kind, data)
    bad = [m for m in data.modes if m not in MODES]
    if bad or not data.modes:
        raise KvscopeError(f"bench preset {name}: modes must be a list of {', '.join(MODES)}, got {bad or '[]'}")
    config = config_from_data(data.engine, f"bench preset {name}: engine")
    from kvscope.workload import parse_spec

    try:
        parse_spec(data.workload)
    except KvscopeError as e:
        raise KvscopeError(f"bench preset {name}: workload: {e}") from None
    return BenchPreset(label, kind, data, config)


def _check_fragmentation(name: str, p: FragmentationPreset) -> None:
    from kvscope.workload import MAX_LEN, MAX_REQUESTS, parse_length

    checks = (("num_requests", p.num_requests, 1, MAX_REQUESTS), ("reserve_tokens", p.reserve_tokens, 1, MAX_LEN),
              ("block_size", p.block_size, 1, 1024), ("prompt_tokens", p.prompt_tokens, 0, MAX_LEN))
    for key, value, lo, hi in checks:
        if not lo <= value <= hi:
            raise KvscopeError(f"bench preset {name}: {key} must be in [{lo}, {hi}], got {value}")
    if not 0 < p.kv_budget_gib <= 1 << 20:
        raise KvscopeError(f"bench preset {name}: kv_budget_gib must be in (0, {1 << 20}], got {p.kv_budget_gib}")
    try:
        parse_length(p.output_len, "output_len")
    except KvscopeError as e:
        raise KvscopeError(f"bench preset {name}: {e}") from None
    if p.sim is not None:
        from kvscope.engine.sim import catalog

        try:
            catalog.model(p.sim.model)
        except KvscopeError as e:
            raise KvscopeError(f"bench preset {name}: sim: {e}") from None
        if p.sim.kv_cache_dtype is not None and p.sim.kv_cache_dtype not in catalog.DTYPE_BYTES:
            raise KvscopeError(f"bench preset {name}: sim: unknown kv_cache_dtype {p.sim.kv_cache_dtype!r}")
