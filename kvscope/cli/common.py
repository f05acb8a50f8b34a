"""What the `kvscope` commands share: argument types, the engine and workload flags, checks
made before a run, and the progress bar. Not a command itself.

The engine flags are built from EngineConfig's fields (help and choices live in their
metadata), so each setting and its default are defined once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import threading
from typing import Any, Callable, Iterable, get_args

from kvscope.engine.config import CONFIG_FIELDS, EngineConfig
from kvscope.errors import KvscopeError

EXIT_USAGE = 2
PALETTES = ("default", "cb")


class UsageError(KvscopeError):
    """A one-line problem with what the user asked for on the command line."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the full usage is one --help away)."""

    def error(self, message: str):
        first = message.splitlines()[0] if message else "bad arguments"
        self.exit(EXIT_USAGE, f"{self.prog}: error: {first} (see {self.prog} --help)\n")


# ---- argument types: one-line errors, sizes as numbers like 1e9 -----------------------------
def int_type(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            try:
                f = float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
            if not math.isfinite(f) or f != int(f):
                raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
            value = int(f)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            span = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
            raise argparse.ArgumentTypeError(f"{text} is outside {span}")
        return value

    parse.__name__ = "integer"
    return parse


def float_type(lo: float | None = None, hi: float | None = None, *, positive: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
        if (positive and value <= 0) or (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{text} is out of range")
        return value

    parse.__name__ = "number"
    return parse


def comma_list(choices: Iterable[str] | None = None, what: str = "name") -> Callable[[str], list[str]]:
    names = None if choices is None else tuple(str(c) for c in choices)

    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if names is not None and x not in names]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad[0]!r} (choose from {', '.join(names)})")
        return items

    parse.__name__ = "list"
    return parse


def add_palette(p: argparse.ArgumentParser) -> None:
    p.add_argument("--palette", default="default", choices=PALETTES, help="cb: colour-blind safe")


# ---- engine flags, from EngineConfig ----------------------------------------------------------
def _field_type(f: dataclasses.Field) -> type:
    """int, float, str, bool or dict from a field's annotation (``int | None`` is int)."""
    names = {"int": int, "float": float, "str": str, "bool": bool, "dict": dict}
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    for part in str(text).replace(" ", "").split("|"):
        if part in names:
            return names[part]
    args = [a for a in get_args(f.type) if a is not type(None)]
    return args[0] if args else str


def _default_text(f: dataclasses.Field) -> str:
    if f.default is None:
        return ""
    if isinstance(f.default, bool):
        return f" (default: {'on' if f.default else 'off'})"
    return f" (default: {f.default})"


def engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field. Every default is None, so the config's own defaults apply and
    a preset can tell which flags were given."""
    groups = {"engine": p.add_argument_group("engine"),
              "sim": p.add_argument_group("sim backend (docs/SIM.md); --model then names a catalog shape, "
                                          "e.g. llama-3.3-70b-fp8")}
    for f in dataclasses.fields(EngineConfig):
        meta = f.metadata
        flag = "--" + f.name.replace("_", "-")
        kind = _field_type(f)
        kw: dict[str, Any] = {"default": None, "help": meta["help"] + _default_text(f)}
        # plain strings: an enum member's repr (<Mode.NAIVE: 'naive'>) is no choice a user can type
        choices = tuple(str(c) for c in meta["choices"]) if meta.get("choices") else None
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif kind is dict:
            kw["metavar"] = meta.get("metavar") or "FILE"
        elif choices and "module:Class" in choices:
            kw["metavar"] = "{" + ",".join(choices) + "}"
        elif choices:
            kw["choices"] = choices
        elif kind is int:
            kw["type"] = int_type()
        elif kind is float:
            kw["type"] = float_type()
        if meta.get("metavar") and "choices" not in kw and kind is not bool:
            kw["metavar"] = meta["metavar"]
        groups[meta.get("group", "engine")].add_argument(flag, **kw)


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags given on the command line (a FILE flag already read)."""
    settings = {k: getattr(args, k) for k in CONFIG_FIELDS if getattr(args, k, None) is not None}
    if isinstance(settings.get("sim_efficiency"), str):
        from kvscope.engine.sim.backend import load_efficiency

        settings["sim_efficiency"] = load_efficiency(settings["sim_efficiency"])
    return settings


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    config = EngineConfig(**{**engine_settings(args), **overrides})
    config.validate()  # one line before anything is loaded or allocated
    if config.backend == "model":
        from kvscope.engine.loader.named_models import check_model_name

        check_model_name(config.model)
    return config


def explicit_sim_overrides(args: argparse.Namespace) -> dict:
    """Sim flags given on the command line on top of a preset (their argparse defaults are None)."""
    keys = ("gpu", "tp", "kv_cache_dtype", "sim_efficiency")
    overrides = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    if isinstance(overrides.get("sim_efficiency"), str):  # the flag names a file
        from kvscope.engine.sim.backend import load_efficiency

        overrides["sim_efficiency"] = load_efficiency(overrides["sim_efficiency"])
    return overrides


def workload_args(p: argparse.ArgumentParser, default: str) -> None:
    from kvscope.workload import MAX_REQUESTS

    p.add_argument("--workload", default=default, help=f"preset name or JSON spec file (default: {default})")
    p.add_argument("--num-requests", type=int_type(1, MAX_REQUESTS), default=None,
                   help="override the workload's request count")


# ---- SLOs and cost (docs/GOODPUT.md) ------------------------------------------------------------
def _slo_item(text: str) -> str:
    from kvscope.goodput import SloError, parse_slo

    try:
        parse_slo(text)
    except SloError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_slo_args(p: argparse.ArgumentParser, *, cost: bool = True, recorded: bool = False) -> None:
    """--slo KEY:MS ... (vLLM's --goodput keys ttft, tpot, e2el) and, with cost, --cost-per-hour."""
    where = " (default: the one the trace recorded, if any)" if recorded else ""
    p.add_argument("--slo", nargs="+", type=_slo_item, default=None, metavar="KEY:MS",
                   help="service-level objectives in ms, vLLM's --goodput keys: ttft, tpot, e2el; a request is good "
                        f"when it meets every one given, e.g. --slo ttft:500 tpot:50{where}")
    if cost:
        p.add_argument("--cost-per-hour", type=float_type(positive=True, hi=1e6), default=None, metavar="USD",
                       help="what the machine costs per hour: adds $ per million output and goodput tokens")


def slo_from_args(args: argparse.Namespace):
    """The Slo the flags ask for (an empty Slo when --slo was not given)."""
    from kvscope.goodput import parse_slo

    return parse_slo(getattr(args, "slo", None))


# ---- checks made before a run ---------------------------------------------------------------
def check_output_path(path: str | None, *, inputs: Iterable[str | None] = (), kind: str = "json") -> None:
    """A file we will write at the end of a run: fail now, not after the run. The one rule for every
    command (kvscope.output_paths): never one of its inputs, never over a file of another kind."""
    from kvscope.output_paths import check_output

    check_output(path, kind, inputs=[p for p in inputs if isinstance(p, str)])


def check_address(addr: str, *, bind: bool, allow_remote: bool = False) -> None:
    """The address's syntax (and, to bind, that it is loopback unless allowed) as one line."""
    from kvscope.protocol.transport import check_bind_address

    try:
        check_bind_address(addr, allow_remote or not bind)
    except ValueError as e:
        raise UsageError(str(e).splitlines()[0]) from None
    if addr.startswith("ipc://"):
        path = addr[len("ipc://"):]
        parent = os.path.dirname(os.path.abspath(path))
        if bind and not os.path.isdir(parent):
            raise UsageError(f"cannot bind {addr}: no directory {parent}")


def check_url(flag: str, url: str) -> None:
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"{flag} {url}: expected a URL such as http://127.0.0.1:8000")


