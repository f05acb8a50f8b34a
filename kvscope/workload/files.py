"""Specs from JSON: a preset by name, or a user's file, optionally based on a preset."""

from __future__ import annotations

import copy
import json
import os

from .checks import WorkloadError, fail, short_repr
from .presets import PRESETS
from .spec import SPEC_KEYS, WorkloadSpec, spec_from_dict, spec_to_dict

MAX_FILE_BYTES = 1 << 20  # a workload spec is a few hundred bytes


def parse_spec(obj: dict) -> WorkloadSpec:
    """Build a spec from a JSON object; any problem is a one-line WorkloadError naming the key.

    ``"base": "<preset>"`` starts from a preset and overrides the keys given.
    """
    if not isinstance(obj, dict):
        fail(f"expected a JSON object, got {type(obj).__name__}")
    for k in obj:
        if k not in SPEC_KEYS:
            fail(f"unknown key {short_repr(k)} (expected one of {', '.join(SPEC_KEYS)})")
    if "base" in obj:
        base = obj["base"]
        if not isinstance(base, str) or base not in PRESETS:
            fail(f"base must be a preset ({', '.join(PRESETS)}), got {short_repr(base)}")
        merged = spec_to_dict(PRESETS[base])
        merged.update({k: v for k, v in obj.items() if k != "base"})
        obj = merged
    return spec_from_dict(obj)


def load_spec(name_or_path: str) -> WorkloadSpec:
    """A preset by name (a fresh copy), or a spec from a .json file."""
    if not isinstance(name_or_path, str):
        raise WorkloadError(f"a workload is a preset name or a .json path, got {short_repr(name_or_path)}")
    if name_or_path in PRESETS:
        return copy.deepcopy(PRESETS[name_or_path])
    if not (name_or_path.endswith(".json") or os.path.exists(name_or_path)):
        raise WorkloadError(f"unknown workload {name_or_path!r} "
                            f"(choose from {', '.join(PRESETS)} or a .json file)")
    try:
        with open(name_or_path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise WorkloadError(f"cannot read workload file {name_or_path!r}: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise WorkloadError(f"workload file {name_or_path!r} is larger than {MAX_FILE_BYTES >> 10} KiB")
    try:
        obj = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WorkloadError(f"invalid JSON in workload file {name_or_path!r}: {e}") from None
    except RecursionError:
        raise WorkloadError(f"invalid JSON in workload file {name_or_path!r}: nested too deeply") from None
    if isinstance(obj, dict) and "name" not in obj and "base" not in obj:
        obj = {**obj, "name": os.path.splitext(os.path.basename(name_or_path))[0]}
    try:
        return parse_spec(obj)
    except WorkloadError as e:
        raise WorkloadError(f"{name_or_path}: {e}") from None
