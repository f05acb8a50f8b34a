"""Hostile input: request chat templates, a flag that imported code, GGUF headers,
`kvscope report` inputs and labels, `n` recomputing the prompt, chat's default max_tokens.

Each case expects a correct result or one clear line (OpenAI's error JSON over HTTP): no traceback,
no hang, bounded memory, and the server still serving. The HTTP cases run a real `kvscope serve
--http` (in process, or as a subprocess where a signal is the point) and talk to it with httpx
and the official openai client.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from _helpers import DEADLINE_S

from kvscope.cli import main
from kvscope.engine import LLM, SamplingParams
from kvscope.engine.config import EngineConfig
from kvscope.errors import KvscopeError
from tests._serve import serving

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER = [{"role": "user", "content": "hi"}]
UNTRUSTED = "--trust-request-chat-template is not set"
SLOW = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ bos_token }}")


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvscope"), err
    assert "Traceback" not in err[0]
    return err[0]


def _tiny_config(**kw) -> EngineConfig:
    return EngineConfig(**{"num_blocks": 256, "max_num_seqs": 64, "max_num_batched_tokens": 512, "dtype": "float32",
                           **kw})


def _chat(live, body: dict, path: str = "/v1/chat/completions", timeout: float = DEADLINE_S) -> httpx.Response:
    return httpx.post(live.base_url + path, json=body, timeout=timeout)


# ---- 1. request chat templates: refused unless trusted --------------------------------------------
@pytest.fixture(scope="module")
def untrusted():
    with serving(_tiny_config()) as live:
        yield live


@pytest.fixture(scope="module")
def trusted():
    with serving(_tiny_config(), trust_request_chat_template=True) as live:
        live.front._render_pool.timeout_s = 3.0  # a slow render is cut sooner than the default 5 s
        yield live


REQUEST_TEMPLATES = [  # (path, body beyond messages, the field the 400 names)
    ("/v1/chat/completions", {"chat_template": "{{ 'Z' * 3 }}"}, "chat_template"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"chat_template": "{{ 'Z' * 3 }}"}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"chat_template": ""}, "chat_template"),  # given, even empty
    ("/v1/chat/completions", {"chat_template_kwargs": {"chat_template": 7}}, "chat_template_kwargs"),
    ("/tokenize", {"chat_template_kwargs": {"chat_template": "{{ 'Z' * 3 }}"}}, "chat_template_kwargs"),
    ("/tokenize", {"chat_template": "{{ 'Z' * 3 }}"}, "chat_template"),
]


@pytest.mark.parametrize("path, extra, param", REQUEST_TEMPLATES)
def test_a_request_template_is_refused_wherever_it_hides(untrusted, path, extra, param):
    r = _chat(untrusted, {"messages": USER, "max_tokens": 1, **extra}, path)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and UNTRUSTED in err["message"] and err["type"] == "invalid_request_error"


def test_the_openai_client_gets_the_refusal(untrusted):
    client = openai.OpenAI(base_url=untrusted.base_url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"chat_template": "{{ 'Z' * 3 }}"}})
    assert e.value.status_code == 400 and UNTRUSTED in str(e.value)


@pytest.mark.parametrize("key", ["tokenize", "conversations", "add_generation_prompt", "return_assistant_tokens_mask",
                                 "tokenizer_kwargs"])
def test_the_renderers_own_parameters_cannot_be_smuggled_in_kwargs(untrusted, key):
    r = _chat(untrusted, {"messages": USER, "max_tokens": 1, "chat_template_kwargs": {key: True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs" and key in r.text


def test_a_trusted_request_template_renders(trusted):
    r = _chat(trusted, {"messages": USER, "max_tokens": 1, "chat_template_kwargs": {"chat_template": "{{ 'Z' * 3 }}"}})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3  # "ZZZ", byte tokens
    r = _chat(trusted, {"messages": USER, "chat_template": "{{ messages[0]['content'] }}!"}, "/tokenize")
    assert r.status_code == 200 and r.json()["tokens"] == list(b"hi!")


HOSTILE_TEMPLATES = [  # (template, a word the one-line 400 carries)
    (SLOW, "took over"),
    ("{{ 'Z' * 2000000000 }}", "MiB"),  # memory: the worker's cap, not the server's
    ("{% for i in range(9) %}{{ '%09999999d' % 1 }}{% endfor %}", "characters"),  # output size
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed"),
    ("{{ cycler.__init__.__globals__ }}", "SecurityError"),  # the sandbox
    ("{{ raise_exception('no') }}", "no"),
    ("{% for %}", "TemplateSyntaxError"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "chat template"),
]


@pytest.mark.parametrize("template, word", HOSTILE_TEMPLATES)
def test_a_hostile_trusted_template_is_a_bounded_400(trusted, template, word):
    r = _chat(trusted, {"messages": USER, "max_tokens": 1, "chat_template": template})
    if template.startswith("{{ ''.__class__"):  # the sandbox hides the attribute: an empty prompt, refused
        assert r.status_code == 400, r.text
        return
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "chat_template" and word in err["message"] and "\n" not in err["message"]
    ok = _chat(trusted, {"messages": USER, "max_tokens": 1})  # and the server goes on serving
    assert ok.status_code == 200


def test_one_slow_render_holds_no_other_request(trusted, monkeypatch):
    # the slow render holds its worker for 20 s; the others need only a warm spare (or one started meanwhile)
    monkeypatch.setattr(trusted.front._render_pool, "timeout_s", 20.0)
    assert _chat(trusted, {"messages": USER, "max_tokens": 1, "chat_template": "{{ 'warm' }}"}).status_code == 200
    done: list[str] = []

    def slow():
        _chat(trusted, {"messages": USER, "max_tokens": 1, "chat_template": SLOW})
        done.append("slow")

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.3)  # the slow render has its worker (or is starting one)
    fast = _chat(trusted, {"messages": USER, "max_tokens": 1, "chat_template": "{{ 'ok' }}"})
    plain = _chat(trusted, {"prompt": "x", "max_tokens": 1}, "/v1/completions")
    done.append("others")
    t.join(DEADLINE_S)
    assert fast.status_code == 200 and plain.status_code == 200
    assert done == ["others", "slow"]  # both answered while the slow render was still running


def test_the_pool_renders_as_transformers_does():
    from transformers.utils.chat_template_utils import render_jinja_template

    from kvscope.serve.chat_templates import RenderPool

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo {{ x }}"}]
    pool = RenderPool(size=1)
    try:
        for gen, cont in ((True, False), (False, False)):
            got = pool.render(CHATML, msgs, gen, cont, {"bos_token": "<s>"})
            want = render_jinja_template([msgs], chat_template=CHATML, add_generation_prompt=gen,
                                         continue_final_message=cont, bos_token="<s>")[0][0]
            assert got == want
    finally:
        pool.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def test_sigterm_during_a_slow_render_stops_cleanly():
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-m", "kvscope", "serve", "--model", "tiny", "--http", f"127.0.0.1:{port}",
                             "--trust-request-chat-template", "--no-progress"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not come up"
            time.sleep(0.2)
        answers: list[int] = []
        t = threading.Thread(target=lambda: answers.append(httpx.post(
            base + "/v1/chat/completions", json={"messages": USER, "chat_template": SLOW}, timeout=DEADLINE_S
        ).status_code))
        t.start()
        time.sleep(1.5)
        workers = _children(proc.pid)
        assert workers, "a render worker runs"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        t.join(DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "CancelledError" not in err, err
    assert answers and answers[0] in (503, 400)  # told the server is stopping (or the render ran out of time)
    time.sleep(1.0)
    for w in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(w, 0)


# ---- 6. chat's default max_tokens is the rest of the context -------------------------------------
def test_chat_min_tokens_without_max_tokens(untrusted):
    r = _chat(untrusted, {"messages": USER, "min_tokens": 5, "stop_token_ids": [], "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 5


def test_chat_min_tokens_past_the_context_is_a_400_naming_it(untrusted):
    r = _chat(untrusted, {"messages": USER, "min_tokens": untrusted.engine.max_model_len})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


# ---- 5. n shares the computed prompt however soon the first sample ends ----------------------------
class _Steps:
    def __init__(self):
        self.events = []

    def publish(self, ev):
        if ev.type == "step":
            self.events.append(ev)

    def close(self):
        pass


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("max_tokens", [1, 2])
def test_n_samples_compute_the_prompt_once(prefix_caching, max_tokens):
    llm = LLM(model="tiny", device="cpu", dtype="float32", mode="chunked", num_blocks=512, max_num_seqs=64,
              max_num_batched_tokens=256, prefix_caching=prefix_caching, max_model_len=2048)
    steps = _Steps()
    llm.engine.attach(steps)
    prompt = [(i * 7) % 250 for i in range(1000)]
    outs = llm.generate([prompt], SamplingParams(n=16, max_tokens=max_tokens, temperature=1.0, seed=3,
                                                 ignore_eos=True))
    assert len(outs[0].outputs if hasattr(outs[0], "outputs") else outs) >= 1
    prefill = sum(b.tokens for ev in steps.events for b in ev.batch if b.kind == "prefill")
    assert prefill == len(prompt) + 15, prefill  # the prompt once, then each other sample's last prompt token
    sched = llm.engine.scheduler
    assert not sched._lingering and not sched._unforked
    sched.bm.check_invariants()
    assert sched.bm.num_used == 0


def test_prompt_tokens_metrics_count_as_vllm_does():
    """vllm:prompt_tokens counts every sample's prompt (vLLM's n child requests each count theirs); what was
    computed is counted once under vllm:prompt_tokens_by_source{source="local_compute"}."""
    with serving(_tiny_config(num_blocks=512, max_model_len=2048)) as live:
        prompt = [(i * 7) % 250 for i in range(600)]
        r = _chat(live, {"prompt": prompt, "n": 8, "max_tokens": 1}, "/v1/completions")
        assert r.status_code == 200, r.text
        text = httpx.get(live.base_url + "/metrics", timeout=DEADLINE_S).text

    def value(line_start: str) -> float:
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(line_start))

    assert value("vllm:prompt_tokens_total{") == 8 * 600
    computed = value('vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"}')
    assert computed == 600 + 7, text  # the prompt once, and each other sample's last prompt token
    assert value("vllm:prompt_tokens_cached_total{") == 8 * 600 - computed


# ---- 2. a flag in vLLM's vocabulary never names code ---------------------------------------------
VLLM_TRACE = os.path.join(ROOT, "traces", "vllm", "kvscope-as-vllm.kvtrace")


@pytest.mark.parametrize("value", ["this:Zen", "os:getcwd", "kvscope.engine.sched.policies:SJF", "sjf", "FCFS", ""])
def test_vllm_scheduling_policy_takes_vllms_names_only(value, capsys):
    assert main(["diagnose", VLLM_TRACE, "--gpu", "h100-sxm5", "--no-what-if",
                 "--vllm-scheduling-policy", value]) == 2
    line = _one_line_error(capsys)
    assert "fcfs, priority" in line
    assert "this" not in sys.modules or value != "this:Zen"


def test_a_recorded_policy_never_reaches_the_importer():
    from kvscope.vllm.diagnose.run import _sim_policy

    assert [_sim_policy(p) for p in ("fcfs", "priority", "this:Zen", None, 5)] == ["fcfs", "priority", "fcfs",
                                                                                   "fcfs", "fcfs"]


def test_vllm_flags_check_their_policy_without_the_cli():
    from kvscope.vllm.diagnose.signals import vllm_scheduling_policy

    with pytest.raises(KvscopeError, match="fcfs, priority"):
        vllm_scheduling_policy("this:Zen")


# ---- 3. GGUF headers bounded -----------------------------------------------------------------------
def _s(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def _nested_gguf(path, depth: int) -> str:
    kv = _s("general.architecture") + struct.pack("<I", 8) + _s("llama") + _s("x.deep") + struct.pack("<I", 9)
    kv += struct.pack("<IQ", 9, 1) * (depth - 1) + struct.pack("<IQ", 4, 0)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + kv)
    return str(path)


def _llama_gguf(path, declared: int, held: int, *, drop: str | None = None, **shape) -> str:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(shape.get("block_count", declared))
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(shape.get("head_count", 2))
    w.add_head_count_kv(1)
    w.add_context_length(shape.get("context_length", 64))
    w.add_vocab_size(16)
    w.add_layer_norm_rms_eps(1e-5)
    z = lambda *s: np.zeros(s, dtype=np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", z(16, 8))
    w.add_tensor("output_norm.weight", z(8))
    for i in range(held):
        for n, sh in [("attn_norm", (8,)), ("attn_q", (8, 8)), ("attn_k", (4, 8)), ("attn_v", (4, 8)),
                      ("attn_output", (8, 8)), ("ffn_norm", (8,)), ("ffn_gate", (16, 8)), ("ffn_up", (16, 8)),
                      ("ffn_down", (8, 16))]:
            if f"blk.{i}.{n}" != drop:
                w.add_tensor(f"blk.{i}.{n}.weight", z(*sh))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _serve_args(path: str) -> list[str]:
    return ["serve", "--model", path, "--num-requests", "1", "--no-progress"]


def _sim_args(path: str) -> list[str]:
    return ["serve", "--backend", "sim", "--gpu", "h100-sxm5", "--model", path, "--num-requests", "1", "--no-progress"]


@pytest.mark.parametrize("args", [_serve_args, _sim_args], ids=["serve", "sim"])
def test_arrays_nested_100k_deep_are_one_line(tmp_path, capsys, args):
    path = _nested_gguf(tmp_path / "deep.gguf", 100_000)
    assert main(args(path)) == 2
    assert "nested" in _one_line_error(capsys)


@pytest.mark.parametrize("field, value", [("block_count", 2**31), ("head_count", 0), ("context_length", 2**32 - 1)])
@pytest.mark.parametrize("args", [_serve_args, _sim_args], ids=["serve", "sim"])
def test_absurd_shape_fields_are_refused_at_once(tmp_path, capsys, args, field, value):
    path = _llama_gguf(tmp_path / "huge.gguf", 1, 1, **{field: value})
    started = time.monotonic()
    assert main(args(path)) == 2
    assert field in _one_line_error(capsys)
    assert time.monotonic() - started < DEADLINE_S


def test_a_header_declaring_more_layers_than_its_tensors_is_refused(tmp_path, capsys):
    path = _llama_gguf(tmp_path / "4over1.gguf", 4, 1)
    assert main(_serve_args(path)) == 2
    line = _one_line_error(capsys)
    assert "declares 4 layers" in line and "1 of them" in line and "random" in line


def test_a_layer_missing_one_tensor_is_refused(tmp_path):
    from kvscope.engine.loader.models import load_model

    with pytest.raises(KvscopeError, match="blk.1.ffn_up.weight"):
        load_model(_llama_gguf(tmp_path / "hole.gguf", 2, 2, drop="blk.1.ffn_up"), None, "cpu")


def test_a_whole_small_gguf_still_loads(tmp_path):
    from kvscope.engine.loader.models import load_model

    loaded = load_model(_llama_gguf(tmp_path / "ok.gguf", 2, 2), "float32", "cpu")
    assert loaded.num_layers == 2


def test_a_header_array_budget_bounds_nested_arrays(tmp_path, monkeypatch):
    from kvscope.engine.loader import gguf as kv_gguf

    # arrays of empty arrays of strings: each array fits MAX_ARRAY, the entries visited together do not
    # (the budget made small here, so the file is too; the real one is 2^24)
    monkeypatch.setattr(kv_gguf, "MAX_ITEMS", 1 << 12)
    arr = struct.pack("<IQ", 9, 1 << 10) + struct.pack("<IQ", 8, 0) * (1 << 10)
    kv = _s("general.architecture") + struct.pack("<I", 8) + _s("llama")
    kv += (_s("x.a") + struct.pack("<I", 9) + arr) * 17
    path = tmp_path / "wide.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 18) + kv)
    with pytest.raises(KvscopeError, match="entries in all"):
        kv_gguf.read_header(str(path))


# ---- 4. kvscope report: labels, strings, odd files -------------------------------------------------
MATHTEXT = ["$\\foo$", "a $ b", "\\frac{", "$x^{$", "50$ & \\sqrt{"]


def _report(tmp_path, capsys, *inputs) -> tuple[int, str]:
    out = tmp_path / "out.html"
    rc = main(["report", *map(str, inputs), "--html", str(out)])
    return rc, capsys.readouterr().err


def test_mathtext_in_names_is_drawn_as_plain_text(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"workload": "$\\foo$", "rows": [{"name": n, "output_tok_per_s": i + 1.0,
                                                                   "ttft_p99_s": 0.5} for i, n in enumerate(MATHTEXT)]}))
    diag = tmp_path / "diag.json"
    diag.write_text(json.dumps({"bottleneck": "$kv$", "knobs": [{"flag": f"--{n}", "from": n, "to": "\\frac{",
                                                                 "predicted": {"output_tok_per_s": 2.0}}
                                                                for n in MATHTEXT],
                                "what_if": {"baseline": {"output_tok_per_s": 1.0}}}))
    rc, err = _report(tmp_path, capsys, bench, diag)
    assert rc == 0, err
    page = (tmp_path / "out.html").read_text()
    assert "\\frac{" in page and "50$ &amp; \\sqrt{" in page


def test_lone_surrogates_are_written_safely_and_no_temporary_is_left(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text('{"workload": "w\\ud800", "rows": [{"name": "a\\udfff\\ud800b", "output_tok_per_s": 1}]}')
    rc, err = _report(tmp_path, capsys, bench)
    assert rc == 0, err
    assert "a\ufffd\ufffdb" in (tmp_path / "out.html").read_text(encoding="utf-8")
    assert sorted(os.listdir(tmp_path)) == ["bench.json", "out.html"]


def test_a_failed_write_leaves_no_temporary(tmp_path, capsys, monkeypatch):
    bench = tmp_path / "bench.json"
    bench.write_text('{"rows": [{"name": "a", "output_tok_per_s": 1}]}')

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    rc, err = _report(tmp_path, capsys, bench)
    assert rc == 2 and "No space left" in err and len(err.strip().splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == ["bench.json"]


@pytest.mark.parametrize("body, word", [
    ({"rows": [], "traces": 7}, "traces"),
    ({"rows": [], "traces": "a.kvtrace"}, "traces"),
    ({"bottleneck": "kv", "evidence": 5}, "evidence"),
    ({"bottleneck": "kv", "secondary": 5}, "secondary"),
    ({"bottleneck": "kv", "secondary": {"a": 1}}, "secondary"),
    ({"bottleneck": "kv", "evidence": "text"}, "evidence"),
])
def test_wrong_types_in_race_or_diagnose_json_are_one_line(tmp_path, capsys, body, word):
    f = tmp_path / "in.json"
    f.write_text(json.dumps(body))
    rc, err = _report(tmp_path, capsys, f)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and word in lines[0] and "Traceback" not in err


def _report_subprocess(tmp_path, target: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvscope", "report", target, "--html", str(tmp_path / "o.html")],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                          timeout=DEADLINE_S)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "link-to-dev-zero", "directory"])
def test_inputs_must_be_regular_files(tmp_path, kind):
    target = tmp_path / "in.json"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "dev-zero":
        target = "/dev/zero"
    elif kind == "link-to-dev-zero":
        os.symlink("/dev/zero", target)
    else:
        target.mkdir()
    r = _report_subprocess(tmp_path, str(target))  # a hang would be the timeout; growing memory, a MemoryError
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "o.html").exists()


# ---- the same surfaces, attacked again ------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [
    {"x": json.loads("[" * 200 + "]" * 200)},  # deep, but within what JSON decoding allows
    {"a-b": 1, "": 2, "bos_token": "{{ 7 * 7 }}"},  # odd keys; a value is data, never a template
    "lone surrogate",  # JSON's "\ud800" through msgpack to the worker
])
def test_odd_template_kwargs_render_or_are_one_line(trusted, kwargs):
    body = {"messages": USER, "max_tokens": 1, "chat_template": "{{ bos_token }}|{{ messages[0]['content'] }}"}
    if kwargs == "lone surrogate":
        raw = json.dumps({**body, "chat_template_kwargs": {"enable_thinking": "SURR"}}).replace("SURR", "\\ud800")
        r = httpx.post(trusted.base_url + "/v1/chat/completions", content=raw.encode(),
                       headers={"content-type": "application/json"}, timeout=DEADLINE_S)
        assert r.status_code in (200, 400) and "Traceback" not in r.text, r.text
        return
    r = _chat(trusted, {**body, "chat_template_kwargs": kwargs})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 200 and "bos_token" in kwargs:
        assert r.json()["usage"]["prompt_tokens"] == len("{{ 7 * 7 }}|hi")  # not rendered a second time


def test_a_large_message_through_a_trusted_template(trusted):
    big = "x" * (3 << 20)
    r = _chat(trusted, {"messages": [{"role": "user", "content": big}], "chat_template": "{{ messages[0]['content'] }}"},
              "/tokenize")
    assert r.status_code == 200 and r.json()["count"] == len(big)


def test_concurrent_hostile_renders_leave_the_server_serving(trusted):
    bodies = [{"messages": USER, "max_tokens": 1, "chat_template": t} for t, _ in HOSTILE_TEMPLATES[1:6]] * 2
    out: list[int] = []
    threads = [threading.Thread(target=lambda b=b: out.append(_chat(trusted, b).status_code)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert out == [400] * len(bodies)
    assert _chat(trusted, {"messages": USER, "max_tokens": 1}).status_code == 200
    pool = trusted.front._render_pool
    assert len(pool._live) <= pool.size


@pytest.mark.parametrize("tail", [
    struct.pack("<Q", 2000) + b"n" * 2000,  # a tensor name over 1 KiB
    _s("t") + struct.pack("<I", 4) + struct.pack("<QQQQ", 1 << 20, 1 << 20, 1 << 20, 1),  # 2^60 elements
    _s("t") + struct.pack("<I", 9),  # nine dimensions
    b"",  # the tensors it claims are not there
])
def test_hostile_tensor_infos_are_one_line(tmp_path, tail):
    from kvscope.engine.loader import gguf as kv_gguf

    kv = _s("general.architecture") + struct.pack("<I", 8) + _s("llama")
    path = tmp_path / "t.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + kv + tail)
    with pytest.raises(KvscopeError) as e:
        kv_gguf.read_header(str(path))
    assert "\n" not in str(e.value)


def test_a_json_over_the_bound_is_one_line(tmp_path, capsys):
    from kvscope.report.inputs import MAX_JSON_BYTES

    f = tmp_path / "big.json"
    with open(f, "wb") as out:
        out.write(b'{"rows": [' + b" " * (MAX_JSON_BYTES + 10) + b"]}")
    rc, err = _report(tmp_path, capsys, f)
    assert rc == 2 and "more JSON than a report reads" in err and len(err.strip().splitlines()) == 1


def test_a_deeply_nested_json_is_one_line(tmp_path, capsys):
    f = tmp_path / "deep.json"
    f.write_text('{"rows": ' + "[" * 100_000 + "]" * 100_000 + "}")
    rc, err = _report(tmp_path, capsys, f)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_abort_of_a_sample_waiting_on_a_lingering_prompt_frees_it():
    llm = LLM(model="tiny", device="cpu", dtype="float32", mode="chunked", num_blocks=256, max_num_seqs=4,
              max_num_batched_tokens=128, max_model_len=1024)
    engine = llm.engine
    rid = engine.add_request([(i * 5) % 250 for i in range(300)], SamplingParams(n=8, max_tokens=1, seed=1))
    sched = engine.scheduler
    while not sched._lingering:  # the first sample ends while the others wait (max_num_seqs 4)
        engine.step()
    for sid in list(sched.requests):
        if sid != rid:
            engine.abort_request(sid)
    while engine.has_unfinished():
        engine.step()
    assert not sched._lingering and not sched._unforked
    sched.bm.check_invariants()
    assert sched.bm.num_used == 0
