"""What each file given to `kvscope report` is: a trace, bench or race JSON, or diagnose JSON."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from kvscope.errors import KvscopeError

MAX_JSON_BYTES = 64 << 20
MAX_TRACES = 4
TRACE, RESULTS, DIAGNOSIS = "trace", "results", "diagnosis"


class ReportError(KvscopeError):
    """An input the report cannot use, or an output it must not write (one line)."""


@dataclass
class Input:
    path: str
    kind: str  # TRACE, RESULTS (bench or race JSON) or DIAGNOSIS
    data: dict | None = None  # parsed JSON


def classify(path: str) -> Input:
    from kvscope.traces import format as F

    try:
        with open(path, "rb") as f:
            head = f.read(len(F.MAGIC))
            if head == F.MAGIC:
                return Input(path, TRACE)
            size = os.fstat(f.fileno()).st_size
            if size > MAX_JSON_BYTES:
                raise ReportError(f"{path}: {size:,} bytes is more JSON than a report reads ({MAX_JSON_BYTES:,})")
            f.seek(0)
            raw = f.read()
    except OSError as e:
        raise ReportError(f"cannot read {path}: {e.strerror}") from None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise ReportError(f"{path}: neither a .kvtrace nor JSON") from None
    if isinstance(data, dict) and "bottleneck" in data and isinstance(data.get("knobs", []), list):
        return Input(path, DIAGNOSIS, data)
    if isinstance(data, dict) and isinstance(data.get("rows"), list):
        return Input(path, RESULTS, data)
    raise ReportError(f"{path}: JSON but not bench, race or diagnose output (no 'rows' or 'bottleneck')")


def race_traces(inp: Input) -> list[str]:
    """The traces a race JSON names that exist, relative to the working directory or to the JSON."""
    found = []
    for t in (inp.data or {}).get("traces") or []:
        if not isinstance(t, str):
            continue
        for candidate in (t, os.path.join(os.path.dirname(os.path.abspath(inp.path)), t)):
            if os.path.isfile(candidate):
                found.append(candidate)
                break
    return found[:MAX_TRACES]
