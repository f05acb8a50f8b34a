"""The bench report: aligned text tables for the terminal, Markdown tables for the docs, and JSON files."""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction * 100:.1f}%"


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell: the first left-aligned, the rest right-aligned."""
    lines = [list(header), *map(list, rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]

    def fmt(line: list[str]) -> str:
        return "  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(line, widths)))

    return "\n".join([fmt(lines[0]), "  ".join("-" * w for w in widths), *map(fmt, lines[1:])])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def rows_table(result: dict[str, Any]) -> str:
    """The mode/peer table of `kvscope bench` (model or sim backend), with its one-line heading."""
    heading = (f"workload={result['workload']} model={result['model']} device={result['device']} "
               f"requests={result['num_requests']} max_num_seqs={result['max_num_seqs']}")
    threads = (result.get("host") or {}).get("threads")
    if threads is not None:
        heading += f" threads={threads} (kvscope and peers)"
    header = ("row", "out tok/s", "TTFT mean", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "preempt", "KV waste")
    rows = [(r["name"], f"{r['output_tok_per_s']:.1f}", ms(r["ttft_mean_s"]), ms(r.get("ttft_p50_s")),
             ms(r["ttft_p99_s"]), ms(r.get("itl_p50_s")), ms(r["itl_p99_s"]),
             str(r["preemptions"]) if r["preemptions"] is not None else "-", pct(r["kv_waste"]))
            for r in result["rows"]]
    if any("roofline_pct" in r for r in result["rows"]):  # `kvscope bench --roofline`
        header += ("roofline",)
        rows = [(*row, "-" if r.get("roofline_pct") is None else f"{r['roofline_pct']:.1f}%")
                for row, r in zip(rows, result["rows"])]
    return heading + "\n" + text_table(header, rows)


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write a result file (an OSError reaches the CLI, which prints it in one line)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr)
