"""`kvscope trace-info FILE`: what a trace holds, as text."""

from __future__ import annotations

import datetime as _dt
import os

from ..protocol.events import BACKEND_VLLM, VllmKvEvent, VllmMetricsEvent
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
    if cfg.get("backend") == BACKEND_VLLM:
        return _vllm_info(path, r, s, started, cfg, verify)
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
    return _with_warnings(lines, s.warnings)


def _with_warnings(lines: list[str], warnings: list[str]) -> str:
    if warnings:
        lines.append(f"warnings:   {len(warnings)}")
        lines.extend(f"  - {w}" for w in warnings)
    else:
        lines.append("warnings:   none")
    return "\n".join(lines)


def _vllm_info(path, r: TraceReader, s, started: str, cfg: dict, verify: bool) -> str:
    """A recorded vLLM (`kvscope record --vllm`): what was watched, and its scrapes and KV batches."""
    watched = [f"{k.removeprefix('vllm_')}={_short(cfg[k], 60)}" for k in
               ("vllm_url", "vllm_kv_events", "vllm_kv_replay", "vllm_interval") if k in cfg]
    lines = [
        f"trace:      {os.fspath(path)}",
        f"format:     kvtrace v{s.format_version}, protocol v{s.protocol_version}, "
        f"{s.bytes} bytes, {s.chunks} chunks{'' if s.complete else ', no valid index'}"
        + ("" if verify else " (index trusted: chunks not checked)"),
        f"started:    {started}",
        f"vLLM:       model={_short(cfg.get('model') or '-')} {' '.join(watched)}",
        f"ticks:      {s.steps}" + (f" ({s.first_step}..{s.last_step})" if s.first_step is not None else "")
        + " (a tick is one metrics scrape or one KV-event batch)",
        f"time span:  {s.span:.3f}s ({_fmt_t(s.t_first)} .. {_fmt_t(s.t_last)} since the recording started)",
    ]
    if verify:
        scrapes = failed = batches = replayed = 0
        it = iter(r)
        next(it)
        for ev in it:
            if type(ev) is VllmMetricsEvent:
                scrapes += 1
                failed += ev.error is not None
            elif type(ev) is VllmKvEvent:
                batches += 1
                replayed += ev.replayed
        lines.append(f"recorded:   {scrapes} scrapes ({failed} failed), {batches} KV batches ({replayed} replayed)")
    lines.append(f"events:     {s.events} (+hello)")
    return _with_warnings(lines, s.warnings)
