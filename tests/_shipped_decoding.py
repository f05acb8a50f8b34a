"""What every shipped trace decodes to, as plain data (test helper).

``decoding(path)`` reads every event of a trace and reduces it to a digest of its
decoded fields (``msgspec.to_builtins``), with the hello's config as its flat
``as_dict()`` map kept whole. tests/data/shipped_decoding.json holds what the code
produced before the schema split EngineInfo into sections and moved the vLLM events
(commit 537555d); test_protocol_shipped.py checks the current code reads the same.
Run ``python tests/_shipped_decoding.py`` to print the current decodings.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shipped_traces() -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "traces", "**", "*.kvtrace"),
                                                               recursive=True))


def wire_keys(path: str) -> list[str]:
    """The keys of hello.config as the file stores them, read from its bytes."""
    import msgpack
    from _shipped_digest import raw_frames

    return list(msgpack.unpackb(raw_frames(os.path.join(ROOT, path))[0])["config"])


def decoding(path: str) -> dict:
    import msgspec

    from kvscope.traces.reader import TraceReader

    reader = TraceReader(os.path.join(ROOT, path))
    h = hashlib.sha256()
    types: dict[str, int] = {}
    for ev in list(reader)[1:]:
        h.update(json.dumps(msgspec.to_builtins(ev), sort_keys=True).encode())
        types[ev.type] = types.get(ev.type, 0) + 1
    return {"hello_config": reader.hello.config.as_dict(), "hello_wire_keys": wire_keys(path),
            "hello_version": reader.hello.version,
            "wall_start": reader.hello.wall_start, "types": types, "events_sha256": h.hexdigest()}


if __name__ == "__main__":
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print(json.dumps({p: decoding(p) for p in shipped_traces()}, indent=1, sort_keys=True))
