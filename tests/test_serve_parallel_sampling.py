"""Parallel sampling over HTTP: `n` choices from one request, the prompt's KV blocks shared n ways.

The engine forks the request into n sequences (kvscope/engine/sched/scheduler.py); the server answers
them as choices 0..n-1, streamed (each chunk names its choice, each choice ends with its own
finish_reason) and not. usage counts the prompt once and sums the choices. Completions'
best_of keeps the n best by cumulative logprob; chat's echo starts the content with the
assistant's last message.
"""

from __future__ import annotations

from collections import defaultdict

import httpx
import openai
import pytest

from kvscope.engine.config import EngineConfig
from kvscope.engine.sampling_params import MAX_N
from kvscope.protocol.events import FINISH_ABORT, SOURCE_HTTP
from kvscope.tui.model.state import new_state, reduce
from kvscope.tui.widgets.request import BlockTablePanel
from tests._serve import serving
from tests.fakes.faults import FaultySampler

CONFIG = dict(num_blocks=256, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=512, dtype="float32")
PROMPT = "The scheduler forks one prompt into four sequences."  # 51 bytes: 3 full blocks of 16, then a partial
GREEDY = dict(max_tokens=10, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def live():
    with serving(EngineConfig(**CONFIG)) as live:
        yield live


@pytest.fixture
def client(live):
    with openai.OpenAI(base_url=live.base_url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(live.base_url + path, json=body, timeout=120)


def streamed_choices(chunks) -> tuple[dict[int, str], dict[int, list]]:
    """index -> text and index -> the finish reasons its chunks carried (None for the open ones)."""
    texts, reasons = defaultdict(str), defaultdict(list)
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += (ch.delta.content or "") if hasattr(ch, "delta") else ch.text
            reasons[ch.index].append(ch.finish_reason)
    return dict(texts), dict(reasons)


# ---- n greedy choices equal the single one ---------------------------------------------------
def test_completions_n4_greedy_gives_four_copies_of_n1_plain_and_streamed(live, client):
    one = client.completions.create(model="tiny", prompt=PROMPT, **GREEDY)
    four = client.completions.create(model="tiny", prompt=PROMPT, n=4, **GREEDY)
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert [c.text for c in four.choices] == [one.choices[0].text] * 4 and one.choices[0].text
    assert [c.finish_reason for c in four.choices] == ["length"] * 4
    assert four.usage.prompt_tokens == one.usage.prompt_tokens == len(PROMPT.encode()), "the prompt counts once"
    assert four.usage.completion_tokens == 4 * one.usage.completion_tokens == 40
    assert four.usage.total_tokens == four.usage.prompt_tokens + 40
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, n=4, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    texts, reasons = streamed_choices(chunks)
    assert texts == {i: one.choices[0].text for i in range(4)}
    for i in range(4):  # each choice's own finish chunk, its last, and no other
        assert reasons[i][-1] == "length" and reasons[i][:-1].count(None) == len(reasons[i]) - 1
    assert all(len(c.choices) <= 1 for c in chunks), "a chunk carries one choice"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    live.wait_until(live.idle, what="the pool to drain")
    assert live.engine.block_manager.num_used == 0


def test_chat_n4_greedy_gives_four_copies_of_n1_plain_and_streamed(live, client):
    messages = [{"role": "user", "content": "Name a scheduler."}]
    one = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    four = client.chat.completions.create(model="tiny", messages=messages, n=4, **GREEDY)
    want = one.choices[0].message.content
    assert [(c.index, c.message.role, c.message.content) for c in four.choices] == [
        (i, "assistant", want) for i in range(4)]
    assert four.usage.prompt_tokens == one.usage.prompt_tokens
    assert four.usage.completion_tokens == 4 * one.usage.completion_tokens
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, n=4, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    roles = [ch.index for c in chunks for ch in c.choices if ch.delta.role == "assistant"]
    assert roles == [0, 1, 2, 3], "each choice opens with its role"
    texts, reasons = streamed_choices(chunks)
    assert texts == {i: want for i in range(4)}
    assert all(r[-1] == "length" and r.count("length") == 1 for r in reasons.values())
    assert chunks[-1].usage.completion_tokens == four.usage.completion_tokens


def test_logprobs_come_per_choice(live):
    r = post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                                       "n": 3, "logprobs": 2}).json()
    lps = [c["logprobs"] for c in r["choices"]]
    assert all(len(lp["tokens"]) == 5 and len(lp["top_logprobs"]) == 5 for lp in lps)
    assert lps[0]["tokens"] == lps[1]["tokens"] == lps[2]["tokens"], "greedy: the same tokens"
    for lp in lps[1:]:  # the same logprobs, up to float rounding across batch rows
        assert lp["token_logprobs"] == pytest.approx(lps[0]["token_logprobs"], abs=1e-4)
    chat = post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                               "temperature": 0, "ignore_eos": True, "n": 2, "logprobs": True,
                                               "top_logprobs": 2}).json()
    assert [len(c["logprobs"]["content"]) for c in chat["choices"]] == [4, 4]


