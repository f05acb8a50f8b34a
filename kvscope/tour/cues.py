"""The moments the chapters wait for, each read from the state the dashboard itself shows.

Every cue takes a CueContext and returns a Moment (the world freezes there) or None. They read
``kvscope.tui.model.state.TuiState``, the reducer's output, so whatever a cue saw is on the screen when
the world stops. None reads a clock.
"""

from __future__ import annotations

import math

from kvscope.protocol.events import BLOCKED_STATIC, PREFILL, VERDICT_BLOCKED
from kvscope.tour.script import CueContext, Moment


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f} ms"


def _pct(x: float) -> str:
    return f"{x:.0%}" if x >= 0.1 else f"{x:.1%}"


def waste(st) -> float:
    """Empty slots in the blocks requests hold, as a share of those slots (partly filled last blocks plus
    blocks reserved ahead for tokens not yet generated)."""
    kv = st.kv
    slots = kv.used * st.block_size
    return (kv.tail_waste + kv.reserve_waste) / slots if slots else 0.0


def max_refcount(st) -> int:
    return max(st.blocks.refcount, default=0)


def block_grew(ctx: CueContext) -> Moment | None:
    """Chapter 1: the first request, decoding, outgrew the blocks its prompt filled and took one more."""
    st = ctx.state
    rid = min(st.running, default=None)
    r = st.get(rid) if rid is not None else None
    if r is None or rid != 0 or not r.decoding:
        return None
    bs = st.block_size
    table = st.tables.get(rid, [])
    prompt_blocks = math.ceil(r.prompt_len / bs)
    if len(table) <= prompt_blocks:
        return None
    shown = ", ".join(str(b) for b in table[:8]) + (" …" if len(table) > 8 else "")
    return Moment(
        f"step {st.step}: #{rid} holds {len(table)} blocks [{shown}]: {prompt_blocks} filled by its "
        f"{r.prompt_len}-token prompt, one more taken at token {prompt_blocks * bs + 1}. The blocks need not be "
        f"next to each other: its block table says where each {bs} tokens live.", select=rid,
        figures={"blocks": len(table)})


def joined_as_one_left(ctx: CueContext) -> Moment | None:
    """Chapter 2, continuous: a request finished and a waiting one took its seat at once, while the others
    are mid-decode (continuous mode runs a new prompt's prefill as a step of its own, then decodes them all)."""
    st = ctx.state
    b = st.last_batch
    if not st.finished_count or b is None or not b.prefill:
        return None
    joined = next((rid for rid in st.running
                   if (r := st.get(rid)) is not None and any(e.kind == "prefill" and e.step == st.step for e in r.log)),
                  None)
    decoding = [rid for rid in st.running if rid != joined and (r := st.get(rid)) is not None and r.decoding]
    if joined is None or not decoding:
        return None
    return Moment(f"step {st.step}: {st.finished_count} request(s) finished, and #{joined} took a free seat at once, "
                  f"while {len(decoding)} other(s) are mid-way through their outputs; {len(st.waiting)} wait. "
                  f"Nobody waits for the slowest.", select=joined,
                  figures={"step": st.step, "finished": st.finished_count})


def static_waits_for_slowest(ctx: CueContext) -> Moment | None:
    """Chapter 2, static: the batch's early finishers sit idle while its slowest row decodes, and the
    queue waits for the whole batch."""
    st = ctx.state
    adm = st.admission
    if adm.verdict != VERDICT_BLOCKED or adm.reason != BLOCKED_STATIC or not st.waiting:
        return None
    live = [rid for rid in st.running if (r := st.get(rid)) is not None and r.output_len < r.max_tokens]
    seats = (st.config.max_num_seqs if st.config is not None else 0) or len(st.running)
    if not live or st.finished_count == 0 and len(live) >= seats:
        return None
    b = st.last_batch
    done = seats - len(live)
    if done < seats // 2:
        return None
    slow = max(live, key=lambda rid: st.get(rid).max_tokens)
    r = st.get(slow)
    return Moment(f"step {st.step}: {done} of the batch's {seats} rows are done, but #{slow} still has "
                  f"{r.max_tokens - r.output_len} tokens to go, so {len(st.waiting)} requests wait "
                  f"(blocked: static batch still running){f'; padding this step: {b.padding} tokens' if b else ''}.",
                  select=slow, figures={"step": st.step, "finished": st.finished_count})


def _long_request(st, min_prompt: int):
    rids = list(st.requests) + list(st.finished)
    return next((rid for rid in rids if (r := st.get(rid)) is not None and r.prompt_len >= min_prompt), None)


