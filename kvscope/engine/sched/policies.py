"""Scheduling policies: who waits in which order, and who is preempted.

A policy is a small class with four methods, called by the scheduler (pure logic,
no torch). The scheduler keeps every other rule: token budget, max_num_seqs, KV
blocks, modes, swapping. See docs/POLICIES.md for how to write your own and run it
with ``--policy module:Class``.

- ``order(waiting, step)``: the WAITING queue (new and preempted requests) in the
  order admission should try them. Admission is head-of-line: it stops at the first
  request that does not fit, so this order is exactly the order of service. The
  order is published in every step event (``waiting`` / ``preempted``).
- ``victim(running, needy)``: a running request to preempt when ``needy`` (itself
  running) needs a KV block and none is free. Returning ``needy`` preempts the
  requester itself.
- ``arrival_victim(head, running)``: when the head of WAITING cannot be admitted
  (no KV blocks, or max_num_seqs reached), a running request it may preempt, or None.
- ``on_arrival(request, step)``: called once when a request enters the scheduler.

Requests expose ``req_id``, ``priority``, ``arrival``, ``status``,
``num_prompt_tokens``, ``num_computed_tokens``, ``num_tokens``,
``num_output_tokens``, ``params.max_tokens`` and ``arrival_step`` (the scheduler
step at which it was added).
"""

from __future__ import annotations

import importlib
from typing import Sequence

from kvscope.errors import KvscopeError
from kvscope.engine.request import Request


class Policy:
    """First come, first served (the base behaviour every policy can fall back on)."""

    name = "fcfs"

    def on_arrival(self, request: Request, step: int) -> None:
        """A request entered the scheduler at this step (before its first schedule)."""

    def order(self, waiting: Sequence[Request], step: int) -> list[Request]:
        """WAITING in service order. FCFS: preempted requests first (newest preemption first), then arrivals."""
        return list(waiting)

    def victim(self, running: Sequence[Request], needy: Request) -> Request:
        """Whom to preempt so that `needy` gets a block. FCFS: the newest running request."""
        return running[-1]

    def arrival_victim(self, head: Request, running: Sequence[Request]) -> Request | None:
        """A running request that the blocked head of WAITING may preempt. FCFS: none."""
        return None


FCFS = Policy


def remaining_work(req: Request) -> int:
    """Expected remaining work in tokens: prompt (and outputs) left to prefill + tokens left to generate."""
    return (req.num_tokens - req.num_computed_tokens) + (req.params.max_tokens - req.num_output_tokens)


class SJF(Policy):
    """Shortest (expected remaining) job first, with aging.

    Score = remaining_work - aging * steps_waited; lowest first, ties by arrival.
    A request r that has `w` tokens of work ranks ahead of every request that
    arrived more than `w / aging` steps after it, whatever that request's work,
    so only a bounded set of requests can ever pass r: it is never starved.
    """

    name = "sjf"
    aging = 1.0  # tokens of work forgiven per scheduler step spent waiting

    def score(self, req: Request, step: int) -> float:
        return remaining_work(req) - self.aging * (step - req.arrival_step)

    def order(self, waiting: Sequence[Request], step: int) -> list[Request]:
        return sorted(waiting, key=lambda r: (self.score(r, step), r.arrival_step, r.req_id))


class PriorityPolicy(Policy):
    """Higher `priority` first (ties: first come, first served).

    A higher-priority request that cannot be admitted (no KV blocks, or no free
    sequence slot) preempts the lowest-priority running request, only if that one's
    priority is strictly lower. When a running request needs a block, the victim is
    the lowest-priority running request (newest among equals).
    """

    name = "priority"

    def order(self, waiting: Sequence[Request], step: int) -> list[Request]:
        return sorted(waiting, key=lambda r: (-r.priority, r.arrival_step, r.req_id))

    @staticmethod
    def _lowest(running: Sequence[Request]) -> Request:
        # lowest priority; among equals the newest (last in admission order)
        best = running[-1]
        for r in reversed(running):
            if r.priority < best.priority:
                best = r
        return best

    def victim(self, running: Sequence[Request], needy: Request) -> Request:
        return self._lowest(running)

    def arrival_victim(self, head: Request, running: Sequence[Request]) -> Request | None:
        if not running:
            return None
        low = self._lowest(running)
        return low if low.priority < head.priority else None


BUILTIN = {"fcfs": Policy, "sjf": SJF, "priority": PriorityPolicy}
METHODS = ("order", "victim", "arrival_victim", "on_arrival")


def load_policy(spec: str) -> Policy:
    """A built-in name (fcfs, sjf, priority) or 'module:Class'; raises KvscopeError with one line if it can't."""
    if spec in BUILTIN:
        return BUILTIN[spec]()
    if ":" not in spec:
        raise KvscopeError(f"unknown policy {spec!r} (choose from {', '.join(BUILTIN)}, or give module:Class)")
    module_name, _, class_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise KvscopeError(f"policy {spec!r}: cannot import {module_name!r}: {type(e).__name__}: {e}") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise KvscopeError(f"policy {spec!r}: module {module_name!r} has no {class_name!r}")
    try:
        policy = cls() if isinstance(cls, type) else None
    except Exception as e:
        raise KvscopeError(f"policy {spec!r}: {class_name}() failed: {type(e).__name__}: {e}") from None
    if policy is None:
        raise KvscopeError(f"policy {spec!r}: {class_name!r} is not a class")
    # A user class need not subclass Policy; missing methods fall back to FCFS's.
    missing = [m for m in ("order",) if not callable(getattr(policy, m, None))]
    if missing:
        raise KvscopeError(f"policy {spec!r}: {class_name} lacks {', '.join(missing)}() (see docs/POLICIES.md)")
    if not isinstance(policy, Policy):
        base = Policy()
        for m in METHODS:
            if not callable(getattr(policy, m, None)):
                setattr(policy, m, getattr(base, m))
    return policy