def zmq_errors() -> tuple[type[BaseException], ...]:
    """ZeroMQ's error class, if a command has imported zmq (it is imported lazily)."""
    zmq = sys.modules.get("zmq")
    return (zmq.ZMQError,) if zmq is not None else ()


def open_socket(what: str, addr: str, make: Callable[[], Any]):
    try:
        return make()
    except zmq_errors() as e:
        raise UsageError(f"cannot {what} {addr}: {e}") from None


def write_json(path: str, data: dict) -> None:
    try:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror}") from None
    print(f"wrote {path}", file=sys.stderr)


# ---- progress ----------------------------------------------------------------------------------
class NoProgress:
    """The bar when none is wanted: the same calls, doing nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(enabled: bool, *, total: int | None, desc: str, unit: str = "req", unbounded: str | None = None):
    """A tqdm bar on stderr, or a NoProgress. Callers never test it for truth: tqdm refuses bool() on
    a bar without a total (an open-ended run such as `serve --http` or `--forever`). ``unbounded``: the
    bar's format when there is no total (a server idles between requests, so a rate over wall time
    would mislead: the count alone)."""
    if not enabled:
        return NoProgress()
    from tqdm import tqdm

    fmt = unbounded if total is None else None
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, bar_format=fmt)


class loading_line:
    """One line of its own while a model loads, on a terminal: `kvscope: loading MODEL … 12 s`, redrawn
    each second (after ``quiet_s``), then `kvscope: loaded MODEL in 24.1 s`; in a log only the last line.
    transformers' own bars are turned off meanwhile. A failed load leaves its error the only line."""

    def __init__(self, model: str, stream=None, quiet_s: float = 1.0, *, checkpoint: bool = True) -> None:
        self.model = model
        self.checkpoint = checkpoint  # False: the sim backend, which loads nothing (and must not import torch)
        self.stream = stream or sys.stderr
        self.quiet_s = quiet_s
        self.shown = False
        self._lock = threading.Lock()

    def __enter__(self):
        import time

        self.t0 = time.monotonic()
        if self.checkpoint and self.model not in _builtin_names():
            try:  # a real checkpoint: transformers' bars would glue themselves to ours
                from transformers.utils import logging as hf_logging

                hf_logging.disable_progress_bar()
            except ImportError:
                pass
        self._done = threading.Event()
        if not self.stream.isatty():  # a log or a pipe: the one line comes when loaded (an error stays alone)
            self._thread = None
            return self

        def tick() -> None:
            if self._done.wait(self.quiet_s):
                return
            while True:
                with self._lock:
                    if self._done.is_set():
                        return
                    self.stream.write(f"\rkvscope: loading {self.model} … {time.monotonic() - self.t0:.0f} s")
                    self.stream.flush()
                    self.shown = True
                if self._done.wait(1.0):
                    return

        self._thread = threading.Thread(target=tick, name="kvscope-loading", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        import time

        with self._lock:
            self._done.set()
        if self._thread is None:
            self.shown = True
        else:
            self._thread.join(2.0)
            if self.shown:
                self.stream.write("\r\x1b[K")  # the progress line gives way to the result (or the error)
        if self.shown and exc_type is None:
            self.stream.write(f"kvscope: loaded {self.model} in {time.monotonic() - self.t0:.1f} s\n")
        self.stream.flush()


def _builtin_names() -> frozenset[str]:
    from kvscope.engine.loader.shapes import BUILTIN_SHAPES

    return frozenset(BUILTIN_SHAPES)