def chunks_beside_decodes(long_prompt: int):
    def cue(ctx: CueContext) -> Moment | None:
        """Chapter 3, chunked: the long prompt's prefill went in chunks, every step beside the decodes."""
        st = ctx.state
        rid = _long_request(st, long_prompt)
        r = st.get(rid) if rid is not None else None
        if r is None or not r.decoding:
            return None
        budget = st.chunk_size()
        biggest = max((s.prefill + s.decode for s in st.history), default=0)
        return Moment(f"step {st.step}: #{rid}'s {r.prompt_len}-token prompt went in {r.total_chunks} chunks; no step "
                      f"computed more than {biggest} tokens, and the others got a token in every one of those "
                      f"steps: ITL max {_ms(ctx.itl_max)}.", select=rid,
                      figures={"itl_max": ctx.itl_max, "chunks": r.total_chunks})
    return cue


def chunk_in_flight(long_prompt: int, min_chunks: int = 3):
    def cue(ctx: CueContext) -> Moment | None:
        """Chapter 3, chunked, mid-prefill: a chunk of the long prompt in the same step as decodes."""
        st = ctx.state
        b = st.last_batch
        rid = _long_request(st, long_prompt)
        r = st.get(rid) if rid is not None else None
        if r is None or b is None or r.decoding or r.chunks_done < min_chunks or not b.decode or not b.prefill:
            return None
        done, total = st.chunks(r)
        return Moment(f"step {st.step}: chunk {done} of {total} of #{rid}'s {r.prompt_len}-token prompt "
                      f"({b.prefill} tokens) ran beside {b.decode} decode(s), within the {b.budget}-token budget.",
                      select=rid, figures={"itl_max": ctx.itl_max})
    return cue


def whole_prefill_spike(long_prompt: int, against: str):
    def cue(ctx: CueContext) -> Moment | None:
        """Chapter 3, whole prefill: the long prompt went in one step; the decoders' next token waited."""
        st = ctx.state
        rid = _long_request(st, long_prompt)
        r = st.get(rid) if rid is not None else None
        if r is None or not r.decoding or not ctx.itl_max or st.itl.n == 0:
            return None
        chunked = ctx.findings.get(against, {}).get("itl_max")
        p50 = st.itl.quantile(0.5)
        versus = f" (with chunks: {_ms(chunked)})" if chunked else ""
        biggest = max((s.prefill + s.decode for s in st.history), default=0)
        return Moment(f"step {st.step}: #{rid}'s {r.prompt_len} tokens went in one step of {biggest} tokens, and "
                      f"every running request waited for it: ITL max {_ms(ctx.itl_max)}{versus}, against a median "
                      f"of {_ms(p50)}.",
                      select=rid, figures={"itl_max": ctx.itl_max})
    return cue


def preempted(mode: str):
    def cue(ctx: CueContext) -> Moment | None:
        """Chapter 4: the pool ran out and a request lost its blocks (recompute) or moved them to CPU (swap)."""
        st = ctx.state
        if (st.swap_out_count if mode == "swap" else st.preemption_count) == 0:
            return None
        victims = st.swapped if mode == "swap" else st.preempted
        rid = victims[-1] if victims else None
        r = st.get(rid) if rid is not None else None
        kv = st.kv
        who = f"#{rid}" if rid is not None else "a request"
        if mode == "swap":
            what = (f"{who} was swapped out: its KV moved to CPU memory ({kv.swap_used} of {kv.swap_total} swap "
                    f"blocks), and it comes back without recomputing anything")
        else:
            redo = f" its {r.prompt_len} prompt and {r.output_len} output tokens" if r is not None else " its tokens"
            what = f"{who}, the newest, was preempted (↺): its blocks went back to the pool, and{redo} are recomputed when it is readmitted"
        return Moment(f"step {st.step}: the pool is full ({kv.free} of {kv.total} blocks free); {what}.",
                      select=rid, figures={"preemptions": st.preemption_count})
    return cue


def prefix_hit(ctx: CueContext) -> Moment | None:
    """Chapter 5: a request found its prompt's first blocks in the prefix cache."""
    st = ctx.state
    if st.hit_count == 0:
        return None
    hit = next((r for r in list(st.requests.values()) + list(st.finished.values()) if r.cached_tokens), None)
    if hit is None:
        return None
    kv = st.kv
    rate = kv.hit_tokens / kv.query_tokens if kv.query_tokens else 0.0
    return Moment(f"step {st.step}: #{hit.req} found {hit.cached_tokens} of its {hit.prompt_len} prompt tokens "
                  f"({hit.cached_tokens // st.block_size} blocks) in the cache and computed only the rest; "
                  f"{st.hit_count} hit(s) so far, {_pct(rate)} of prompt tokens served from the cache.",
                  select=hit.req, figures={"hits": st.hit_count, "hit_tokens": kv.hit_tokens})


def shared_by(n: int):
    def cue(ctx: CueContext) -> Moment | None:
        """Chapter 6: n samples of one prompt hold its full blocks together, refcount n; the last one copied."""
        st = ctx.state
        shared = sum(1 for rc in st.blocks.refcount if rc >= n)
        if not shared or st.kv.cow_copies == 0:
            return None
        first = next(iter(sorted(st.running)), None)
        return Moment(f"step {st.step}: the {n} samples share {shared} full prompt blocks at refcount {n} (stored "
                      f"once, read {n} times); the partly filled last block was copied on write "
                      f"{st.kv.cow_copies} times, so each sample writes its own tokens.", select=first,
                      figures={"shared": shared, "cow": st.kv.cow_copies})
    return cue


