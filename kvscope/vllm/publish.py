"""kvscope's own prefix cache, published as vLLM KV events (`kvscope serve --kv-events-vllm ADDR`).

The block hash is kvscope's prefix key: 16 bytes, the first 128 bits of a sha256 chained
from the parent block's key (kvscope.engine.kv.prefix_cache), sent as a bytes hash as vLLM
sends its sha256 keys. The engine hands ``consume`` its block manager's drained queue once
per step (``LLMEngine.kv_event_consumers``); the BlockStored (with the parent key and the
block's token ids) and BlockRemoved records in it become this publisher's batch for the
step, as vLLM batches, sent as ``topic | seq | payload`` on a PUB socket. With a replay
address a ROUTER answers ``b"" | start seq`` with every buffered batch from there on,
then seq -1, exactly as vLLM's ZmqEventPublisher. Tools written for vLLM's events (a
KV-aware router, kvscope's own vLLM view) can consume it.

It is an event sink too: the engine's step event is what closes a batch.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import msgspec

from kvscope.vllm.watch.wire import END_SEQ, SEQ_BYTES, encode_seq
from kvscope.engine.kv.events import BlockRemoved, BlockStored
from kvscope.protocol.events import StepEvent

ENCODINGS = ("map", "array")
BUFFER_BATCHES = 10_000
REPLAY_STALL_S = 10.0  # a replay client that reads nothing for this long is given up on
MEDIUM = "GPU"


class _Stored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class _Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[bytes]
    medium: str | None


class _Batch(msgspec.Struct):
    ts: float
    events: list[_Stored | _Removed]
    data_parallel_rank: int | None = None


class _StoredA(_Stored, array_like=True, tag="BlockStored"):
    pass


class _RemovedA(_Removed, array_like=True, tag="BlockRemoved"):
    pass


class _BatchA(msgspec.Struct, array_like=True):
    ts: float
    events: list[_StoredA | _RemovedA]
    data_parallel_rank: int | None = None


class VllmKvPublisher:
    """Consumer of the block manager's event queue + event sink; binds PUB (and ROUTER) on loopback unless allowed."""

    def __init__(self, addr: str, replay_addr: str | None = None, *, block_size: int, encoding: str = "map",
                 allow_remote: bool = False, topic: str = "", data_parallel_rank: int = 0) -> None:
        import zmq

        from kvscope.protocol.transport import check_bind_address

        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}")
        check_bind_address(addr, allow_remote)
        if replay_addr:
            check_bind_address(replay_addr, allow_remote)
            if replay_addr == addr:
                raise ValueError(f"the KV-event and replay addresses are the same ({addr})")
        self.block_size = block_size
        self.array = encoding == "array"
        self.rank = data_parallel_rank
        self.topic = topic.encode()
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(addr)
        self.address = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_address: str | None = None
        self._router = None
        if replay_addr:
            self._router = ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.MAXMSGSIZE, 64)
            # A full peer queue makes send raise instead of dropping silently: the replay waits for room
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            try:
                self._router.bind(replay_addr)
            except zmq.ZMQError:
                self._pub.close()
                self._router.close()
                raise
            self.replay_address = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._pending: list = []
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=BUFFER_BATCHES)
        self._lock = threading.Lock()
        self._seq = 0
        self.batches = 0
        self.replay_sends = 0  # replay requests answered
        self.replays_cut = 0  # answers cut short: the client left or stopped reading for REPLAY_STALL_S
        self._stop = threading.Event()
        self._thread = None
        if self._router is not None:
            self._thread = threading.Thread(target=self._serve_replay, name="kvscope-vllm-replay", daemon=True)
            self._thread.start()

    @property
    def last_seq(self) -> int:
        """Sequence number of the last batch sent (-1 before the first)."""
        return self._seq - 1

    # -- the block manager's queue, one step's records ------------------------------
    def consume(self, kv_events: list) -> None:
        stored, removed = (_StoredA, _RemovedA) if self.array else (_Stored, _Removed)
        for ev in kv_events:
            if type(ev) is BlockStored:
                self._pending.append(stored([ev.key], ev.parent, list(ev.token_ids), self.block_size, None, MEDIUM,
                                            None))
            elif type(ev) is BlockRemoved:
                self._pending.append(removed([ev.key], MEDIUM))

    # -- the event sink ---------------------------------------------------------------
    def publish(self, event) -> None:
        if type(event) is StepEvent:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        events, self._pending = self._pending, []
        batch = (_BatchA if self.array else _Batch)(time.time(), events, self.rank)
        payload = msgspec.msgpack.encode(batch)
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
        import zmq

        try:
            self._pub.send_multipart([self.topic, encode_seq(seq), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # a slow subscriber: it finds the gap by seq and replays it
        self.batches += 1

    def _serve_replay(self) -> None:
        router = self._router
        while not self._stop.is_set():
            if not router.poll(100):
                continue
            try:
                frames = router.recv_multipart()
            except Exception:
                continue
            if len(frames) != 3 or len(frames[2]) != SEQ_BYTES:
                continue  # not a replay request: vLLM ignores these too
            client, _, start = frames
            first = int.from_bytes(start, "big", signed=True)
            with self._lock:
                todo = [(s, p) for s, p in self._buffer if s >= first]
            self.replay_sends += 1
            # as vLLM answers (vllm/distributed/kv_events.py _service_replay): topic | seq | payload, as on the PUB
            for seq, payload in todo:
                if not self._send_replay(router, [client, b"", self.topic, encode_seq(seq), payload]):
                    break  # the client is gone or stopped reading: what it lacks shows as a hole in its seqs
            else:
                self._send_replay(router, [client, b"", b"", encode_seq(END_SEQ), b""])

    def _send_replay(self, router, frames: list[bytes]) -> bool:
        """Send one replay frame set with backpressure: wait for room in the client's queue (never drop),
        up to REPLAY_STALL_S without progress; False when the client is gone or stalled (counted)."""
        import zmq

        deadline = time.monotonic() + REPLAY_STALL_S
        while not self._stop.is_set():
            try:
                router.send_multipart(frames, flags=zmq.NOBLOCK)
                return True
            except zmq.Again:  # its queue is full: wait until it reads
                if time.monotonic() > deadline:
                    break
                router.poll(50, zmq.POLLOUT)  # room for some peer (maybe not this one): retry
                self._stop.wait(0.001)
            except zmq.ZMQError:  # EHOSTUNREACH: the client disconnected
                break
        self.replays_cut += 1
        return False

    def close(self) -> None:
        self.flush()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._pub.close()
        if self._router is not None:
            self._router.close()
