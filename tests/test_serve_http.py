"""The OpenAI HTTP API against the official client: completions, chat, streaming, stop, abort, bad requests."""

from __future__ import annotations

import asyncio
import json
import socket
from collections import Counter

import httpx
import openai
import pytest

from kvscope.engine import LLMEngine, SamplingParams
from kvscope.engine.config import EngineConfig
from kvscope.engine.detokenizer import detokenize
from kvscope.protocol.events import FINISH_ABORT, SOURCE_HTTP
from tests._serve import serving

CONFIG = dict(num_blocks=256, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=512,
              dtype="float32")  # token-exact against the engine's own greedy run: bf16 packing could tie-break


@pytest.fixture(scope="module")
def live():
    with serving(EngineConfig(**CONFIG)) as live:
        yield live


@pytest.fixture
def client(live):
    with openai.OpenAI(base_url=live.base_url + "/v1", api_key="none", max_retries=0, timeout=30) as c:
        yield c


def _greedy_text(prompt, n: int) -> str:
    """What the engine itself generates (greedy, ignoring EOS), without HTTP."""
    engine = LLMEngine(EngineConfig(**CONFIG))
    engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    while engine.has_unfinished():
        done = engine.step()
    return detokenize(engine.tokenizer, done[0].output_token_ids)  # complete characters only


def test_completion_plain_and_streaming_match_the_engine(live, client):
    want = _greedy_text("The scheduler", 12)
    plain = client.completions.create(model="tiny", prompt="The scheduler", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert plain.object == "text_completion" and plain.model == "tiny"
    assert plain.choices[0].text == want and plain.choices[0].finish_reason == "length"
    assert plain.usage.prompt_tokens == len("The scheduler".encode()) and plain.usage.completion_tokens == 12
    chunks = list(client.completions.create(model="tiny", prompt="The scheduler", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_prompt_as_token_ids(live, client):
    ids = [72, 101, 108, 108, 111]
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == _greedy_text(ids, 6)
    assert out.usage.prompt_tokens == 5


def test_chat_plain_and_streaming(live, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt = "system: be brief\nuser: hi\nassistant: "  # the documented join (the tiny tokenizer has no template)
    want = _greedy_text(prompt, 8)
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert plain.object == "chat.completion"
    assert plain.choices[0].message.role == "assistant" and plain.choices[0].message.content == want
    assert plain.usage.prompt_tokens == len(prompt.encode())
    stream = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want
    assert stream[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in stream)  # no include_usage: no usage chunk


def test_stop_string_cuts_the_text_and_ends_the_request(live, client):
    full = _greedy_text("stop here", 24)
    # an ASCII character: the text before it decodes the same however the bytes are split
    at = next(i for i, ch in enumerate(full) if i >= 3 and ch.isascii() and ch.isprintable())
    stop = full[at]
    out = client.completions.create(model="tiny", prompt="stop here", max_tokens=24, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].text == full[: full.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 24
    live.wait_until(live.idle, what="the stopped request to leave the engine")
    finish = [f for s in live.recorder.of_type("step") for f in s.finished][-1]
    assert finish.reason == "stop" and finish.output_len == out.usage.completion_tokens


def test_seeded_sampling_is_reproducible(live, client):
    kw = dict(model="tiny", prompt="dice", max_tokens=10, temperature=1.0, top_p=0.9, seed=7,
              extra_body={"ignore_eos": True, "top_k": 50})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_http_requests_are_engine_requests_marked_http(live, client):
    before = len(live.recorder.of_type("request"))
    client.completions.create(model="tiny", prompt="mark", max_tokens=2, extra_body={"priority": 3})
    new = live.recorder.of_type("request")[before:]
    assert len(new) == 1 and new[0].source == SOURCE_HTTP and new[0].priority == -3  # vLLM: lower is first


def test_models_and_health(live):
    models = httpx.get(live.base_url + "/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    assert httpx.get(live.base_url + "/health").status_code == 200
    with openai.OpenAI(base_url=live.base_url + "/v1", api_key="none", max_retries=0) as client:
        assert [m.id for m in client.models.list()] == ["tiny"]
        assert client.models.retrieve("tiny").id == "tiny"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("gpt-4")


def _generation_tokens(live) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(live.base_url + "/metrics").text
    for fam in text_string_to_metric_families(text):
        if fam.name == "vllm:generation_tokens":
            return sum(s.value for s in fam.samples if s.name == "vllm:generation_tokens_total")
    raise AssertionError("vllm:generation_tokens_total missing")


def test_64_concurrent_streams_count_exactly_the_tokens_clients_received(live):
    live.wait_until(live.idle, what="an idle engine")
    before = _generation_tokens(live)

    async def one(client, i):
        stream = await client.completions.create(model="tiny", prompt=f"stream {i}", max_tokens=5 + i % 7,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def main():
        async with openai.AsyncOpenAI(base_url=live.base_url + "/v1", api_key="none", max_retries=0,
                                      timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    received = asyncio.run(main())
    assert received == [5 + i % 7 for i in range(64)]
    live.wait_until(live.idle, what="an idle engine")
    assert _generation_tokens(live) - before == sum(received)


def test_clients_hanging_up_leave_nothing_running(live):
    live.wait_until(live.idle, what="an idle engine")
    aborts_before = sum(f.reason == FINISH_ABORT for s in live.recorder.of_type("step") for f in s.finished)
    body = {"model": "tiny", "prompt": "long one", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=live.base_url, timeout=30) as http:
        for i in range(6):
            with http.stream("POST", "/v1/completions", json={**body, "prompt": f"long {i}"}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                got = [next(lines) for _ in range(3)]  # a few tokens in, then hang up
                assert got[0].startswith("data: ")
    # a non-streaming client that hangs up once its request is decoding, long before the reply could end
    plain = json.dumps({**body, "prompt": "long 6", "stream": False,
                        "max_tokens": CONFIG["max_model_len"] - 16}).encode()
    host, port = live.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(plain), plain))
        live.wait_until(lambda: _tokens_of(live, max_tokens=json.loads(plain)["max_tokens"]) >= 2,
                        what="the request to decode")
    live.wait_until(live.idle, what="the aborted requests to leave the engine")
    finished = [f for s in live.recorder.of_type("step") for f in s.finished]
    aborts = sum(f.reason == FINISH_ABORT for f in finished)
    assert aborts - aborts_before == 7
    assert live.engine.block_manager.num_used == 0


def _tokens_of(live, max_tokens: int) -> int:
    """Tokens sampled so far for the request that asked for max_tokens (0 before it is seen)."""
    ids = {r.req for r in live.recorder.of_type("request") if r.max_tokens == max_tokens}
    return sum(req in ids for s in live.recorder.of_type("step") for req in s.sampled)


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"prompt": 5}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny"}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": "5"}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "x", "temperature": "hot"}).encode(), 400, "temperature"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "x", "n": 0}).encode(), 400, "n"),
    (json.dumps({"model": "tiny", "prompt": "x", "n": 65}).encode(), 400, "n"),
    (json.dumps({"model": "tiny", "prompt": "x", "stream": "yes"}).encode(), 400, "stream"),
    (json.dumps({"model": "tiny", "prompt": "x", "logprobs": 21}).encode(), 400, "logprobs"),
    (json.dumps({"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}}).encode(), 400,
     "stream_options"),
    (json.dumps({"model": "tiny", "prompt": "x", "guided_choice": ["a", "b"]}).encode(), 400, "guided_choice"),
    (json.dumps({"model": "tiny", "prompt": "x", "min_tokens": 20, "max_tokens": 5}).encode(), 400, "min_tokens"),
    (json.dumps({"model": "tiny", "prompt": ["a", "b"]}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny", "prompt": [1, 2, 99999]}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny", "prompt": [1, -1]}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny", "prompt": "x" * 600}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny", "prompt": "x" * 100, "max_tokens": 500}).encode(), 400, "prompt"),
    (json.dumps({"model": "other", "prompt": "x"}).encode(), 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_completion_requests_get_openai_errors(live, body, status, param):
    r = httpx.post(live.base_url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_bad_chat_requests_and_the_client_errors(live, client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 600}])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=65)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"
    too_long = "x" * 600
    tokens = [t for t in range(3)]
    assert client.completions.create(model="tiny", prompt=tokens, max_tokens=2).usage.completion_tokens >= 1
    assert too_long  # the engine kept serving after all of the above