def waste_measured(min_out: int, against: str | None = None):
    def cue(ctx: CueContext) -> Moment | None:
        """Chapter 7: every running request is decoding with at least min_out tokens: measure the waste."""
        st = ctx.state
        if not st.running or st.waiting:
            return None
        for rid in st.running:
            r = st.get(rid)
            if r is None or not r.decoding or r.output_len < min_out:
                return None
        w = waste(st)
        kv = st.kv
        before = ctx.findings.get(against, {}).get("waste") if against else None
        versus = f", against {_pct(before)} with per-request reservation" if before is not None else ""
        how = ("reserved for prompt + max_tokens up front" if kv.reserve_waste else "taken one block at a time")
        return Moment(f"step {st.step}: {len(st.running)} requests hold {kv.used} blocks, {how}; "
                      f"{_pct(w)} of their slots are empty{versus}.",
                      figures={"waste": w, "blocks": kv.used})
    return cue


# knobs the re-run can apply as they are; the memory-sizing ones change nothing while the tour pins the pool
APPLICABLE_KNOBS = ("--num-blocks", "--max-num-seqs", "--preemption", "--max-num-batched-tokens", "--mode",
                    "--prefix-caching", "--policy")
JUDGE_EVERY = 8  # steps between two diagnoses while waiting (each reads the whole window)


def _figures(st) -> dict:
    return {"step": st.step, "preemptions": st.preemption_count, "finished": st.finished_count,
            "ttft_p99": st.ttft.quantile(0.99) if st.ttft.n else None, "tokens": st.tokens_out}


def diagnosed(min_steps: int):
    def cue(ctx: CueContext) -> Moment | None:
        """Chapter 8: enough steps for the reader to name one bottleneck and a knob the re-run can turn."""
        from kvscope.analysis.diagnose import NoSteps, judge
        from kvscope.analysis.verdicts import UNDERLOADED

        st = ctx.state
        if st.steps_seen < min_steps or st.step % JUDGE_EVERY:
            return None
        try:
            d = judge(ctx.log, source="tour")
        except NoSteps:
            return None
        knob = next((k for k in d.knobs if k.flag in APPLICABLE_KNOBS), None)
        if d.bottleneck == UNDERLOADED or knob is None:
            return None
        evidence = d.evidence[0].text if d.evidence else ""
        return Moment(f"step {st.step}: bottleneck {d.bottleneck} ({evidence}). Its knob: {knob.flag} "
                      f"{knob.from_} → {knob.to}, {knob.why}.",
                      figures={"bottleneck": d.bottleneck, "knob": knob.flag, "to": knob.to, "from": knob.from_})
    return cue


def all_served(requests: int, against: str | None = None):
    def cue(ctx: CueContext) -> Moment | None:
        """Chapter 8: every scripted request finished; the run's figures (and the earlier run's, to compare)."""
        st = ctx.state
        if st.finished_count < requests or st.running or st.waiting or st.preempted or st.swapped:
            return None
        now = _figures(st)
        before = ctx.findings.get(against) if against else None
        if before is None:
            return Moment(f"step {st.step}: all {requests} requests served, with {now['preemptions']} preemptions; "
                          f"TTFT p99 {_ms(now['ttft_p99'])}. These are the figures to beat.", figures=now)
        better = [name for name, key in (("steps", "step"), ("preemptions", "preemptions"), ("TTFT p99", "ttft_p99"))
                  if now[key] is not None and before[key] is not None and now[key] < before[key]]
        worse = [name for name, key in (("steps", "step"), ("preemptions", "preemptions"), ("TTFT p99", "ttft_p99"))
                 if now[key] is not None and before[key] is not None and now[key] > before[key]]
        verdict = ("better on every figure" if better and not worse else
                   f"a trade: better {', '.join(better)}, worse {', '.join(worse)}" if better else "no better")
        return Moment(f"step {st.step}, with {before['knob']} {before['to']}: all {requests} requests served in "
                      f"{now['step'] + 1} steps (before: {before['step'] + 1}), {now['preemptions']} preemptions "
                      f"(before: {before['preemptions']}), TTFT p99 {_ms(now['ttft_p99'])} "
                      f"(before: {_ms(before['ttft_p99'])}): {verdict}.", figures=now)
    return cue


def knob_applied(base: dict, against: str):
    """Scene settings for the what-if: ``base`` with the knob the diagnosis of ``against`` named."""
    from kvscope.analysis.predict import FLAG_KEYS

    def settings(findings: dict) -> dict:
        found = findings.get(against, {})
        flag = found.get("knob")
        return {**base, FLAG_KEYS[flag]: found["to"]} if flag in FLAG_KEYS else dict(base)
    return settings
