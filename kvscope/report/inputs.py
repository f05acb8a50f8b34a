"""What each file given to `kvscope report` is: a trace, bench or race JSON, or diagnose JSON."""

from __future__ import annotations

import json
import os
import stat
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


def plain_text(s: str) -> str:
    """s with every lone surrogate (JSON's "\\ud800", a name from a non-UTF-8 file) as U+FFFD: text that encodes."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _plain_data(v):
    """Parsed JSON with every string made plain_text (keys too)."""
    if isinstance(v, str):
        return plain_text(v)
    if isinstance(v, list):
        return [_plain_data(x) for x in v]
    if isinstance(v, dict):
        return {plain_text(k): _plain_data(x) for k, x in v.items()}
    return v


def open_regular(path: str):
    """A binary file object for path, which must be a regular file (after links): a FIFO would block the read and
    a device (/dev/zero) never ends. Opened without blocking, then checked on the open descriptor (no race)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ReportError(f"cannot read {path}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ReportError(f"{path} is not a regular file (a report reads files, not pipes or devices)")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def classify(path: str) -> Input:
    from kvscope.traces import format as F

    with open_regular(path) as f:
        try:
            head = f.read(len(F.MAGIC))
            if head == F.MAGIC:
                return Input(path, TRACE)
            f.seek(0)
            raw = f.read(MAX_JSON_BYTES + 1)  # bounded even if the file grows while it is read
        except OSError as e:
            raise ReportError(f"cannot read {path}: {e.strerror}") from None
    if len(raw) > MAX_JSON_BYTES:
        raise ReportError(f"{path}: more JSON than a report reads ({MAX_JSON_BYTES:,} bytes)")
    try:
        data = _plain_data(json.loads(raw))
    except (ValueError, RecursionError):
        raise ReportError(f"{path}: neither a .kvtrace nor JSON") from None
    if isinstance(data, dict) and "bottleneck" in data:  # its fields are checked where they are read
        return Input(path, DIAGNOSIS, data)
    if isinstance(data, dict) and isinstance(data.get("rows"), list):
        return Input(path, RESULTS, data)
    raise ReportError(f"{path}: JSON but not bench, race or diagnose output (no 'rows' or 'bottleneck')")


def race_traces(inp: Input) -> list[str]:
    """The traces a race JSON names that exist, relative to the working directory or to the JSON."""
    found = []
    traces = (inp.data or {}).get("traces")
    if traces is not None and not isinstance(traces, list):
        raise ReportError(f"{inp.path}: 'traces' must be a list of paths, got {type(traces).__name__}")
    for t in traces or []:
        if not isinstance(t, str):
            continue
        for candidate in (t, os.path.join(os.path.dirname(os.path.abspath(inp.path)), t)):
            if os.path.isfile(candidate):  # a regular file (after links): never a FIFO or a device
                found.append(candidate)
                break
    return found[:MAX_TRACES]
