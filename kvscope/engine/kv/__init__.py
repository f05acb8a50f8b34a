"""The paged KV cache's bookkeeping: blocks, refcounts, the prefix cache, the change queue, swap's CPU pool, the
KV budget. No torch at import."""
