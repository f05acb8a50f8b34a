"""Prefix-cache keys and the index from a key to the block that holds it.

A full block's key names the whole prefix up to the block's end: it is chained from
the key of the block before it. The key is the first 128 bits of

    sha256(parent key (16 bytes) || the block's token ids, each a little-endian int64)

and a prompt's first block chains from a root key, sha256 of a fixed tag and the engine's
salt (what else changes the KV of the same tokens: the model, its dtype, the block size).
Python's ``hash((parent, tokens))`` is not used: int tuple hashes are not randomized, so
two prompts with the same key can be computed offline, and one client could be served
another's KV. A 128-bit sha256 prefix leaves a birthday search 2**64 evaluations; vLLM
moved to sha256 keys after its own hash-collision advisory for the same reason.

A hit is also verified, as nano-vllm does: the block's own token ids and its parent's key
must equal what was registered, so a key collision alone never shares a block. Keys go out
as they are, 16 bytes, in vLLM's KV-event format (a bytes block hash).
"""

from __future__ import annotations

import hashlib
import struct

KEY_BYTES = 16
_TAG = b"kvscope prefix cache v1\x00"


def root_key(salt: bytes = b"") -> bytes:
    """The key a prompt's first block chains from."""
    return hashlib.sha256(_TAG + salt).digest()[:KEY_BYTES]


def block_key(parent: bytes, token_ids: tuple[int, ...] | list[int]) -> bytes:
    """The prefix-cache key of a full block: its parent's key and its own token ids."""
    data = parent + struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.sha256(data).digest()[:KEY_BYTES]


class PrefixCache:
    """Which block holds which key, and what each registered block holds (to verify a hit)."""

    __slots__ = ("block_size", "root", "_by_key", "_entry")

    def __init__(self, num_blocks: int, block_size: int, salt: bytes = b"") -> None:
        self.block_size = block_size
        self.root = root_key(salt)
        self._by_key: dict[bytes, int] = {}
        # per block: (key, parent key, token ids) while it is registered, else None
        self._entry: list[tuple[bytes, bytes, tuple[int, ...]] | None] = [None] * num_blocks

    def __len__(self) -> int:
        return len(self._by_key)

    def keys_for(self, token_ids: list[int], keys: list[bytes], num_blocks: int) -> list[bytes]:
        """Extend `keys` (a request's chain, kept on the request) to its first num_blocks full blocks."""
        bs = self.block_size
        for i in range(len(keys), num_blocks):
            keys.append(block_key(keys[-1] if keys else self.root, token_ids[i * bs : (i + 1) * bs]))
        return keys

    def parent_of(self, keys: list[bytes], i: int) -> bytes:
        return keys[i - 1] if i else self.root

    def lookup(self, key: bytes, parent: bytes, token_ids: list[int]) -> int | None:
        """The block registered under key, if it really holds these tokens after this parent."""
        block = self._by_key.get(key)
        if block is None:
            return None
        _, p, tokens = self._entry[block]
        if p != parent or list(tokens) != token_ids:
            return None  # a key collision: never share it
        return block

    def key_of(self, block: int) -> bytes | None:
        entry = self._entry[block]
        return None if entry is None else entry[0]

    def is_registered(self, block: int) -> bool:
        return self._entry[block] is not None

    def register(self, block: int, key: bytes, parent: bytes, token_ids: tuple[int, ...]) -> bool:
        """Register a full block under key; False if the key or the block is taken already."""
        if key in self._by_key or self._entry[block] is not None:
            return False
        self._by_key[key] = block
        self._entry[block] = (key, parent, token_ids)
        return True

    def forget(self, block: int) -> bytes:
        """Unregister an evicted block; returns its key."""
        key = self._entry[block][0]
        self._entry[block] = None
        del self._by_key[key]
        return key

    def check_invariants(self) -> None:
        for key, block in self._by_key.items():
            assert self.key_of(block) == key, f"prefix index disagrees with block {block}"
        assert sum(1 for e in self._entry if e is not None) == len(self._by_key), "stray prefix keys"