# ---- seeded sampling ---------------------------------------------------------------------------
def test_seeded_n_is_reproducible_and_choice_i_samples_with_seed_plus_i(live):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 11, "ignore_eos": True, "n": 3}
    a = [c["text"] for c in post(live, "/v1/completions", body).json()["choices"]]
    b = [c["text"] for c in post(live, "/v1/completions", body).json()["choices"]]
    assert a == b
    alone = [post(live, "/v1/completions", {**body, "n": 1, "seed": 11 + i}).json()["choices"][0]["text"]
             for i in range(3)]
    assert a == alone
    assert len(set(a)) > 1, "three seeds gave the same text: the choices are not independent samples"


# ---- the block map -----------------------------------------------------------------------------
def test_while_n4_runs_the_block_map_shows_the_prompt_blocks_shared_four_ways(live):
    live.wait_until(live.idle, what="an idle engine")
    start = len(live.recorder.events)
    r = post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                                       "n": 4})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    with live.recorder.lock:
        events = list(live.recorder.events)
    state = new_state()
    for e in events[:start]:
        state = reduce(state, e)
    mine = [e.req for e in events[start:] if e.type == "request" and e.source == SOURCE_HTTP]
    assert len(mine) == 4
    full = (len(PROMPT.encode()) - 1) // state.block_size  # blocks holding prompt tokens but the last: shared
    assert full >= 2
    seen = 0
    for e in events[start:]:
        state = reduce(state, e)
        if e.type != "step" or not all(len(state.tables.get(q, ())) > full for q in mine):
            continue
        prefix = state.tables[mine[0]][:full]
        assert all(state.tables[q][:full] == prefix for q in mine), "the four share the prompt's full blocks"
        assert [state.blocks.refcount[b] for b in prefix] == [4] * full
        assert len({state.tables[q][full] for q in mine}) == 4, "each writes its own copy of the last prompt block"
        assert e.kv.shared >= full
        if not seen:  # request detail marks them: block, then ▒ and the refcount
            panel = BlockTablePanel(mine[1])
            panel.state = state
            text = panel.render().plain
            assert all(f"{b:<5}▒4" in text for b in prefix), text
        seen += 1
    assert seen > 0, "no step showed all four sequences holding blocks"
    live.wait_until(live.idle, what="the pool to drain")


# ---- the prompt is computed once ---------------------------------------------------------------
def test_n64_whose_choices_all_stop_at_their_first_token_computes_the_prompt_once(live):
    """Every choice stops at its first token (a stop id): each prompt position is computed once, but the
    last, which each of the 64 computes for its own first token (into its copy of the block holding it)."""
    live.wait_until(live.idle, what="an idle engine")
    start = len(live.recorder.events)
    r = post(live, "/v1/completions", {"prompt": PROMPT * 6, "n": MAX_N, "max_tokens": 8, "temperature": 1.0,
                                       "seed": 3, "stop_token_ids": list(range(260))})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["finish_reason"] for c in body["choices"]] == ["stop"] * MAX_N
    assert body["usage"]["completion_tokens"] == MAX_N
    prompt_len = body["usage"]["prompt_tokens"]
    assert prompt_len == 6 * len(PROMPT.encode())
    live.wait_until(live.idle, what="the pool to drain")
    with live.recorder.lock:
        events = list(live.recorder.events[start:])
    mine = {e.req for e in events if e.type == "request" and e.source == SOURCE_HTTP}
    assert len(mine) == MAX_N
    counts = [0] * prompt_len
    for e in events:
        for b in e.batch if e.type == "step" else ():
            if b.req in mine:
                for pos in range(b.start, min(b.start + b.tokens, prompt_len)):
                    counts[pos] += 1
    assert counts[:-1] == [1] * (prompt_len - 1) and counts[-1] == MAX_N
    assert live.engine.block_manager.num_used == 0


# ---- aborts and failures -----------------------------------------------------------------------
def _aborts(live) -> int:
    return sum(f.reason == FINISH_ABORT for s in live.recorder.of_type("step") for f in s.finished)


