import itertools
import json
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.errors import KvscopeError
from kvscope.workload import (
    PRESETS,
    ArrivalSpec,
    LengthDist,
    WorkloadRequest,
    WorkloadSpec,
    generate,
    generate_forever,
    load_spec,
    make_burst,
    make_long_prompt,
    parse_spec,
    shared_prefix_tokens,
    spec_to_dict,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ----------------------------------------------------------------- strategies

lengths = st.integers(1, 300)


@st.composite
def bounded_pair(draw):
    a, b = draw(lengths), draw(lengths)
    return min(a, b), max(a, b)


@st.composite
def leaf_dists(draw):
    kind = draw(st.sampled_from(["const", "uniform", "lognormal", "normal"]))
    if kind == "const":
        return LengthDist.const(draw(lengths))
    if kind == "uniform":
        return LengthDist.uniform(*draw(bounded_pair()))
    lo, hi = draw(st.one_of(st.none(), bounded_pair())) or (None, None)
    if draw(st.booleans()):
        hi = None  # one-sided clip
    if kind == "lognormal":
        return LengthDist.lognormal(draw(st.floats(1, 500)), draw(st.floats(0, 2)), lo, hi)
    return LengthDist.normal(draw(st.floats(1, 500)), draw(st.floats(0, 300)), lo, hi)


dists = st.one_of(
    leaf_dists(),
    st.lists(st.tuples(st.floats(0.01, 10), leaf_dists()), min_size=1, max_size=3).map(LengthDist.mixture),
)

arrivals = st.one_of(
    st.just(ArrivalSpec.all_at_once()),
    st.floats(0.1, 100).map(ArrivalSpec.poisson),
    st.builds(
        lambda size, extra, interval, bg: ArrivalSpec.burst(
            size, interval, size_max=None if extra is None else size + extra, background_rate=bg),
        st.integers(1, 8), st.one_of(st.none(), st.integers(0, 8)), st.floats(0.1, 10),
        st.one_of(st.none(), st.floats(0, 5)),
    ),
)


@st.composite
def specs(draw):
    frac = draw(st.floats(0, 1))
    return WorkloadSpec(
        name=draw(st.text("abcxyz-", min_size=1, max_size=8)),
        num_requests=draw(st.integers(1, 40)),
        arrival=draw(arrivals),
        prompt_len=draw(dists),
        output_len=draw(dists),
        shared_prefix_fraction=frac,
        shared_prefix_len=draw(st.integers(1 if frac > 0 else 0, 64)),
        priority_levels=draw(st.one_of(st.none(), st.lists(st.integers(-3, 3), min_size=1, max_size=4))),
        seed=draw(st.integers(0, 2**31)),
    )


def small_spec(**kw):
    base = dict(name="t", num_requests=50, arrival=ArrivalSpec.poisson(5.0),
                prompt_len=LengthDist.uniform(4, 40), output_len=LengthDist.uniform(1, 20))
    base.update(kw)
    return WorkloadSpec(**base)


# ----------------------------------------------------------------- determinism


def test_same_seed_same_workload_different_seed_differs():
    spec = PRESETS["mixed"]
    a = generate(spec, vocab_size=500, seed=3)
    b = generate(spec, vocab_size=500, seed=3)
    c = generate(spec, vocab_size=500, seed=4)
    assert a == b
    assert a != c
    assert generate(spec, vocab_size=500) == generate(spec, vocab_size=500, seed=spec.seed)


def test_seed_is_stable_across_processes():
    # String-seeded Random must not depend on PYTHONHASHSEED. The module is loaded from its
    # file so the child does not pay for the package's heavy imports; this also checks that
    # workload.py needs nothing beyond the standard library.
    import subprocess

    import kvscope.workload as w

    code = ("import importlib.util as u, sys;"
            f"s=u.spec_from_file_location('wl', {w.__file__!r}); m=u.module_from_spec(s);"
            "sys.modules['wl']=m; s.loader.exec_module(m);"
            "r=m.generate(m.PRESETS['chat'], vocab_size=100, num_requests=3, seed=7);"
            "print([(x.arrival, x.prompt[:4], x.max_tokens) for x in r]);"
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": h}, check=True).stdout for h in ("1", "2")}
    assert len(outs) == 1
    ref = generate(PRESETS["chat"], vocab_size=100, num_requests=3, seed=7)
    assert outs.pop().strip() == str([(x.arrival, x.prompt[:4], x.max_tokens) for x in ref])


def test_request_type_and_defaults():
    r = generate(small_spec(), vocab_size=100, num_requests=1)[0]
    assert isinstance(r, WorkloadRequest)
    assert r.priority == 0 and r.ignore_eos is True
    assert not hasattr(r, "__dict__")  # slots


# ----------------------------------------------------------------- bounds


@FAST
@given(d=dists, seed=st.integers(0, 10**6))
def test_length_samples_within_bounds(d, seed):
    from random import Random

    lo, hi = d.bounds()
    rng = Random(seed)
    for _ in range(50):
        x = d.sample(rng)
        assert isinstance(x, int) and x >= lo >= 1
        if hi is not None:
            assert x <= hi


@FAST
@given(spec=specs(), vocab=st.integers(2, 1000), reserved=st.integers(0, 5),
       cap=st.one_of(st.none(), st.integers(1, 200)), tcap=st.one_of(st.none(), st.integers(1, 50)))
def test_generate_respects_spec(spec, vocab, reserved, cap, tcap):
    reserved = min(reserved, vocab - 1)
    reqs = generate(spec, vocab_size=vocab, reserved_ids=reserved, max_prompt_len=cap, max_tokens_cap=tcap)
    assert len(reqs) == spec.num_requests
    arrivals = [r.arrival for r in reqs]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0
    if spec.arrival.kind == "all":
        assert set(arrivals) == {0.0}
    plo, phi = spec.prompt_len.bounds()
    olo, ohi = spec.output_len.bounds()
    prefix = shared_prefix_tokens(spec, vocab_size=vocab, reserved_ids=reserved)
    P = spec.shared_prefix_len
    for r in reqs:
        L = len(r.prompt)
        assert L >= 1
        if cap is not None:
            assert L <= cap
        assert all(0 <= t < vocab - reserved for t in r.prompt)
        if cap is None or L < cap:  # not clipped: plain prompt, or prefix + suffix from prompt_len
            plain = plo <= L and (phi is None or L <= phi)
            prefixed = P > 0 and r.prompt[:P] == prefix and plo <= L - P and (phi is None or L - P <= phi)
            assert plain or prefixed
        assert r.max_tokens >= (olo if tcap is None else min(olo, tcap))
        if ohi is not None:
            assert r.max_tokens <= ohi
        if tcap is not None:
            assert r.max_tokens <= tcap
        if spec.priority_levels is None:
            assert r.priority == 0
        else:
            assert r.priority in spec.priority_levels


def test_poisson_rate_roughly_holds():
    reqs = generate(small_spec(num_requests=2000, arrival=ArrivalSpec.poisson(10.0)), vocab_size=50)
    rate = len(reqs) / reqs[-1].arrival
    assert 9.0 < rate < 11.0


def test_burst_arrivals_group_at_interval_multiples():
    spec = small_spec(num_requests=100, arrival=ArrivalSpec.burst(5, 2.0, size_max=9))
    reqs = generate(spec, vocab_size=50)
    groups = {t: len(list(g)) for t, g in itertools.groupby(r.arrival for r in reqs)}
    times = sorted(groups)
    assert times[0] == 0.0
    assert all(abs(t / 2.0 - round(t / 2.0)) < 1e-9 for t in times)
    assert all(5 <= groups[t] <= 9 for t in times[:-1])  # the last one may be cut short


def test_burst_with_background_has_points_between_bursts():
    spec = small_spec(num_requests=200, arrival=ArrivalSpec.burst(10, 5.0, background_rate=2.0))
    arrivals = [r.arrival for r in generate(spec, vocab_size=50)]
    off_grid = [t for t in arrivals if abs(t / 5.0 - round(t / 5.0)) > 1e-6]
    assert len(off_grid) > 20


def test_prompt_clip_and_reserved_ids():
    spec = PRESETS["long"]
    reqs = generate(spec, vocab_size=300, reserved_ids=44, max_prompt_len=1000, num_requests=20)
    assert all(len(r.prompt) == 1000 for r in reqs)  # all prompts are >= 2048 before clipping
    assert max(t for r in reqs for t in r.prompt) < 256


def test_bad_generate_args():
    for kw in (dict(vocab_size=4, reserved_ids=4), dict(vocab_size=10, max_prompt_len=0),
               dict(vocab_size=10, max_tokens_cap=0), dict(vocab_size=10, num_requests=-1)):
        with pytest.raises(KvscopeError):
            generate(small_spec(), **kw)


# ----------------------------------------------------------------- shared prefix


def test_shared_prefix_fraction_and_identity():
    spec = small_spec(num_requests=200, shared_prefix_fraction=0.8, shared_prefix_len=32,
                      prompt_len=LengthDist.uniform(1, 16))
    reqs = generate(spec, vocab_size=1000, seed=5)
    prefix = shared_prefix_tokens(spec, vocab_size=1000)
    assert len(prefix) == 32
    with_prefix = [r for r in reqs if r.prompt[:32] == prefix]
    assert len(with_prefix) == 160  # exactly round(0.8 * 200) in a generated batch
    for r in with_prefix:
        assert 33 <= len(r.prompt) <= 48
    for r in reqs:
        if r not in with_prefix:
            assert len(r.prompt) <= 16


def test_shared_prefix_preset_and_bursts_share_the_prefix():
    spec = PRESETS["shared-prefix"]
    reqs = generate(spec, vocab_size=32000, seed=1)
    prefixes = [tuple(r.prompt[:256]) for r in reqs if len(r.prompt) > 256]
    assert abs(len(prefixes) / len(reqs) - 0.8) < 0.02
    assert len(set(prefixes)) == 1
    # a burst injected later with another seed reuses the same system prompt
    burst = make_burst("shared-prefix", 20, at=3.0, vocab_size=32000, seed=99)
    assert sum(tuple(r.prompt[:256]) == prefixes[0] for r in burst) == 16


def test_prefix_clipped_by_max_prompt_len():
    spec = small_spec(shared_prefix_fraction=1.0, shared_prefix_len=64)
    reqs = generate(spec, vocab_size=100, max_prompt_len=20)
    prefix = shared_prefix_tokens(spec, vocab_size=100)
    assert all(r.prompt == prefix[:20] for r in reqs)


def test_forever_prefix_fraction_approximate():
    spec = small_spec(shared_prefix_fraction=0.3, shared_prefix_len=8, prompt_len=LengthDist.const(4))
    reqs = list(itertools.islice(generate_forever(spec, vocab_size=1000), 2000))
    share = sum(len(r.prompt) == 12 for r in reqs) / len(reqs)
    assert 0.25 < share < 0.35


# ----------------------------------------------------------------- presets


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_generates(name):
    spec = PRESETS[name]
    assert spec.name == name and 24 <= spec.num_requests <= 256 and spec.description
    reqs = generate(spec, vocab_size=512, reserved_ids=3)
    assert len(reqs) == spec.num_requests
    assert all(r.prompt and r.max_tokens >= 1 for r in reqs)
    assert parse_spec(json.loads(json.dumps(spec_to_dict(spec)))) == spec
    assert load_spec(name) == spec and load_spec(name) is not spec
    assert spec.describe().startswith(name)


def test_required_presets_exist_with_their_shapes():
    assert {"chat", "mixed", "long", "burst", "shared-prefix", "demo"} <= set(PRESETS)
    mixed = generate(PRESETS["mixed"], vocab_size=100, num_requests=256)
    longs = sum(len(r.prompt) >= 2048 for r in mixed)
    assert 0.04 < longs / 256 < 0.18
    assert all(len(r.prompt) <= 512 or 2048 <= len(r.prompt) <= 8192 for r in mixed)
    assert PRESETS["burst"].arrival.kind == "burst" and PRESETS["burst"].arrival.burst_size >= 16
    lp = PRESETS["long"].prompt_len.bounds()
    assert lp == (2048, 8192)
    assert PRESETS["demo"].arrival.kind == "burst" and PRESETS["demo"].arrival.background_rate > 0
    real = PRESETS["realsize"]  # the real-size row of docs/BENCHMARKS.md
    assert real.num_requests == 24 and real.arrival.kind == "all"
    assert real.prompt_len.bounds() == (32, 256) and real.output_len.bounds() == (16, 64)


# ----------------------------------------------------------------- forever / burst / long


def test_generate_forever_increasing_with_periodic_bursts():
    spec = small_spec(arrival=ArrivalSpec.poisson(2.0))
    it = generate_forever(spec, vocab_size=100, seed=1, burst_every_s=5.0, burst_size=7)
    reqs = list(itertools.islice(it, 300))
    arrivals = [r.arrival for r in reqs]
    assert all(a <= b for a, b in zip(arrivals, arrivals[1:]))
    end = arrivals[-1]
    for k in range(1, int(end // 5.0)):
        assert arrivals.count(5.0 * k) == 7
    again = list(itertools.islice(generate_forever(spec, vocab_size=100, seed=1, burst_every_s=5.0,
                                                   burst_size=7), 300))
    assert again == reqs


def test_generate_forever_errors_are_eager():
    with pytest.raises(KvscopeError, match="arrival kind 'all'"):
        generate_forever(small_spec(arrival=ArrivalSpec.all_at_once()), vocab_size=10)
    with pytest.raises(KvscopeError, match="burst_every_s"):
        generate_forever(small_spec(), vocab_size=10, burst_every_s=0)
    # 'all' plus periodic bursts is a valid endless stream
    it = generate_forever(small_spec(arrival=ArrivalSpec.all_at_once()), vocab_size=10, burst_every_s=1.0,
                          burst_size=2)
    assert [r.arrival for r in itertools.islice(it, 6)] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]


def test_make_burst_and_long_prompt():
    b = make_burst(PRESETS["chat"], 12, at=4.5, vocab_size=100, seed=2, reserved_ids=2, max_prompt_len=40)
    assert len(b) == 12 and all(r.arrival == 4.5 and 1 <= len(r.prompt) <= 40 for r in b)
    assert all(t < 98 for r in b for t in r.prompt)
    assert b == make_burst("chat", 12, at=4.5, vocab_size=100, seed=2, reserved_ids=2, max_prompt_len=40)
    assert make_burst("chat", 0, at=0, vocab_size=10, seed=0) == []
    with pytest.raises(KvscopeError, match="unknown workload 'nope'"):
        make_burst("nope", 3, at=0, vocab_size=10, seed=0)
    r = make_long_prompt(3000, at=1.25, vocab_size=64, seed=3, max_tokens=10, reserved_ids=4)
    assert len(r.prompt) == 3000 and r.arrival == 1.25 and r.max_tokens == 10
    assert max(r.prompt) < 60 and r == make_long_prompt(3000, at=1.25, vocab_size=64, seed=3,
                                                        max_tokens=10, reserved_ids=4)
    with pytest.raises(KvscopeError):
        make_long_prompt(0, at=0, vocab_size=10, seed=0)


# ----------------------------------------------------------------- parsing


@FAST
@given(spec=specs())
def test_spec_dict_round_trip(spec):
    d = spec_to_dict(spec)
    assert parse_spec(json.loads(json.dumps(d))) == spec


def _good():
    return {
        "name": "x", "num_requests": 10,
        "arrival": {"kind": "poisson", "rate": 2},
        "prompt_len": {"kind": "mixture", "components": [
            {"weight": 0.9, "dist": {"kind": "uniform", "lo": 8, "hi": 64}},
            [0.1, {"kind": "lognormal", "median": 1000, "sigma": 0.5, "lo": 500, "hi": 2000}],
        ]},
        "output_len": {"kind": "normal", "mean": 50, "std": 10, "lo": 1},
    }


def test_parse_good_and_base_override(tmp_path):
    spec = parse_spec(_good())
    assert spec.prompt_len.components[1][1].median == 1000.0 and spec.arrival.rate == 2.0
    assert spec.prompt_len.bounds() == (8, 2000)
    s2 = parse_spec({"base": "chat", "num_requests": 5, "arrival": {"kind": "all"}})
    assert s2.name == "chat" and s2.num_requests == 5 and s2.prompt_len == PRESETS["chat"].prompt_len
    p = tmp_path / "mine.json"
    p.write_text(json.dumps({k: v for k, v in _good().items() if k != "name"}))
    assert load_spec(str(p)).name == "mine"


def _with(path, value):
    obj = _good()
    cur = obj
    for k in path[:-1]:
        cur = cur[k]
    if value is _DEL:
        del cur[path[-1]]
    else:
        cur[path[-1]] = value
    return obj


_DEL = object()

BAD = [
    (("arrival", "kind"), "gamma", "arrival.kind"),
    (("arrival", "rate"), -1, "arrival.rate"),
    (("arrival", "rate"), _DEL, "arrival.rate is required"),
    (("arrival", "burst_size"), 4, "arrival.burst_size is not used"),
    (("prompt_len",), {"kind": "uniform", "lo": 10, "hi": 5}, "prompt_len.lo=10 > prompt_len.hi=5"),
    (("prompt_len",), {"kind": "const", "value": -3}, "prompt_len.value must be >= 1"),
    (("prompt_len",), {"kind": "const", "value": 2.5}, "prompt_len.value must be an integer"),
    (("prompt_len",), {"kind": "const", "value": True}, "prompt_len.value must be an integer"),
    (("prompt_len",), {"value": 3}, "prompt_len.kind is required"),
    (("prompt_len",), 7, "prompt_len must be an object"),
    (("prompt_len",), {"kind": "zipf"}, "prompt_len.kind must be one of"),
    (("prompt_len",), {"kind": "uniform", "lo": 1, "hi": 2, "hello": 1}, "prompt_len.hello is not used"),
    (("prompt_len", "components"), [], "prompt_len.components must be a non-empty list"),
    (("prompt_len", "components", 0, "weight"), 0, "prompt_len.components[0].weight must be > 0"),
    (("prompt_len", "components", 0, "dist", "hi"), 2, "prompt_len.components[0].dist.lo=8 > "),
    (("prompt_len", "components", 1), [1, 2, 3], "prompt_len.components[1] must be"),
    (("output_len", "std"), -1, "output_len.std must be >= 0"),
    (("output_len", "std"), float("nan"), "output_len.std must be a finite number"),
    (("shared_prefix_fraction",), 1.5, "shared_prefix_fraction must be in [0, 1]"),
    (("shared_prefix_fraction",), 0.5, "shared_prefix_len must be >= 1"),
    (("shared_prefix_len",), -2, "shared_prefix_len must be >= 0"),
    (("priority_levels",), [], "priority_levels"),
    (("priority_levels",), ["hi"], "priority_levels"),
    (("num_requests",), 0, "num_requests must be >= 1"),
    (("num_requests",), _DEL, "missing required key 'num_requests'"),
    (("seed",), "x", "seed must be an integer"),
    (("name",), "", "name must be a non-empty string"),
    (("colour",), "red", "unknown key 'colour'"),
    (("base",), "nope", "base must be a preset"),
]


@pytest.mark.parametrize("path,value,needle", BAD, ids=[b[2] for b in BAD])
def test_parse_errors_are_one_line_and_name_the_key(path, value, needle):
    with pytest.raises(KvscopeError) as ei:
        parse_spec(_with(path, value))
    msg = str(ei.value)
    assert "\n" not in msg and needle in msg, msg
    assert isinstance(ei.value, KvscopeError) and not isinstance(ei.value, ValueError)


def test_parse_rejects_non_dict():
    with pytest.raises(KvscopeError, match="expected a JSON object"):
        parse_spec([1, 2])


def test_direct_construction_is_validated():
    with pytest.raises(KvscopeError, match="lo=3 > hi=2"):
        LengthDist.uniform(3, 2)
    with pytest.raises(KvscopeError, match="burst_size_max=1 is below"):
        ArrivalSpec.burst(4, 1.0, size_max=1)
    with pytest.raises(KvscopeError, match="not used by kind 'const'"):
        LengthDist("const", value=3, lo=1)


def test_load_spec_errors(tmp_path):
    with pytest.raises(KvscopeError) as ei:
        load_spec("chatt")
    assert str(ei.value) == ("unknown workload 'chatt' (choose from chat, mixed, long, burst, "
                             "shared-prefix, demo, realsize or a .json file)")
    with pytest.raises(KvscopeError, match="cannot read workload file"):
        load_spec(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{\n  'a': 1,\n}")
    with pytest.raises(KvscopeError) as ei:
        load_spec(str(bad))
    assert "invalid JSON" in str(ei.value) and "\n" not in str(ei.value)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(_with(("arrival", "kind"), "nope")))
    with pytest.raises(KvscopeError) as ei:
        load_spec(str(wrong))
    assert "wrong.json" in str(ei.value) and "arrival.kind" in str(ei.value) and "\n" not in str(ei.value)


def test_a_generated_list_holds_a_bounded_number_of_prompt_tokens(monkeypatch, tmp_path, capsys):
    """A bench generates its whole workload up front: a spec asking for a million long prompts is
    refused in one line at the bound, instead of a MemoryError; generate_iter still streams it."""
    import importlib

    from kvscope.cli import main

    gen_mod = importlib.import_module("kvscope.workload.generate")  # the module (the package re-exports a function)
    monkeypatch.setattr(gen_mod, "MAX_HELD_TOKENS", 5000)
    spec = {"num_requests": 1000000, "arrival": {"kind": "all"}, "prompt_len": {"kind": "const", "value": 1000},
            "output_len": {"kind": "const", "value": 2}}
    (tmp_path / "w.json").write_text(json.dumps(spec))
    with pytest.raises(gen_mod.WorkloadError, match="pass 5,000 tokens after 5 of its requests"):
        gen_mod.generate(gen_mod.load_spec(str(tmp_path / "w.json")), vocab_size=100)
    stream = gen_mod.generate_iter(gen_mod.load_spec(str(tmp_path / "w.json")), vocab_size=100)
    assert sum(len(next(stream).prompt) for _ in range(50)) == 50_000  # a stream holds what it reached
    assert main(["bench", "--backend", "sim", "--model", "llama-3.3-70b-fp8", "--modes", "chunked",
                 "--workload", str(tmp_path / "w.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "more than a list of them may hold in memory" in err[0], err
