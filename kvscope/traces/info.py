"""`kvscope trace-info FILE`: what a trace holds, as text."""

from __future__ import annotations

import datetime as _dt
import os

from ..protocol.engine_info import engine_label
from ..protocol.events import VllmKvEvent, VllmMetricsEvent
from .reader import TraceReader

__all__ = ["trace_info"]

_CONFIG_KEYS = ("model", "backend", "device", "mode", "policy", "scheduler", "vllm_version", "block_size",
                "num_blocks", "null_block", "max_num_seqs", "max_num_batched_tokens", "workload", "seed")


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
    cfg = r.hello.config.as_dict()
    vllm = _VllmCounts() if r.vllm_recording else None
    if verify:
        r.verify(vllm)
    s = r.summary()
    try:
        started = _dt.datetime.fromtimestamp(r.hello.wall_start, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        started = f"{r.hello.wall_start!r} (wall clock)"
    lines = [
        f"trace:      {os.fspath(path)}",
        f"format:     kvtrace v{s.format_version}, protocol v{s.protocol_version}, "
        f"{s.bytes} bytes, {s.chunks} chunks{'' if s.complete else ', no valid index'}"
        + ("" if verify else " (index trusted: chunks not checked)"),
        f"started:    {started}",
    ]
    lines += _engine_lines(s, cfg, r.hello.config) if vllm is None else \
        _vllm_lines(s, cfg, r.hello.config, vllm if verify else None)
    if s.warnings:
        lines.append(f"warnings:   {len(s.warnings)}")
        lines.extend(f"  - {w}" for w in s.warnings)
    else:
        lines.append("warnings:   none")
    return "\n".join(lines)


def _steps(s) -> str:
    return f"{s.steps}" + (f" ({s.first_step}..{s.last_step})" if s.first_step is not None else "")


def _engine_lines(s, cfg: dict, info) -> list[str]:
    shown = [f"{k}={_short(cfg[k])}" for k in _CONFIG_KEYS if cfg.get(k) is not None]  # (None: not reported)
    others = len([k for k in cfg if k not in _CONFIG_KEYS])
    if others:
        shown.append(f"(+{others} more)")
    from ..goodput import slo_of_flat

    slo = slo_of_flat(cfg)
    return [
        f"engine:     {_short(engine_label(info), 120)}",
        f"config:     {' '.join(shown) if shown else '(no config)'}",
        *([f"SLO:        {slo.describe()} (replay, report and diagnose judge goodput by it; --slo overrides)"]
          if slo else []),
        f"steps:      {_steps(s)}",
        f"time span:  {s.span:.3f}s ({_fmt_t(s.t_first)} .. {_fmt_t(s.t_last)} engine time)",
        f"requests:   {s.requests} seen, {s.finished} finished, {s.rejects} rejected, "
        f"{s.preemptions} preemptions",
        f"events:     {s.events} (+hello), {s.dropped} dropped by the publisher",
    ]


class _VllmCounts:
    """Scrapes and KV batches of a recorded vLLM, counted during the verify pass."""

    def __init__(self) -> None:
        self.scrapes = self.failed = self.batches = self.replayed = 0

    def __call__(self, ev) -> None:
        if type(ev) is VllmMetricsEvent:
            self.scrapes += 1
            self.failed += ev.error is not None
        elif type(ev) is VllmKvEvent:
            self.batches += 1
            self.replayed += ev.replayed


def _vllm_lines(s, cfg: dict, info, counts: _VllmCounts | None) -> list[str]:
    """A recorded vLLM (`kvscope record --vllm`): what was watched, and its scrapes and KV batches."""
    watched = [f"{k.removeprefix('vllm_')}={_short(cfg[k], 60)}" for k in
               ("vllm_url", "vllm_kv_events", "vllm_kv_replay", "vllm_interval") if k in cfg]
    lines = [
        f"engine:     {_short(engine_label(info), 120)}",
        f"vLLM:       model={_short(cfg.get('model') or '-')} {' '.join(watched)}",
        f"ticks:      {_steps(s)} (a tick is one metrics scrape or one KV-event batch)",
        f"time span:  {s.span:.3f}s ({_fmt_t(s.t_first)} .. {_fmt_t(s.t_last)} since the recording started)",
    ]
    if counts is not None:
        lines.append(f"recorded:   {counts.scrapes} scrapes ({counts.failed} failed), {counts.batches} KV batches "
                     f"({counts.replayed} replayed)")
    lines.append(f"events:     {s.events} (+hello)")
    return lines
