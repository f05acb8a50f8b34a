"""One markdown table: what guidellm and aiperf measured beside what kvscope's /metrics counted in the same run.

Usage: python summarise.py OUT_DIR   (the folder benchmarks/clients/run_clients.sh wrote). Stdlib only, so any
python runs it. For each run NAME it reads NAME.json (guidellm) or NAME/profile_export_aiperf.json (aiperf)
and NAME.metrics-before / NAME.metrics-after (kvscope's /metrics scraped around the run).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

SAMPLE = re.compile(r"^(vllm:[a-z0-9_]+)\{[^}]*\}\s+(\S+)$")


def scrape(path: Path) -> dict[str, float]:
    """Sum each vllm: sample over its label sets (one engine, one model: only finished_reason splits)."""
    totals: dict[str, float] = {}
    for line in path.read_text().splitlines():
        m = SAMPLE.match(line)
        if m and not m.group(1).endswith("_bucket") and not m.group(1).endswith("_created"):
            totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(m.group(2))
    return totals


def server_row(out: Path, name: str) -> dict[str, str]:
    before, after = scrape(out / f"{name}.metrics-before"), scrape(out / f"{name}.metrics-after")

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    def mean_ms(metric: str) -> str:
        n = delta(f"vllm:{metric}_count")
        return f"{1000 * delta(f'vllm:{metric}_sum') / n:.1f}" if n else "-"

    return {"requests": f"{delta('vllm:request_success_total'):.0f}", "errors": "-",
            "ttft": mean_ms("time_to_first_token_seconds"), "itl": mean_ms("inter_token_latency_seconds"),
            "e2e": mean_ms("e2e_request_latency_seconds"),
            "out_tokens": f"{delta('vllm:generation_tokens_total'):.0f}", "tok_s": "-"}


def guidellm_row(path: Path) -> dict[str, str]:
    m = json.loads(path.read_text())["benchmarks"][0]["metrics"]

    def mean(key: str, part: str = "successful") -> float:
        return m[key][part]["mean"]

    totals = m["request_totals"]
    if not totals["successful"]:
        return {"requests": "0", "errors": f"{totals['errored']}", "ttft": "-", "itl": "-", "e2e": "-",
                "out_tokens": "-", "tok_s": "-"}
    return {"requests": f"{totals['successful']}", "errors": f"{totals['errored']}",
            "ttft": f"{mean('time_to_first_token_ms'):.1f}", "itl": f"{mean('inter_token_latency_ms'):.1f}",
            "e2e": f"{1000 * mean('request_latency'):.1f}",
            "out_tokens": f"{m['output_token_count']['successful']['total_sum']:.0f}",
            "tok_s": f"{mean('output_tokens_per_second', 'total'):.1f}"}


def aiperf_row(path: Path) -> dict[str, str]:
    d = json.loads(path.read_text())

    def avg(key: str) -> float | None:
        return d[key]["avg"] if isinstance(d.get(key), dict) else None

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    errors = sum(e.get("count", 0) for e in d.get("error_summary") or [])
    return {"requests": f"{avg('request_count') or 0:.0f}", "errors": f"{errors}",
            "ttft": fmt(avg("time_to_first_token")), "itl": fmt(avg("inter_token_latency")),
            "e2e": fmt(avg("request_latency")), "out_tokens": fmt(avg("total_usage_completion_tokens") or avg("total_osl")),
            "tok_s": fmt(avg("output_token_throughput"))}


def aiperf_records_row(path: Path) -> dict[str, str]:
    """aiperf writes no summary when every request failed: count its per-request records instead."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    codes = sorted({str(r["error"].get("code")) for r in records if r.get("error")})
    errors = sum(1 for r in records if r.get("error"))
    return {"requests": f"{len(records) - errors}", "errors": f"{errors} (HTTP {', '.join(codes)})" if codes else "0",
            "ttft": "-", "itl": "-", "e2e": "-", "out_tokens": "-", "tok_s": "-"}


def guidellm_errors(path: Path) -> str:
    """The HTTP statuses guidellm's errored requests met (from its per-request records)."""
    errored = json.loads(path.read_text())["benchmarks"][0]["requests"].get("errored") or []
    codes = sorted({c for r in errored for c in re.findall(r"'(\d{3}) [A-Z]", (r.get("info") or {}).get("error") or "")})
    return f" (HTTP {', '.join(codes)})" if codes else ""


def main(out: Path) -> None:
    print("| run | measured by | requests | errors | mean TTFT ms | mean ITL ms | mean e2e ms | output tokens | output tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for before in sorted(out.glob("*.metrics-before"), key=lambda p: p.stat().st_mtime):  # in the order run
        name = before.name.removesuffix(".metrics-before")
        if not (out / f"{name}.metrics-after").exists():
            continue  # still running
        if (out / f"{name}.json").exists():
            tool, row = "guidellm", guidellm_row(out / f"{name}.json")
            if row["errors"] != "0":
                row["errors"] += guidellm_errors(out / f"{name}.json")
        elif (out / name / "profile_export_aiperf.json").exists():
            tool, row = "aiperf", aiperf_row(out / name / "profile_export_aiperf.json")
        elif (out / name / "profile_export.jsonl").exists():
            tool, row = "aiperf", aiperf_records_row(out / name / "profile_export.jsonl")
        else:
            tool, row = "(no result)", None
        for who, r in ((tool, row), ("kvscope /metrics", server_row(out, name))):
            if r is not None:
                print(f"| {name} | {who} | {r['requests']} | {r['errors']} | {r['ttft']} | {r['itl']} | {r['e2e']} "
                      f"| {r['out_tokens']} | {r['tok_s']} |")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/clients/out"))
