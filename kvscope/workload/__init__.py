"""Synthetic workloads: when requests arrive, how long their prompts and outputs are.

A :class:`WorkloadSpec` describes traffic (arrival process, prompt and output length
distributions, an optional shared system prompt, optional priorities). ``generate``
turns a spec into a deterministic list of :class:`WorkloadRequest` for a seed;
``generate_forever`` makes an endless stream for ``kvscope serve --forever`` and the
demo; ``make_burst`` / ``make_long_prompt`` build requests injected from the control
channel. Specs come from ``PRESETS`` or from JSON (``parse_spec`` / ``load_spec``);
docs/WORKLOADS.md describes the format. Specs are data: nothing in one names code.

Modules, one concept each: checks (one-line validation errors), arrivals, lengths
(token-count distributions), spec (WorkloadSpec and its JSON form), presets (the
built-in specs, JSON files inside the package), files (parse_spec, load_spec) and
generate. Pure Python: no torch, no numpy.
"""

from __future__ import annotations

from .arrivals import ArrivalSpec
from .checks import MAX_LEN, WorkloadError
from .files import load_spec, parse_spec
from .generate import (WorkloadRequest, generate, generate_forever, generate_iter, make_burst, make_long_prompt,
                       shared_prefix_tokens)
from .lengths import LengthDist
from .presets import PRESETS
from .spec import MAX_REQUESTS, WorkloadSpec, parse_length, spec_to_dict

__all__ = [
    "WorkloadRequest",
    "ArrivalSpec",
    "LengthDist",
    "WorkloadSpec",
    "WorkloadError",
    "PRESETS",
    "MAX_LEN",
    "MAX_REQUESTS",
    "parse_spec",
    "load_spec",
    "spec_to_dict",
    "parse_length",
    "generate",
    "generate_forever",
    "generate_iter",
    "make_burst",
    "make_long_prompt",
    "shared_prefix_tokens",
]
