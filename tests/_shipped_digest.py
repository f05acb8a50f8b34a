"""Digest of how the shipped traces read and replay (test helper).

``digest(path)`` reads a trace, re-encodes every event, folds the events into the TUI
state and seeks to a few steps; the result is plain data. tests/data/shipped_traces.json
holds the digests the code produced before the protocol moved to msgspec (captured at
commit a966494); test_protocol_shipped.py checks the current code gives the same.
"""

from __future__ import annotations

import hashlib
import json

KV_FIELDS = ("total", "used", "free", "cached", "shared", "token_slots", "tail_waste", "reserve_waste",
             "swap_total", "swap_used", "hit_tokens", "query_tokens", "cow_copies")


def _norm_picture(p: dict) -> str:
    p = dict(p)
    p["kv"] = [getattr(p["kv"], f) for f in KV_FIELDS]
    p["requests"] = {str(k): list(v) for k, v in sorted(p["requests"].items())}
    p["tables"] = {str(k): v for k, v in sorted(p["tables"].items())}
    return hashlib.sha256(json.dumps(p, sort_keys=True).encode()).hexdigest()


def _config_dict(config) -> dict:
    return dict(config) if isinstance(config, dict) else config.as_dict()


def digest(path: str) -> dict:
    from kvscope.protocol.codec import encode
    from kvscope.traces.reader import TraceReader
    from kvscope.tui.model.state import new_state, picture, reduce

    reader = TraceReader(path)
    events = list(reader)
    h = hashlib.sha256()
    types: dict[str, int] = {"hello": 1}
    for ev in events[1:]:  # the hello on its own: an older engine's config re-encodes with defaults added
        data = encode(ev)
        h.update(len(data).to_bytes(4, "little"))
        h.update(data)
        types[ev.type] = types.get(ev.type, 0) + 1
    state = new_state()
    pics = []
    for ev in events:
        state = reduce(state, ev)
        if ev.type == "snapshot":
            pics.append(_norm_picture(picture(state)))
    steps = [ev.step for ev in events if ev.type == "step"]
    seeks = {}
    for k in range(1, 9):
        s = steps[len(steps) * k // 9]
        st = new_state()
        for ev in [reader.hello, *reader.seek(s)]:
            st = reduce(st, ev)
        seeks[str(s)] = _norm_picture(picture(st))
    return {
        "events": len(events),
        "types": types,
        "reencoded_sha256": h.hexdigest(),
        "hello_config": {k: v for k, v in _config_dict(reader.hello.config).items()},
        "final_picture": _norm_picture(picture(state)),
        "pictures_after_snapshots": hashlib.sha256("".join(pics).encode()).hexdigest(),
        "seek_pictures": seeks,
        "final_counts": [state.steps_seen, state.tokens_out, state.finished_count, state.preemption_count,
                         state.ttft.n, state.itl.n],
    }


def raw_frames(path: str) -> list[bytes]:
    """Every encoded event as stored in the file (hello first), straight from the bytes."""
    import zlib

    from kvscope.traces import format as F

    data = open(path, "rb").read()
    _magic, _ver, _flags, hello_len, _crc = F.HEADER.unpack_from(data)
    pos = F.HEADER.size
    frames = [data[pos:pos + hello_len]]
    pos += hello_len
    while pos + F.RECORD.size <= len(data):
        tag, length, _crc = F.RECORD.unpack_from(data, pos)
        if tag != F.CHUNK_TAG:
            break
        body = data[pos + F.RECORD.size:pos + F.RECORD.size + length]
        raw = zlib.decompress(body[F.CHUNK_META.size:])
        p = 0
        while p < len(raw):
            (ln,) = F.EVENT_LEN.unpack_from(raw, p)
            frames.append(raw[p + 4:p + 4 + ln])
            p += 4 + ln
        pos += F.RECORD.size + length
    return frames