def test_a_client_hanging_up_frees_all_n_sequences(live):
    live.wait_until(live.idle, what="an idle engine")
    before = _aborts(live)
    body = {"prompt": PROMPT, "max_tokens": 450, "ignore_eos": True, "n": 4, "stream": True}  # far from done
    with httpx.Client(base_url=live.base_url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # a token in, then hang up
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        httpx.post(live.base_url + "/v1/completions", json={**body, "stream": False}, timeout=0.5)
    live.wait_until(live.idle, what="all eight sequences to leave the engine")
    assert _aborts(live) - before == 8
    assert live.engine.block_manager.num_used == 0


@pytest.mark.parametrize("stream", [False, True])
def test_one_failing_sequence_fails_the_reply_and_frees_the_others(live, stream):
    live.wait_until(live.idle, what="an idle engine")
    engine = live.engine
    first = engine._next_id  # the request's sequences get first, first + 1, first + 2
    engine.runner.sampler = FaultySampler(0, {first + 1})
    body = {"prompt": PROMPT, "max_tokens": 50, "temperature": 1.0, "ignore_eos": True, "n": 3, "stream": stream}
    r = post(live, "/v1/completions", body)
    if stream:
        assert r.status_code == 200
        last = [ln for ln in r.text.splitlines() if ln.startswith("data: ")][-2:]
        assert "injected sampler fault" in last[0] and last[1] == "data: [DONE]"
    else:
        assert r.status_code == 500 and "injected sampler fault" in r.json()["error"]["message"]
    live.wait_until(live.idle, what="the other sequences to be freed")
    assert live.engine.block_manager.num_used == 0
    ended = {f.req: f.reason for s in live.recorder.of_type("step") for f in s.finished if f.req >= first}
    assert ended[first + 1] == "error" and {ended[first], ended[first + 2]} <= {FINISH_ABORT, "length"}
    ok = post(live, "/v1/completions", {**body, "stream": False, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 150


# ---- bounds, best_of, echo ---------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, -1, MAX_N + 1])
def test_n_out_of_range_is_a_400_naming_n(live, n):
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = post(live, path, {**body, "max_tokens": 1, "n": n})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert str(MAX_N) in r.json()["error"]["message"]


def test_the_largest_n_is_served(live):
    r = post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
                                       "n": MAX_N})
    assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == list(range(MAX_N))
    assert len({c["text"] for c in r.json()["choices"]}) == 1 and r.json()["usage"]["completion_tokens"] == 2 * MAX_N
    live.wait_until(live.idle, what="the pool to drain")


def test_best_of_returns_the_n_with_the_highest_cumulative_logprob(live):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    every = post(live, "/v1/completions", {**body, "n": 4, "logprobs": 0}).json()["choices"]
    ranked = sorted(every, key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    best = post(live, "/v1/completions", {**body, "n": 2, "best_of": 4}).json()
    assert [c["text"] for c in best["choices"]] == [c["text"] for c in ranked[:2]]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in best["choices"]), "logprobs were not asked for"
    assert best["usage"]["completion_tokens"] == 16, "usage counts the choices returned (vLLM's count)"


@pytest.mark.parametrize("extra", [{"best_of": 1, "n": 2}, {"best_of": 3, "n": 2, "stream": True},
                                   {"best_of": MAX_N + 1}, {"best_of": "2"}])
def test_bad_best_of_is_a_400_naming_it(live, extra):
    r = post(live, "/v1/completions", {"prompt": "x", "max_tokens": 1, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text


def test_chat_echo_starts_the_content_with_the_assistants_last_message(live, client):
    messages = [{"role": "user", "content": "Say more."}, {"role": "assistant", "content": "Well,"}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2,
            "continue_final_message": True, "add_generation_prompt": False}
    plain = post(live, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    echoed = post(live, "/v1/chat/completions", {**body, "echo": True}).json()
    assert [c["message"]["content"] for c in echoed["choices"]] == ["Well," + plain] * 2
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, n=2, stream=True, max_tokens=6,
                                                 temperature=0, extra_body={**{k: body[k] for k in (
                                                     "ignore_eos", "continue_final_message",
                                                     "add_generation_prompt")}, "echo": True}))
    assert streamed_choices(chunks)[0] == {0: "Well," + plain, 1: "Well," + plain}
    user_last = post(live, "/v1/chat/completions", {"messages": messages[:1], "max_tokens": 3, "temperature": 0,
                                                    "echo": True}).json()
    assert not user_last["choices"][0]["message"]["content"].startswith("Say more."), "only the assistant's echoes"
    bad = post(live, "/v1/chat/completions", {**body, "echo": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "echo"
    refused = post(live, "/v1/completions", {"prompt": "x", "max_tokens": 1, "echo": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"
