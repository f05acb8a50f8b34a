"""The one rule for every file a command writes, checked before any work starts.

An output path is refused, in one line, when:

- it is a directory, its directory does not exist, or it cannot be written;
- it is one of the command's inputs (the same file, by any name): ``export t.kvtrace
  --perfetto t.kvtrace`` would destroy the trace it reads;
- two outputs of one command name the same file;
- it is an existing file of another kind than the command writes: a trace is never
  overwritten by JSON or CSV, and JSON or CSV never by a trace; anything that is not
  a trace, JSON or text (a model's weights, say) is never overwritten at all.

Overwriting an existing file of the same kind (running the same command again) is
allowed. Kinds are told apart by content, not by file name.
"""

from __future__ import annotations

import os
from typing import Iterable

from kvscope.errors import KvscopeError

KVTRACE, JSON, CSV, HTML = "kvtrace", "json", "csv", "html"
_KIND_NAMES = {KVTRACE: "a .kvtrace trace", JSON: "JSON", CSV: "CSV", HTML: "an HTML page", "text": "text other than CSV"}
_SNIFF_BYTES = 4096
_TRACE_MAGIC = b"KVTRACE\0"  # kvscope.traces.format.MAGIC (not imported: this module stays light)


class OutputPathError(KvscopeError):
    """An output path that would fail, or destroy something, if written."""


def file_kind(path: str) -> str | None:
    """What an existing regular file holds: kvtrace, json, html, csv (text whose first line has a comma),
    text, binary, or None (empty or unreadable: unreadable ones are reported by the write check)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError:
        return None
    if not head:
        return None
    if head.startswith(_TRACE_MAGIC):
        return KVTRACE
    if b"\0" in head:
        return "binary"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # not merely a character cut at the end of the sniffed bytes
            return "binary"
        text = head[: e.start].decode("utf-8")
    if text.lstrip()[:1] in ("{", "["):
        return JSON
    if text.lstrip()[:14].lower() in ("<!doctype html",) or text.lstrip()[:5].lower() == "<html":
        return HTML
    return CSV if "," in text.split("\n", 1)[0] else "text"


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_output(path: str | None, kind: str, *, flag: str | None = None, inputs: Iterable[str | None] = ()) -> None:
    """One output: see the module's rule. ``flag`` (e.g. --perfetto) is named where it helps."""
    if not path:
        return
    name = path
    if os.path.isdir(path):
        raise OutputPathError(f"cannot write {name}: it is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise OutputPathError(f"cannot write {name}: no directory {parent}")
    for src in inputs:
        if src and _same_file(path, src):
            raise OutputPathError(f"cannot write {name}{f' ({flag})' if flag else ''}: it is an input of this "
                                  f"command ({src}); choose another output path")
    if not os.path.exists(path):
        if not os.access(parent, os.W_OK):
            raise OutputPathError(f"cannot write {name}: permission denied")
        return
    if not os.path.isfile(path):
        raise OutputPathError(f"cannot write {name}: not a regular file")
    if not os.access(path, os.W_OK):
        raise OutputPathError(f"cannot write {name}: permission denied")
    found = file_kind(path)
    if found is not None and found != kind:
        what = _KIND_NAMES.get(found, "a binary file")
        raise OutputPathError(f"cannot write {name}: it already holds {what}, not {_KIND_NAMES[kind]}; "
                              "remove it or choose another path")


def check_outputs(outputs: Iterable[tuple[str | None, str, str | None]], inputs: Iterable[str | None] = ()) -> None:
    """Every (path, kind, flag) of one command, against its inputs and each other."""
    inputs = [p for p in inputs if p]
    seen: list[tuple[str, str | None]] = []
    for path, kind, flag in outputs:
        if not path:
            continue
        for other, other_flag in seen:
            if _same_file(path, other):
                raise OutputPathError(f"cannot write {path}: {other_flag or 'another output'} and {flag or 'this one'}"
                                      " name the same file")
        check_output(path, kind, flag=flag, inputs=inputs)
        seen.append((path, flag))
