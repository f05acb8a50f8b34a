"""A watcher written from docs/PROTOCOL.md alone: it reads the wire's plain msgpack (no kvscope decoder,
no BlockMap, no reducer), rebuilds the block map from the snapshots and the step deltas, and checks every
rule the document gives a consumer ("Checking a stream": ids, counters, snapshots).

    c = DocsConsumer()
    for frame in frames:          # bytes, as a subscriber receives them
        c.feed(frame)
    assert not c.mismatches, c.mismatches[:5]

Each broken rule is one line in ``mismatches`` (event type, step, rule, what was found); ``checked`` counts
the steps and snapshots checked.
"""

from __future__ import annotations

import msgspec

# KvCounters, by position (docs/PROTOCOL.md, "Nested records"); a shorter array fills the rest with 0
KV_FIELDS = ("total", "used", "free", "cached", "shared", "token_slots", "tail_waste", "reserve_waste",
             "swap_total", "swap_used", "hit_tokens", "query_tokens", "cow_copies")


def kv_of(arr: list) -> dict:
    return {k: (arr[i] if i < len(arr) else 0) for i, k in enumerate(KV_FIELDS)}


class DocsConsumer:
    def __init__(self) -> None:
        self.config: dict = {}
        self.started = False  # a snapshot has been seen (steps before one cannot be checked)
        self.owner: dict[int, int] = {}  # owned block -> its claimer
        self.refc: dict[int, int] = {}  # owned block -> refcount (> 0)
        self.cached: set[int] = set()  # refcount 0, holding a reusable prefix
        self.tables: dict[int, list[int]] = {}
        self.queues: tuple = ([], [], [], [])
        self.total: int | None = None
        self.mismatches: list[str] = []
        self.checked = 0
        self.steps = 0
        self.snapshots = 0
        self.last_kv: dict | None = None
        self.seen = {"preemptions": 0, "hits": 0, "shared": 0, "cached": 0}  # what the stream exercised

    # ---- reading ---------------------------------------------------------------------
    def feed(self, frame: bytes) -> None:
        ev = msgspec.msgpack.decode(frame)
        kind = ev.get("type")
        if kind == "hello":
            self.config = dict(ev.get("config") or {})
        elif kind == "snapshot":
            self._snapshot(ev)
        elif kind == "step" and self.started:
            self._step(ev)

    def _bad(self, ev: dict, rule: str, what: str) -> None:
        self.mismatches.append(f"{ev.get('type')} {ev.get('step')}: {rule}: {what}")

    # ---- the rules ----------------------------------------------------------------------
    def _lists_blocks(self) -> bool:
        """The stat-logger plugin's stream (backend vllm-plugin) carries counters but no blocks."""
        return self.config.get("backend") != "vllm-plugin"

    def _check_ids(self, ev: dict, ids) -> None:
        """Block ids are in [0, num_blocks) and never the null block."""
        n = self.config.get("num_blocks")
        null = self.config.get("null_block")
        for b in ids:
            if (n is not None and not 0 <= b < n) or b == null:
                self._bad(ev, "block id", f"{b} (num_blocks {n}, null_block {null})")

    def _check_kv(self, ev: dict, kv: dict) -> None:
        n, null, bs = self.config.get("num_blocks"), self.config.get("null_block"), self.config.get("block_size", 16)
        if n is not None and kv["total"] != n - (null is not None):
            self._bad(ev, "total = num_blocks - (1 if null_block)", f"total {kv['total']}, num_blocks {n}, null {null}")
        if self.total is not None and kv["total"] != self.total:
            self._bad(ev, "total is constant", f"{self.total} then {kv['total']}")
        self.total = kv["total"]
        if kv["used"] + kv["free"] != kv["total"]:
            self._bad(ev, "used + free = total", f"{kv['used']} + {kv['free']} != {kv['total']}")
        if not kv["cached"] <= kv["free"]:
            self._bad(ev, "cached <= free", f"{kv['cached']} > {kv['free']}")
        if not self._lists_blocks():
            return
        owned = len(self.refc)
        shared = sum(1 for c in self.refc.values() if c > 1)
        got = (kv["used"], kv["shared"], kv["cached"])
        if got != (owned, shared, len(self.cached)):
            self._bad(ev, "used, shared, cached = the map's", f"counters {got}, map {(owned, shared, len(self.cached))}")
        held = sum(len(t) for t in self.tables.values())
        slots = kv["token_slots"] + kv["tail_waste"] + kv["reserve_waste"]
        if slots != bs * held:
            self._bad(ev, "token_slots + tail_waste + reserve_waste = block_size x table entries",
                      f"{slots} != {bs} x {held}")
        if kv["tail_waste"] > (bs - 1) * len(self.tables):
            self._bad(ev, "tail_waste < block_size per table", f"{kv['tail_waste']} over {len(self.tables)} tables")
        if sum(self.refc.values()) != held:
            self._bad(ev, "refcounts sum to the table entries", f"{sum(self.refc.values())} != {held}")
        for req, table in self.tables.items():
            lost = [b for b in table if b not in self.refc]
            if lost:
                self._bad(ev, "a table holds owned blocks only", f"request {req}: {lost[:5]}")

    def _snapshot(self, ev: dict) -> None:
        blocks = ev.get("blocks") or []
        tables = {req: list(t) for req, t in ev.get("block_tables") or []}
        owner = {b: req for b, req, c in blocks if c > 0}
        refc = {b: c for b, _, c in blocks if c > 0}
        cached = {b for b, _, c in blocks if c <= 0}
        queues = tuple(list(ev.get(k) or []) for k in ("running", "waiting", "preempted", "swapped"))
        if self.started and self._lists_blocks():  # the state rebuilt from the deltas must be the snapshot
            if refc != self.refc:
                diff = sorted(set(refc.items()) ^ set(self.refc.items()))[:6]
                self._bad(ev, "snapshot refcounts = rebuilt", f"differ at {diff}")
            mine = {b: o for b, o in self.owner.items() if b in self.refc}
            if owner != mine:
                diff = sorted(b for b in set(owner) | set(mine) if owner.get(b) != mine.get(b))[:6]
                self._bad(ev, "snapshot owners (claimers) = rebuilt",
                          f"blocks {diff}: snapshot {[owner.get(b) for b in diff]}, rebuilt {[mine.get(b) for b in diff]}")
            if cached != self.cached:
                self._bad(ev, "snapshot cached = rebuilt", f"differ at {sorted(cached ^ self.cached)[:6]}")
            if {r: t for r, t in tables.items() if t} != {r: t for r, t in self.tables.items() if t}:
                diff = sorted(r for r in set(tables) | set(self.tables) if tables.get(r, []) != self.tables.get(r, []))
                self._bad(ev, "snapshot tables = rebuilt", f"requests {diff[:6]}")
            if self.steps and queues != self.queues:
                self._bad(ev, "snapshot queues = the last step's", f"{queues} != {self.queues}")
        self.owner, self.refc, self.cached, self.tables, self.queues = owner, refc, cached, tables, queues
        self._check_ids(ev, [b for b, _, _ in blocks] + [b for t in tables.values() for b in t])
        self._check_kv(ev, kv_of(ev.get("kv") or []))
        self.started = True
        self.snapshots += 1
        self.checked += 1

    def _step(self, ev: dict) -> None:
        alloc = [(b, r) for b, r in ev.get("alloc") or []]
        freed = list(ev.get("freed") or [])
        refs = [(b, c) for b, c in ev.get("refs") or []]
        self._check_ids(ev, freed + [b for b, _ in alloc] + [b for b, _ in refs])
        # a request's table ends when it is preempted or finishes
        for p in ev.get("preemptions") or []:
            self.tables.pop(p[0], None)
        for f in ev.get("finished") or []:
            self.tables.pop(f[0], None)
        # 1. remove every block in freed (it leaves its owner's table)
        for b in freed:
            o = self.owner.pop(b, None)
            if o is not None and b in self.tables.get(o, ()):
                self.tables[o].remove(b)
            self.refc.pop(b, None)
            self.cached.discard(b)
        # 2. alloc: the block joins the request's table; the first entry that finds it free, cached or dropped
        #    to 0 earlier in the step makes that request its owner; a block still owned keeps its owner
        zeroed = {b for b, c in refs if c <= 0}
        claimed: set[int] = set()
        for b, req in alloc:
            if b not in claimed and (b not in self.refc or b in zeroed):
                self.owner[b] = req
                self.refc[b] = 1
                claimed.add(b)
            else:
                self.refc[b] = self.refc.get(b, 0) + 1
            self.cached.discard(b)
            self.tables.setdefault(req, []).append(b)
        # 3. refs: the last entry per block wins; a block freed and not in alloc takes none
        gone = set(freed) - {b for b, _ in alloc}
        for b, c in dict(refs).items():
            if b in gone:
                continue
            if c > 0:
                self.refc[b] = c
                self.cached.discard(b)
            else:
                self.refc.pop(b, None)
                self.cached.add(b)  # refcount 0 and not freed: cached (it keeps its last claimer)
        self.tables = {r: t for r, t in self.tables.items() if t}
        self.queues = tuple(list(ev.get(k) or []) for k in ("running", "waiting", "preempted", "swapped"))
        live = set().union(*map(set, self.queues))
        for req in self.tables:
            if req not in live:
                self._bad(ev, "a table belongs to a live request", f"request {req} is in no queue")
        self.last_kv = kv_of(ev.get("kv") or [])
        self.seen["preemptions"] += len(ev.get("preemptions") or [])
        self.seen["hits"] += len(ev.get("hits") or [])
        self.seen["shared"] += self.last_kv["shared"] > 0
        self.seen["cached"] += self.last_kv["cached"] > 0
        self._check_kv(ev, self.last_kv)
        self.steps += 1
        self.checked += 1
