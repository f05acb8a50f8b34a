"""`kvscope trace-info FILE`: what a trace holds, as text."""

from __future__ import annotations

import datetime as _dt
import os

from .reader import TraceReader

__all__ = ["trace_info"]

_CONFIG_KEYS = ("model", "backend", "device", "mode", "policy", "block_size", "num_blocks",
                "max_num_seqs", "max_num_batched_tokens", "workload", "seed")


def _fmt_t(t: float | None) -> str:
    return "-" if t is None else f"{t:.3f}s"


def _short(v, limit: int = 40) -> str:
    """A config value as printed: a file may hold anything, so never more than one short line."""
    text = str(v) if isinstance(v, (str, int, float, bool, type(None))) else f"<{type(v).__name__}>"
    text = text.replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def trace_info(path: str | os.PathLike, *, verify: bool = True) -> str:
    """Text report of a trace. With ``verify`` (the default) every chunk is read and decoded, so
    damage anywhere is reported with its byte offset; without, the index is trusted (its stats are
    still checked). Raises ProtocolError for a file that is not a trace (the message is one
    line), OSError if it cannot be read."""
    r = TraceReader(path)
    if verify:
        r.verify()
    s = r.summary()
    h = r.hello
    try:
        started = _dt.datetime.fromtimestamp(h.wall_start, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        started = f"{h.wall_start!r} (wall clock)"
    cfg = h.config.as_dict()
    shown = [f"{k}={_short(cfg[k])}" for k in _CONFIG_KEYS if k in cfg]
    others = len([k for k in cfg if k not in _CONFIG_KEYS])
    if others:
        shown.append(f"(+{others} more)")
    lines = [
        f"trace:      {os.fspath(path)}",
        f"format:     kvtrace v{s.format_version}, protocol v{s.protocol_version}, "
        f"{s.bytes} bytes, {s.chunks} chunks{'' if s.complete else ', no valid index'}"
        + ("" if verify else " (index trusted: chunks not checked)"),
        f"started:    {started}",
        f"engine:     {' '.join(shown) if shown else '(no config)'}",
        f"steps:      {s.steps}"
        + (f" ({s.first_step}..{s.last_step})" if s.first_step is not None else ""),
        f"time span:  {s.span:.3f}s ({_fmt_t(s.t_first)} .. {_fmt_t(s.t_last)} engine time)",
        f"requests:   {s.requests} seen, {s.finished} finished, {s.rejects} rejected, "
        f"{s.preemptions} preemptions",
        f"events:     {s.events} (+hello), {s.dropped} dropped by the publisher",
    ]
    if s.warnings:
        lines.append(f"warnings:   {len(s.warnings)}")
        lines.extend(f"  - {w}" for w in s.warnings)
    else:
        lines.append("warnings:   none")
    return "\n".join(lines)
