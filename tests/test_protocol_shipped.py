"""The msgspec schema reads, re-encodes and replays the shipped traces exactly as the old codec did.

tests/data/shipped_traces.json was produced by tests/_shipped_digest.py on the code
before the protocol moved to msgspec (commit a966494: the old dataclass codec, with the
``source`` field the HTTP API added to requests). tests/data/shipped_decoding.json was
produced by tests/_shipped_decoding.py on the code before hello.config became an
EngineInfo with per-backend sections (commit 537555d), for every trace under traces/.
"""

from __future__ import annotations

import json
import os

import msgpack
import pytest
from _shipped_decoding import decoding, shipped_traces
from _shipped_digest import digest, raw_frames

from kvscope.protocol import HelloEvent, decode, encode
from kvscope.protocol.engine_info import WIRE_ORDER

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE = json.load(open(os.path.join(ROOT, "tests", "data", "shipped_traces.json")))
DECODING = json.load(open(os.path.join(ROOT, "tests", "data", "shipped_decoding.json")))


def _same_config(old: dict, new: dict) -> None:
    """The old decoding's hello.config, key by key, in the new one. `preemption_mode` was a
    second name for `preemption` (it always repeated it): it reads as `preemption` now."""
    old = dict(old)
    if "preemption_mode" in old:
        mode = old.pop("preemption_mode")
        assert mode in ("", old.get("preemption")), "preemption_mode never differed from preemption"
    assert {k: new.get(k, "(absent)") for k in old} == old


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_shipped_trace_reads_and_replays_as_before(name):
    ref = dict(REFERENCE[name])
    got = digest(os.path.join(ROOT, "traces", name))
    # An older engine's hello re-decodes with the fields it did not send at their defaults.
    old_config, new_config = ref.pop("hello_config"), got.pop("hello_config")
    _same_config(old_config, new_config)
    assert got == ref


def test_every_shipped_trace_is_pinned():
    assert sorted(DECODING) == shipped_traces()


@pytest.mark.parametrize("path", sorted(DECODING))
def test_shipped_trace_decodes_to_the_same_information(path):
    """Every event's fields as before, and every hello.config key the file holds, same value."""
    ref, got = dict(DECODING[path]), decoding(path)
    old_config, new_config = ref.pop("hello_config"), got.pop("hello_config")
    _same_config({k: v for k, v in old_config.items() if k in ref["hello_wire_keys"]}, new_config)
    # a key the file lacks decoded to its default before; it still does, or is left out (a section's)
    for k, v in old_config.items():
        if k not in ref["hello_wire_keys"]:
            assert new_config.get(k, v) == v
    assert got == ref


def test_recorded_frames_re_encode_byte_for_byte():
    frames = raw_frames(os.path.join(ROOT, "traces", "calib-cpu.kvtrace"))
    assert len(frames) == 712
    changed = set()
    for data in frames:
        again = encode(decode(data))
        if again == data:
            continue
        # recorded before requests had a source: the same, plus that field at its default
        back, orig = msgpack.unpackb(again), msgpack.unpackb(data)
        if back["type"] == "hello":  # recorded before the engine's config moved gpu_memory_utilization
            # and while hello repeated `preemption` as `preemption_mode`: the same map without that copy
            assert orig["config"].pop("preemption_mode") == orig["config"]["preemption"]
            assert back == orig and list(back["config"]) != list(orig["config"])  # key order differs
            changed.add("hello")
            continue
        if back["type"] == "request":
            assert back.pop("source") == ""
        else:
            assert back["type"] == "snapshot"
            assert all(rs.pop() == "" for rs in back["requests"])
        assert back == orig
        changed.add(back["type"])
    assert changed <= {"hello", "request", "snapshot"}


@pytest.mark.parametrize("backend", ["sim", "model"])
def test_engine_hello_encodes_the_same_map_as_the_config_dict(monkeypatch, backend):
    """What the engine hands HelloEvent as a dict goes on the wire unchanged, key order included."""
    import kvscope.engine.llm_engine as llm_engine
    from kvscope.engine.config import EngineConfig

    seen = []

    def capture(version, config, wall_start):
        seen.append(dict(config))
        return HelloEvent(version, config, wall_start)

    monkeypatch.setattr(llm_engine, "HelloEvent", capture)
    cfg = EngineConfig(backend="sim", model="llama-3.1-8b") if backend == "sim" else EngineConfig(num_blocks=32)
    hello = llm_engine.LLMEngine(cfg).hello()
    config = seen[-1]
    assert set(config) <= set(WIRE_ORDER), "add the new config keys to engine_info.WIRE_KEYS"
    old_wire = msgpack.packb({"type": "hello", "version": 1, "config": config, "wall_start": hello.wall_start},
                             use_bin_type=True)
    assert encode(hello) == old_wire
