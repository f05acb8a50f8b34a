"""Prefix-cache keys resist collisions, and a hit is verified against the block's own tokens.

The old key was Python's ``hash((parent, tokens))``. Int hashes are not randomized and
``hash(-1) == hash(-2)``, so two token blocks with the same old key are written down here
without any search. The new key (sha256, chained) tells them apart. And because a hit is
checked against the tokens the block holds, even a key function that does collide (the old
hash cut to 8 bits, with a collision found by a small seeded birthday search) never serves
one prompt another prompt's KV: both get exactly transformers' tokens.
"""

from __future__ import annotations

import random

import pytest

from conftest import token_prompts
from kvscope.engine import LLM, SamplingParams
from kvscope.engine.kv import prefix_cache
from kvscope.engine.kv.block_manager import BlockManager
from kvscope.engine.kv.events import BlockStored
from kvscope.engine.kv.prefix_cache import KEY_BYTES, PrefixCache, block_key, root_key
from kvscope.engine.request import Request

BS = 4


def old_key(parent, tokens) -> int:
    """The key before this change (kvscope.engine.kv.block_manager.block_hash)."""
    return hash((parent, tuple(tokens)))


def test_blocks_that_collide_under_the_old_hash_get_different_keys():
    a, b = [-1, 5, 6, 7], [-2, 5, 6, 7]  # hash(-1) == hash(-2): the tuples hash alike
    assert a != b and old_key(None, a) == old_key(None, b), "the old key collides"
    root = root_key()
    assert block_key(root, a) != block_key(root, b)
    assert len(block_key(root, a)) == KEY_BYTES == 16
    # the key covers the parent (the whole prefix) and the salt (what else changes the KV)
    assert block_key(block_key(root, a), [1, 2, 3, 4]) != block_key(block_key(root, b), [1, 2, 3, 4])
    assert block_key(root_key(b"model-a"), a) != block_key(root_key(b"model-b"), a)


def _run_one(bm: BlockManager, req: Request) -> list[int | None]:
    """Admit req with its prefix hits, compute its whole prompt, release it (its blocks stay cached)."""
    hits = bm.match_prefix(req.token_ids)
    computed = min(len(hits) * BS, req.num_tokens - 1)
    assert bm.admit(req, hits[: -(-computed // BS)], computed, req.num_tokens)
    bm.commit(req, req.num_tokens)
    table = list(req.block_table)
    bm.free(req)
    bm.check_invariants()
    return hits, table


def test_colliding_blocks_never_share_a_physical_block():
    bm = BlockManager(8, BS, enable_caching=True)
    a = Request(0, [-1, 5, 6, 7, 9], SamplingParams(max_tokens=1), 0.0)
    b = Request(1, [-2, 5, 6, 7, 9], SamplingParams(max_tokens=1), 0.0)
    _, table_a = _run_one(bm, a)
    stored = [e for e in bm.take_events() if type(e) is BlockStored]
    assert [e.token_ids for e in stored] == [(-1, 5, 6, 7)] and stored[0].parent is None
    hits, table_b = _run_one(bm, b)
    assert hits == [], "b must not hit a's block"
    assert table_b[0] != table_a[0]
    again, _ = _run_one(bm, Request(2, [-1, 5, 6, 7, 1], SamplingParams(max_tokens=1), 0.0))
    assert again == [table_a[0]], "the same tokens still hit"


def test_a_hit_is_verified_against_the_blocks_tokens():
    cache = PrefixCache(4, BS)
    key = block_key(cache.root, [1, 2, 3, 4])
    assert cache.register(0, key, cache.root, (1, 2, 3, 4))
    assert cache.lookup(key, cache.root, [1, 2, 3, 4]) == 0
    assert cache.lookup(key, cache.root, [1, 2, 3, 5]) is None, "same key, other tokens: a miss"
    assert cache.lookup(key, block_key(cache.root, [9] * BS), [1, 2, 3, 4]) is None, "same key, other prefix"


def _weak_key(parent: bytes, tokens) -> bytes:
    """The old hash cut to 8 bits: collisions are everywhere (what verification must survive).
    (The parent enters by its length: a bytes hash is randomized per process, and the search
    below must find the same pair in every run.)"""
    return bytes([old_key(len(parent), tokens) & 0xFF])


def _colliding_prompts(vocab: int, block: int) -> tuple[list[int], list[int]]:
    """Two different one-block token lists with the same weak key: a seeded birthday search."""
    rng = random.Random(25)
    seen: dict[bytes, list[int]] = {}
    root = root_key()
    while True:
        tokens = [rng.randrange(3, vocab) for _ in range(block)]
        k = _weak_key(root, tokens)
        if k in seen and seen[k] != tokens:
            return seen[k], tokens
        seen[k] = tokens


def _generate(model_arg, prompts, **kw):
    llm = LLM(model_arg, device="cpu", dtype="float32", mode="chunked", num_blocks=32, block_size=16, prefix_caching=True,
              **kw)
    outs = [llm.generate([p], SamplingParams(max_tokens=12, ignore_eos=True))[0] for p in prompts]
    return llm, [o.token_ids for o in outs]


def test_prompts_whose_keys_collide_both_get_transformers_tokens(models, monkeypatch):
    model_arg, ref, vocab = models["tiny"]
    first, second = _colliding_prompts(vocab, 16)
    tail = token_prompts([5], vocab, seed=8)[0]
    prompts = [first + tail, second + tail]  # one full block each, keys equal under the weak hash
    assert _weak_key(root_key(), first) == _weak_key(root_key(), second) and first != second
    monkeypatch.setattr(prefix_cache, "block_key", _weak_key)
    llm, got = _generate(model_arg, prompts)
    bm = llm.engine.block_manager
    assert bm.hit_tokens == 0, "the second prompt's key found the first's block, and verification refused it"
    assert got == ref.greedy_all(prompts, 12)
    # the first prompt again does hit (the key is its block's): verification refuses only what differs
    again = llm.generate([prompts[0]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert bm.hit_tokens == 16 and again.token_ids == got[0]


def test_without_verification_the_collision_would_serve_the_wrong_kv(models, monkeypatch):
    """The control: skip the token check and the second prompt is served the first one's KV."""
    model_arg, ref, vocab = models["tiny"]
    first, second = _colliding_prompts(vocab, 16)
    tail = token_prompts([5], vocab, seed=8)[0]
    prompts = [first + tail, second + tail]
    monkeypatch.setattr(prefix_cache, "block_key", _weak_key)
    monkeypatch.setattr(PrefixCache, "lookup", lambda self, key, parent, tokens: self._by_key.get(key))
    llm, got = _generate(model_arg, prompts)
    assert llm.engine.block_manager.hit_tokens == 16
    assert got[0] == ref.greedy(prompts[0], 12)
    assert got[1] != ref.greedy(prompts[1], 12), "a shared block of other tokens should change the output"


@pytest.mark.parametrize("salt", [b"", b"x"])
def test_keys_are_deterministic_for_one_salt(salt):
    root = root_key(salt)
    assert block_key(root, [1, 2, 3]) == block_key(root_key(salt), [1, 2, 3])
