"""Requests drawn from a spec: a finite list (``generate``), an endless stream
(``generate_forever``), and the bursts and long prompts the control channel injects.

Randomness is ``random.Random`` seeded from strings, so a seed gives the same
requests on every machine and Python run.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from random import Random
from typing import Iterator

from .arrivals import burst_times
from .checks import MAX_LEN, WorkloadError, is_int, is_num, short_repr
from .files import load_spec
from .spec import MAX_REQUESTS, WorkloadSpec


# The prompt tokens one generate() list may hold (about 36 bytes each as Python ints: 1.2 GB);
# generate_iter and a server's stream hold only the requests they have reached.
MAX_HELD_TOKENS = 1 << 25


@dataclass(slots=True)
class WorkloadRequest:
    arrival: float  # seconds from the start of the workload
    prompt: list[int]  # token ids
    max_tokens: int
    priority: int = 0
    ignore_eos: bool = True


def _rng(seed: int, stream: str) -> Random:
    return Random(f"kvscope.workload/{seed}/{stream}")


def _check_gen_args(vocab_size: int, reserved_ids: int, max_prompt_len: int | None,
                    max_tokens_cap: int | None) -> int:
    if not is_int(vocab_size) or not is_int(reserved_ids) or reserved_ids < 0:
        raise WorkloadError(f"vocab_size and reserved_ids must be integers >= 0, "
                         f"got {short_repr(vocab_size)}, {short_repr(reserved_ids)}")
    usable = vocab_size - reserved_ids
    if usable < 1:
        raise WorkloadError(f"no usable token ids: vocab_size={vocab_size} reserved_ids={reserved_ids}")
    if max_prompt_len is not None and (not is_int(max_prompt_len) or max_prompt_len < 1):
        raise WorkloadError(f"max_prompt_len must be an integer >= 1, got {short_repr(max_prompt_len)}")
    if max_tokens_cap is not None and (not is_int(max_tokens_cap) or max_tokens_cap < 1):
        raise WorkloadError(f"max_tokens_cap must be an integer >= 1, got {short_repr(max_tokens_cap)}")
    return usable


def _tokens(rng: Random, n: int, usable: int) -> list[int]:
    return rng.choices(range(usable), k=n)


def shared_prefix_tokens(spec: WorkloadSpec, *, vocab_size: int, reserved_ids: int = 0) -> list[int]:
    """The spec's shared prefix. It depends on the spec's name and seed only (not the seed
    given to ``generate``), so requests injected later share it with the running workload."""
    usable = _check_gen_args(vocab_size, reserved_ids, None, None)
    return _tokens(_rng(spec.seed, f"prefix/{spec.name}"), spec.shared_prefix_len, usable)


class _Maker:
    """Draws one request at a time from a spec."""

    def __init__(self, spec: WorkloadSpec, seed: int, usable: int, max_prompt_len: int | None,
                 max_tokens_cap: int | None, prefix: list[int]):
        self.spec, self.usable, self.prefix = spec, usable, prefix
        self.max_prompt_len, self.max_tokens_cap = max_prompt_len, max_tokens_cap
        self.rng = _rng(seed, "requests")

    def make(self, arrival: float, shared: bool) -> WorkloadRequest:
        spec, rng = self.spec, self.rng
        n = spec.prompt_len.sample(rng)
        out = spec.output_len.sample(rng)
        if self.max_tokens_cap is not None:
            out = min(out, self.max_tokens_cap)
        prio = rng.choice(spec.priority_levels) if spec.priority_levels else 0
        cap = self.max_prompt_len
        if shared:
            pre = self.prefix if cap is None else self.prefix[:cap]
            if cap is not None:
                n = min(n, cap - len(pre))
            prompt = pre + _tokens(rng, n, self.usable)
        else:
            if cap is not None:
                n = min(n, cap)
            prompt = _tokens(rng, max(1, n), self.usable)
        return WorkloadRequest(arrival=arrival, prompt=prompt, max_tokens=max(1, out), priority=prio)


def _batch(spec: WorkloadSpec, times: list[float], seed: int, vocab_size: int, reserved_ids: int,
           max_prompt_len: int | None, max_tokens_cap: int | None) -> Iterator[WorkloadRequest]:
    """The requests for these arrival times, in order, made one at a time (arguments checked now)."""
    usable = _check_gen_args(vocab_size, reserved_ids, max_prompt_len, max_tokens_cap)
    n = len(times)
    prefix = shared_prefix_tokens(spec, vocab_size=vocab_size, reserved_ids=reserved_ids)
    # Exactly round(fraction * n) requests carry the prefix, chosen at random.
    shared = set(_rng(seed, "shared").sample(range(n), round(spec.shared_prefix_fraction * n)))
    maker = _Maker(spec, seed, usable, max_prompt_len, max_tokens_cap, prefix)
    return (maker.make(t, i in shared) for i, t in enumerate(times))


def _times(spec: WorkloadSpec, num_requests: int | None, seed: int | None) -> tuple[list[float], int]:
    n = spec.num_requests if num_requests is None else num_requests
    if not is_int(n) or not 0 <= n <= MAX_REQUESTS:
        raise WorkloadError(f"num_requests must be an integer in [0, {MAX_REQUESTS}], got {short_repr(n)}")
    seed = spec.seed if seed is None else seed
    arrivals = spec.arrival.times(_rng(seed, "arrival"))
    return [next(arrivals) for _ in range(n)], seed


def generate_iter(spec: WorkloadSpec, *, vocab_size: int, num_requests: int | None = None,
                  seed: int | None = None, max_prompt_len: int | None = None,
                  max_tokens_cap: int | None = None, reserved_ids: int = 0) -> Iterator[WorkloadRequest]:
    """``generate``'s requests, in the same order, made as they are consumed: a server holds
    only those it has reached, however many the spec asks for. Arguments are checked at the call."""
    times, seed = _times(spec, num_requests, seed)
    return _batch(spec, times, seed, vocab_size, reserved_ids, max_prompt_len, max_tokens_cap)


def generate(spec: WorkloadSpec, *, vocab_size: int, num_requests: int | None = None,
             seed: int | None = None, max_prompt_len: int | None = None,
             max_tokens_cap: int | None = None, reserved_ids: int = 0) -> list[WorkloadRequest]:
    """The spec's requests, sorted by arrival; the same list for the same arguments.

    Token ids are uniform in [0, vocab_size - reserved_ids). Prompts are clipped to
    ``max_prompt_len`` (the shared prefix first keeps its tokens), outputs to
    ``max_tokens_cap``; both stay >= 1.
    """
    # Arrival times never decrease, so the requests come out sorted by arrival.
    out, held = [], 0
    for r in generate_iter(spec, vocab_size=vocab_size, num_requests=num_requests, seed=seed,
                           max_prompt_len=max_prompt_len, max_tokens_cap=max_tokens_cap, reserved_ids=reserved_ids):
        held += len(r.prompt)
        if held > MAX_HELD_TOKENS:
            raise WorkloadError(f"workload {short_repr(spec.name)}: its prompts pass {MAX_HELD_TOKENS:,} tokens after "
                                f"{len(out):,} of its requests, more than a list of them may hold in memory "
                                "(ask for fewer requests or shorter prompts)")
        out.append(r)
    return out


def generate_forever(spec: WorkloadSpec, *, vocab_size: int, seed: int | None = None,
                     reserved_ids: int = 0, max_prompt_len: int | None = None,
                     burst_every_s: float | None = None, burst_size: int = 16,
                     max_tokens_cap: int | None = None) -> Iterator[WorkloadRequest]:
    """An endless stream with non-decreasing arrivals (``num_requests`` is ignored).

    With ``burst_every_s``, ``burst_size`` extra requests arrive together at
    t = burst_every_s, 2*burst_every_s, ... Each request carries the shared prefix with
    probability ``shared_prefix_fraction``. Arguments are checked at the call, not lazily.
    """
    if spec.arrival.kind == "all" and burst_every_s is None:
        raise WorkloadError(f"workload {short_repr(spec.name)} has arrival kind 'all'; an endless stream "
                         "needs poisson or burst arrivals (or burst_every_s)")
    if burst_every_s is not None:
        if not is_num(burst_every_s) or burst_every_s <= 0:
            raise WorkloadError(f"burst_every_s must be > 0, got {short_repr(burst_every_s)}")
        if not is_int(burst_size) or burst_size < 1:
            raise WorkloadError(f"burst_size must be an integer >= 1, got {short_repr(burst_size)}")
    usable = _check_gen_args(vocab_size, reserved_ids, max_prompt_len, max_tokens_cap)
    seed = spec.seed if seed is None else seed
    prefix = shared_prefix_tokens(spec, vocab_size=vocab_size, reserved_ids=reserved_ids)
    maker = _Maker(spec, seed, usable, max_prompt_len, max_tokens_cap, prefix)
    share_rng = _rng(seed, "shared")

    def stream() -> Iterator[WorkloadRequest]:
        streams: list[Iterator[float]] = []
        if spec.arrival.kind != "all":
            streams.append(spec.arrival.times(_rng(seed, "arrival")))
        if burst_every_s is not None:
            streams.append(burst_times(float(burst_every_s), burst_size, burst_size, Random(0), first=1))
        frac = spec.shared_prefix_fraction
        for t in heapq.merge(*streams):
            yield maker.make(t, frac > 0 and share_rng.random() < frac)

    return stream()


def make_burst(spec_or_name: WorkloadSpec | str, n: int, *, at: float, vocab_size: int, seed: int,
               reserved_ids: int = 0, max_prompt_len: int | None = None,
               max_tokens_cap: int | None = None) -> list[WorkloadRequest]:
    """``n`` requests drawn from a workload (a spec, preset name or .json path), all
    arriving at ``at``. They share the workload's prefix, if it has one."""
    spec = load_spec(spec_or_name) if isinstance(spec_or_name, str) else spec_or_name
    if not is_int(n) or not 0 <= n <= MAX_REQUESTS:
        raise WorkloadError(f"burst size must be an integer in [0, {MAX_REQUESTS}], got {short_repr(n)}")
    if not is_num(at) or at < 0:
        raise WorkloadError(f"burst time must be >= 0, got {short_repr(at)}")
    return list(_batch(spec, [float(at)] * n, seed, vocab_size, reserved_ids, max_prompt_len, max_tokens_cap))


def make_long_prompt(length: int, *, at: float, vocab_size: int, seed: int, max_tokens: int = 64,
                     reserved_ids: int = 0) -> WorkloadRequest:
    """One request with a random prompt of exactly ``length`` tokens, arriving at ``at``."""
    usable = _check_gen_args(vocab_size, reserved_ids, None, None)
    if not is_int(length) or not 1 <= length <= MAX_LEN:
        raise WorkloadError(f"prompt length must be an integer in [1, {MAX_LEN}], got {short_repr(length)}")
    if not is_int(max_tokens) or max_tokens < 1:
        raise WorkloadError(f"max_tokens must be an integer >= 1, got {short_repr(max_tokens)}")
    prompt = _tokens(_rng(seed, f"long/{length}"), length, usable)
    return WorkloadRequest(arrival=float(at), prompt=prompt, max_tokens=max_tokens)
