"""Colour palettes for the TUI: the default one and a colour-blind-safe one.

Colours never carry meaning alone: free, cached, shared and selected blocks,
prefill/decode/padding and the percentile markers each have their own glyph too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Palette:
    name: str
    owners: tuple[str, ...]  # request colours, picked by a hash of the request id
    prefill: str
    decode: str
    padding: str
    free: str
    cached: str
    selected: str
    p50: str
    p90: str
    p99: str
    ok: str
    warn: str
    bad: str
    dim: str
    bar: str


DEFAULT = Palette(
    name="default",
    owners=(
        "#e6194b", "#3cb44b", "#ffe119", "#4363d8", "#f58231", "#911eb4",
        "#46f0f0", "#f032e6", "#bcf60c", "#fabebe", "#008080", "#e6beff",
        "#9a6324", "#fffac8", "#aaffc3", "#808000", "#ffd8b1", "#6495ed",
    ),
    prefill="#f58231",
    decode="#4363d8",
    padding="#808080",
    free="#4a4a4a",
    cached="#8a8a8a",
    selected="#ffffff",
    p50="#3cb44b",
    p90="#ffe119",
    p99="#e6194b",
    ok="#3cb44b",
    warn="#ffe119",
    bad="#e6194b",
    dim="#7a7a7a",
    bar="#5fafd7",
)

# Okabe & Ito's palette, distinguishable under the common colour-vision deficiencies.
CB = Palette(
    name="cb",
    owners=("#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7"),
    prefill="#E69F00",
    decode="#56B4E9",
    padding="#999999",
    free="#4a4a4a",
    cached="#999999",
    selected="#ffffff",
    p50="#009E73",
    p90="#F0E442",
    p99="#D55E00",
    ok="#009E73",
    warn="#F0E442",
    bad="#D55E00",
    dim="#999999",
    bar="#56B4E9",
)

PALETTES = {"default": DEFAULT, "cb": CB}


def get_palette(name: str | Palette) -> Palette:
    if isinstance(name, Palette):
        return name
    try:
        return PALETTES[name]
    except KeyError:
        raise ValueError(f"unknown palette {name!r}; choose one of {', '.join(PALETTES)}") from None


def owner_index(req: int, n: int) -> int:
    """Stable colour slot for a request id (Knuth's multiplicative hash)."""
    return ((req * 2654435761) & 0xFFFFFFFF) % n


def owner_color(pal: Palette, req: int) -> str:
    return pal.owners[owner_index(req, len(pal.owners))]
