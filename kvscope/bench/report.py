"""The bench report: aligned text tables for the terminal, Markdown tables for the docs, and JSON files."""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence

from kvscope.goodput import fmt_share, fmt_usd


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
    header, rows = goodput_columns(result["rows"], header, rows)
    if any(r.get("weights_mb_per_token") for r in result["rows"]):  # what one decode token reads
        header += ("weights/token",)
        rows = [(*row, "-" if not r.get("weights_mb_per_token") else f"{r['weights_mb_per_token']:.0f} MB")
                for row, r in zip(rows, result["rows"])]
    if any("roofline_pct" in r for r in result["rows"]):  # `kvscope bench --roofline`
        header += ("roofline",)
        rows = [(*row, "-" if r.get("roofline_pct") is None else f"{r['roofline_pct']:.1f}%")
                for row, r in zip(rows, result["rows"])]
    return heading + "\n" + text_table(header, rows)


def goodput_columns(rows_in: Sequence[dict], header: tuple, rows: list) -> tuple[tuple, list]:
    """With an SLO: goodput tok/s and the share of requests meeting it; with a price: $/Mtok and $/Mgood."""
    if any(r.get("slo") for r in rows_in):
        header += ("goodput", "SLO met")
        rows = [(*row, "-" if r.get("goodput_tok_per_s") is None else f"{r['goodput_tok_per_s']:.1f}",
                 fmt_share(r.get("slo_attainment"))) for row, r in zip(rows, rows_in)]
    if any(r.get("usd_per_mtok") is not None for r in rows_in):
        judged = any(r.get("slo") for r in rows_in)
        header += ("$/Mtok", "$/Mgood") if judged else ("$/Mtok",)
        rows = [(*row, fmt_usd(r.get("usd_per_mtok")), *((fmt_usd(r.get("usd_per_mgood")),) if judged else ()))
                for row, r in zip(rows, rows_in)]
    return header, rows


def ranking_lines(result: dict[str, Any]) -> list[str]:
    """Lines under a table: the rows ranked by tok/s, by goodput (with an SLO) and by $ per million tokens
    (with a price): best first. A row with no goodput (a peer) is left out of that ranking."""
    rows = result.get("rows", [])
    judged = [r for r in rows if r.get("slo")]
    priced = [r for r in rows if r.get("usd_per_mtok") is not None]
    if not judged and not priced:
        return []

    def names(rs: list[dict]) -> str:
        return " > ".join(r["name"] for r in rs)

    out = [f"ranked by tok/s:   {names(sorted(rows, key=lambda r: -(r.get('output_tok_per_s') or 0.0)))}"]
    if judged:
        out.insert(0, f"SLO {judged[0]['slo']}: a request is good when it meets every target (docs/GOODPUT.md)")
        out.append(f"ranked by goodput: {names(sorted(judged, key=lambda r: -(r.get('goodput_tok_per_s') or 0.0)))}")
    if priced:
        out.append(f"ranked by $/Mtok:  {names(sorted(priced, key=lambda r: r['usd_per_mtok']))} "
                   f"(at ${priced[0]['cost_per_hour']:g}/hour)")
        good = [r for r in priced if r.get("usd_per_mgood") is not None]
        if judged and good:
            none = [r["name"] for r in priced if r.get("usd_per_mgood") is None and r.get("slo")]
            out.append(f"ranked by $/Mgood: {names(sorted(good, key=lambda r: r['usd_per_mgood']))}"
                       + (f" (no good request: {', '.join(none)})" if none else ""))
        best, worst = min(priced, key=lambda r: r["usd_per_mtok"]), max(priced, key=lambda r: r["usd_per_mtok"])
        if best is not worst:
            out.append(f"{best['name']} serves {best['output_tok_per_s'] / worst['output_tok_per_s']:.1f}x the tokens "
                       f"per hour of {worst['name']} on the same machine, so each token costs "
                       f"{best['usd_per_mtok'] / worst['usd_per_mtok']:.2f}x as much "
                       f"({fmt_usd(best['usd_per_mtok'])} vs {fmt_usd(worst['usd_per_mtok'])} per million)")
    return out


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write a result file (an OSError reaches the CLI, which prints it in one line)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr)