@pytest.mark.parametrize("body,param", [
    ({"max_completion_tokens": 0}, "max_completion_tokens"), ({"max_completion_tokens": -5, "max_tokens": 3},
                                                               "max_completion_tokens"),
    ({"max_tokens": 0}, "max_tokens")])
def test_a_bad_chat_token_cap_is_named_as_the_client_sent_it(live, body, param):
    r = httpx.post(live.base_url + "/v1/chat/completions",
                   json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


@pytest.mark.parametrize("priority", ["-9223372036854775808", "-9223372036854775809", "18446744073709551615",
                                      "9223372036854775808", "1e400", "1.5", "true"])
def test_a_priority_past_int64_is_a_400(live, priority):
    """The engine's priority is the negation of vLLM's: -2^63 would overflow the int64 of every event."""
    body = ('{"model": "tiny", "prompt": "x", "max_tokens": 1, "priority": %s}' % priority).encode()
    r = httpx.post(live.base_url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "priority" and r.json()["error"]["type"] == "invalid_request_error"


def test_a_trace_recorded_with_extreme_accepted_values_reads_back_whole(tmp_path):
    from kvscope.traces.info import trace_info
    from kvscope.traces.reader import TraceReader
    from kvscope.traces.writer import TraceWriter

    path = tmp_path / "extreme.kvtrace"
    writers = []

    def recording(engine):
        writers.append(TraceWriter(path, engine.hello(), snapshot_provider=engine.snapshot))
        return writers

    with serving(EngineConfig(**CONFIG), sinks=recording) as live:
        for priority in (2**63 - 1, -(2**63 - 1), 0):
            r = httpx.post(live.base_url + "/v1/completions", timeout=30,
                           json={"model": "tiny", "prompt": "x", "max_tokens": 3, "priority": priority,
                                 "seed": 2**63 - 1, "temperature": 0.5, "ignore_eos": True})
            assert r.status_code == 200, r.text
        live.wait_until(live.idle, what="the engine to drain")
    writers[0].close()
    assert writers[0].lost == 0
    reader = TraceReader(path)
    reqs = [e for e in reader.events() if e.type == "request"]
    assert sorted(e.priority for e in reqs) == [-(2**63 - 1), 0, 2**63 - 1]
    text = trace_info(path)
    assert "requests:" in text and "warnings:   none" in text, text
    assert reader.summary().steps > 0


@pytest.mark.parametrize("body", [b'{"model": "tiny", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
                                  b"[" * 50_000, b'{"model": "tiny", "prompt": "x", "tools": ' + b"[" * 50_000])
def test_deeply_nested_json_is_a_400_not_a_recursion_error(live, body):
    r = httpx.post(live.base_url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    ok = httpx.post(live.base_url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
    assert ok.status_code == 200  # and the server goes on


def _raw_http(live, request: bytes) -> tuple[str, dict, bytes]:
    """Send bytes as they are (no client would send these) and read the answer until the server closes."""
    import socket

    host, port = live.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return lines[0], headers, body


@pytest.mark.parametrize("length", [b"abc", b"-1", b"1e3", b"5, 6", b"\xd9\xa3"])
def test_a_bad_content_length_gets_openai_error_json(live, length):
    status, headers, body = _raw_http(live, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + length +
                                      b"\r\nContent-Type: application/json\r\n\r\n{}")
    assert status.startswith("HTTP/1.1 400"), status
    assert headers["content-type"] == "application/json"
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["code"] == "malformed_http_request"


def test_oversize_body_and_unknown_route(live):
    r = httpx.post(live.base_url + "/v1/completions", content=b"x" * (5 << 20))
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(live.base_url + "/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_waiting_cap_answers_429_and_serving_goes_on():
    with serving(EngineConfig(**CONFIG), max_waiting=2) as live:
        live.driver.paused = True  # requests queue up and wait
        body = {"model": "tiny", "prompt": "q", "max_tokens": 2, "stream": True}
        with httpx.Client(base_url=live.base_url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as a, \
                    http.stream("POST", "/v1/completions", json=body) as b:
                assert a.status_code == 200 and b.status_code == 200
                live.wait_until(lambda: len(live.engine.scheduler.waiting) == 2, what="two waiting requests")
                r = http.post("/v1/completions", json={**body, "stream": False})
                assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
                live.driver.paused = False
                assert "[DONE]" in a.read().decode() and "[DONE]" in b.read().decode()
            ok = http.post("/v1/completions", json={**body, "stream": False})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_synthetic_traffic_runs_beside_http_with_forever():
    with serving(EngineConfig(**CONFIG), forever_workload="chat") as live:
        live.wait_until(lambda: len(live.recorder.of_type("request")) >= 3, what="synthetic arrivals")
        with openai.OpenAI(base_url=live.base_url + "/v1", api_key="none", max_retries=0, timeout=60) as client:
            out = client.completions.create(model="tiny", prompt="beside", max_tokens=4,
                                            extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4
        sources = Counter(r.source for r in live.recorder.of_type("request"))
        assert sources[SOURCE_HTTP] == 1 and sources[""] >= 3


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"model": "tiny", "prompt": "SLOW-TEXT and more", "max_tokens": 3}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "SLOW-TEXT"}],
                              "max_tokens": 3}),
    ("/tokenize", {"model": "tiny", "prompt": "SLOW-TEXT"}),
])
def test_a_prompt_that_takes_long_to_tokenize_stalls_no_other_request(live, monkeypatch, route, body):
    """Tokenizing (and templating) a request's text takes as long as the text: up to a 4 MiB body. It runs on
    the HTTP front end's own worker thread, so while one prompt is being tokenized the engine keeps stepping
    and the event loop keeps answering. Here the tokenizer blocks on that prompt until the test lets it go;
    a request given as token ids and /health must be answered meanwhile (when tokenizing ran in the engine
    loop, the engine stood still until then)."""
    import threading

    from _helpers import DEADLINE_S

    tok = live.engine.tokenizer
    entered, release = threading.Event(), threading.Event()
    real_encode = tok.encode

    def encode(text, *args, **kwargs):
        if "SLOW-TEXT" in text:
            entered.set()
            release.wait(DEADLINE_S)
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", encode)
    slow: dict = {}
    thread = threading.Thread(target=lambda: slow.update(r=httpx.post(live.base_url + route, json=body,
                                                                      timeout=DEADLINE_S)))
    thread.start()
    try:
        assert entered.wait(DEADLINE_S), "the slow prompt reached the tokenizer"
        with httpx.Client(base_url=live.base_url, timeout=DEADLINE_S) as c:
            assert c.get("/health").status_code == 200
            other = c.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4,
                                                    "ignore_eos": True})
            assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] == 4
            assert not slow, "the slow request is still being tokenized"
    finally:
        release.set()
        thread.join(DEADLINE_S)
    assert slow["r"].status_code == 200, slow["r"].text
