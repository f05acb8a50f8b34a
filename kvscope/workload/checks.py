"""Validation helpers for workload specs: every problem is one line naming the key."""

from __future__ import annotations

import math
from typing import Any

from kvscope.errors import KvscopeError

MAX_LEN = 1 << 20  # no length (prompt, output) exceeds this, even from an unbounded distribution

# kind -> (required fields, optional fields)
KindTable = dict[str, tuple[tuple[str, ...], tuple[str, ...]]]


class WorkloadError(KvscopeError):
    """A workload spec, file or generator argument the user got wrong."""


def fail(msg: str) -> None:
    raise WorkloadError(f"invalid workload spec: {msg}")


def key(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def short_repr(v: Any, limit: int = 60) -> str:
    """A short one-line repr for error messages (never the whole of a huge value)."""
    if isinstance(v, (list, tuple, dict)) and len(v) > 16:
        return f"<{type(v).__name__} of {len(v)} items>"
    try:
        s = repr(v)
    except RecursionError:
        return f"<deeply nested {type(v).__name__}>"
    s = s.replace("\n", " ")
    return s if len(s) <= limit else s[: limit - 3] + "..."


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_int(v: Any, where: str, lo: int | None = None, hi: int | None = None) -> None:
    if not is_int(v):
        fail(f"{where} must be an integer, got {short_repr(v)}")
    if lo is not None and v < lo:
        fail(f"{where} must be >= {lo}, got {short_repr(v)}")
    if hi is not None and v > hi:
        fail(f"{where} must be <= {hi}, got {short_repr(v)}")


def check_num(v: Any, where: str, *, positive: bool = False, nonneg: bool = False) -> None:
    if not is_num(v):
        fail(f"{where} must be a finite number, got {short_repr(v)}")
    if positive and v <= 0:
        fail(f"{where} must be > 0, got {short_repr(v)}")
    if nonneg and v < 0:
        fail(f"{where} must be >= 0, got {short_repr(v)}")


def check_fields(kind_key: str, kind: Any, table: KindTable, vals: dict[str, Any], path: str) -> None:
    """Kind is known, every required field is set, no field of another kind is set."""
    if not isinstance(kind, str) or kind not in table:
        fail(f"{kind_key} must be one of {', '.join(table)}, got {short_repr(kind)}")
    required, optional = table[kind]
    for k in vals:
        if k not in required and k not in optional:
            allowed = ", ".join(required + optional) or "nothing else"
            fail(f"{key(path, k)} is not used by kind {short_repr(kind)} (it takes {allowed})")
    for k in required:
        if k not in vals:
            fail(f"{key(path, k)} is required for kind {short_repr(kind)}")
