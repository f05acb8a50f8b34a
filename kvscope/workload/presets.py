"""The built-in workloads, read from the JSON files beside this module (presets/*.json).

They are data in the same format a user's ``--workload FILE.json`` has
(docs/WORKLOADS.md), shipped inside the package so an installed kvscope finds them.
"""

from __future__ import annotations

import json
from importlib import resources

from .spec import WorkloadSpec, spec_from_dict

# The order `--workload` help and error messages list them in.
PRESET_NAMES = ("chat", "mixed", "long", "burst", "shared-prefix", "demo", "realsize")


def _load(name: str) -> WorkloadSpec:
    text = resources.files(__package__).joinpath("presets", f"{name}.json").read_text(encoding="utf-8")
    return spec_from_dict(json.loads(text))


PRESETS: dict[str, WorkloadSpec] = {name: _load(name) for name in PRESET_NAMES}
