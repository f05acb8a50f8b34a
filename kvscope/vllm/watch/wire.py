"""vLLM's KV-cache event stream, decoded: msgspec Structs that mirror vLLM's own classes.

The facts (vllm/distributed/kv_events.py):
- PUB multipart messages ``topic | seq | payload``; seq is 8 bytes big-endian.
- The payload is an EventBatch ``(ts, events, data_parallel_rank)``: older releases
  encode it as an array (``array_like=True``), newer ones as a map.
- Each event is tagged with its class name: an array whose first item is the name
  (older, array_like) or a map with a ``type`` key (vLLM 0.26 on).
- BlockStored: block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name, then optional extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window. BlockRemoved: block_hashes, medium, group_idx.
  AllBlocksCleared. A block hash is an int or bytes.
- Replay: a DEALER sends ``b"" | start seq (8 bytes)`` to the ROUTER and receives
  ``b"" | seq | payload`` frames, ending with seq -1 and an empty payload.

Unknown fields are ignored; an unknown event type is counted and skipped; a payload
that does not decode is a WireError (one line), never another exception.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from kvscope.errors import KvscopeError

MAX_PAYLOAD_BYTES = 16 << 20
MAX_DEPTH = 32  # vLLM's events nest at most 4 deep (batch, events, event, extra_keys)
SEQ_BYTES = 8
END_SEQ = -1

BlockHash = Union[int, bytes]


class WireError(KvscopeError):
    """A frame or payload that is not vLLM's format (the message is one line)."""


# ---- the array encoding (array_like=True, tag = class name as the first item) ------------
class _StoredA(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _RemovedA(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None


class _ClearedA(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


# ---- the map encoding (tag in the "type" key) --------------------------------------------
class _StoredM(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _RemovedM(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None


class _ClearedM(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _BatchA(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _BatchM(msgspec.Struct):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


# ---- what the view uses: one shape whatever the encoding ---------------------------------
class Stored(msgspec.Struct, frozen=True):
    block_hashes: list[BlockHash]
    parent: BlockHash | None
    num_tokens: int
    block_size: int
    medium: str


class Removed(msgspec.Struct, frozen=True):
    block_hashes: list[BlockHash]
    medium: str


class Cleared(msgspec.Struct, frozen=True):
    pass


KvEvent = Union[Stored, Removed, Cleared]


class Batch(msgspec.Struct):
    ts: float
    events: list[KvEvent]
    dp_rank: int | None
    unknown: int = 0  # events of a type this reader does not know, skipped


_batch_a = msgspec.msgpack.Decoder(_BatchA)
_batch_m = msgspec.msgpack.Decoder(_BatchM)
_event_a = msgspec.msgpack.Decoder(Union[_StoredA, _RemovedA, _ClearedA])
_event_m = msgspec.msgpack.Decoder(Union[_StoredM, _RemovedM, _ClearedM])
DEFAULT_MEDIUM = "GPU"


def _is_map(data: bytes) -> bool:
    b = data[0]
    return 0x80 <= b <= 0x8F or b in (0xDE, 0xDF)


def check_depth(data: bytes, limit: int = MAX_DEPTH) -> None:
    """Walk msgpack headers without building objects; refuse nesting deeper than ``limit``.

    Iterative, so hostile input cannot recurse; only container and length headers are
    read (scalars are skipped by their sizes).
    """
    pos, n = 0, len(data)
    pending = [1]  # items still to read at each open level
    while pending:
        if pending[-1] == 0:
            pending.pop()
            continue
        pending[-1] -= 1
        if pos >= n:
            raise WireError("truncated msgpack")
        b = data[pos]
        pos += 1
        count = -1  # items of a container opened here
        if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
            continue
        if 0x80 <= b <= 0x8F:
            count = 2 * (b & 0x0F)
        elif 0x90 <= b <= 0x9F:
            count = b & 0x0F
        elif 0xA0 <= b <= 0xBF:
            pos += b & 0x1F
        elif b in (0xC4, 0xD9):
            pos += 1 + (data[pos] if pos < n else 0)
        elif b in (0xC5, 0xDA):
            pos += 2 + int.from_bytes(data[pos:pos + 2], "big")
        elif b in (0xC6, 0xDB):
            pos += 4 + int.from_bytes(data[pos:pos + 4], "big")
        elif b in (0xCC, 0xD0):
            pos += 1
        elif b in (0xCD, 0xD1):
            pos += 2
        elif b in (0xCA, 0xCE, 0xD2):
            pos += 4
        elif b in (0xCB, 0xCF, 0xD3):
            pos += 8
        elif b in (0xDC, 0xDE):
            count = int.from_bytes(data[pos:pos + 2], "big") * (2 if b == 0xDE else 1)
            pos += 2
        elif b in (0xDD, 0xDF):
            count = int.from_bytes(data[pos:pos + 4], "big") * (2 if b == 0xDF else 1)
            pos += 4
        elif b in (0xD4, 0xD5, 0xD6, 0xD7, 0xD8):
            pos += 1 + (1, 2, 4, 8, 16)[b - 0xD4]
        elif b in (0xC7, 0xC8, 0xC9):
            size = {0xC7: 1, 0xC8: 2, 0xC9: 4}[b]
            pos += size + 1 + int.from_bytes(data[pos:pos + size], "big")
        else:
            raise WireError(f"bad msgpack byte 0x{b:02x}")
        if count > 0:
            if count > n:
                raise WireError("msgpack container longer than the payload")
            if len(pending) >= limit:
                raise WireError(f"msgpack nested deeper than {limit}")
            pending.append(count)
    if pos > n:
        raise WireError("truncated msgpack")


def _normal(ev: Any) -> KvEvent:
    if isinstance(ev, (_StoredA, _StoredM)):
        return Stored(ev.block_hashes, ev.parent_block_hash, len(ev.token_ids), ev.block_size,
                      ev.medium or DEFAULT_MEDIUM)
    if isinstance(ev, (_RemovedA, _RemovedM)):
        return Removed(ev.block_hashes, ev.medium or DEFAULT_MEDIUM)
    return Cleared()


def decode_batch(payload: bytes) -> Batch:
    """One EventBatch payload, in either encoding, to a Batch."""
    if not isinstance(payload, (bytes, bytearray, memoryview)) or not payload:
        raise WireError("empty payload")
    payload = bytes(payload)
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise WireError(f"payload of {len(payload)} bytes is over the {MAX_PAYLOAD_BYTES}-byte limit")
    check_depth(payload)
    try:
        raw = (_batch_m if _is_map(payload) else _batch_a).decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError(f"not a vLLM EventBatch: {str(e)[:120]}") from None
    events: list[KvEvent] = []
    unknown = 0
    for item in raw.events:
        data = bytes(item)
        try:
            ev = (_event_m if data and _is_map(data) else _event_a).decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            unknown += 1
            continue
        events.append(_normal(ev))
    return Batch(float(raw.ts), events, raw.data_parallel_rank, unknown)


def decode_seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise WireError(f"sequence frame of {len(frame)} bytes, expected {SEQ_BYTES}")
    return int.from_bytes(frame, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    return int(seq).to_bytes(SEQ_BYTES, "big", signed=True)
