"""Bad input gets a one-line error, never a traceback, and the engine keeps serving."""

from __future__ import annotations

import json

import pytest

from conftest import token_prompts
from kvscope.engine import LLM, KvscopeError, RequestRejected, SamplingParams

MODES = ("naive", "static", "continuous", "chunked")


def one_line_error(excinfo) -> str:
    e = excinfo.value
    msg = str(e)
    assert isinstance(e, KvscopeError), f"{type(e).__name__} is not a user-facing error"
    assert msg and "\n" not in msg, f"not a single line: {msg!r}"
    return msg


# ---- start-up errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("settings, match", [
    (dict(mode="fast"), "unknown mode 'fast'"),
    (dict(policy="lifo"), "unknown policy 'lifo'"),
    (dict(policy="no_such_module_xyz:Policy"), "cannot import 'no_such_module_xyz'"),
    (dict(policy="kvscope.engine.sched.policies:Nope"), "has no 'Nope'"),
    (dict(policy="kvscope.engine.sched.policies:BUILTIN"), "is not a class"),
    (dict(policy="collections:OrderedDict"), "lacks order()"),
    (dict(preemption="drop"), "unknown preemption mode 'drop'"),
    (dict(swap_space=-1), "swap_space must be"),
    (dict(backend="magic"), "unknown backend"),
    (dict(block_size=0), "block_size must be an integer in [1, 1,024]"),
    (dict(max_num_seqs=-3), "max_num_seqs must be an integer in [1,"),
    (dict(max_num_batched_tokens="512"), "max_num_batched_tokens must be an integer in [1,"),
    (dict(num_blocks=0), "num_blocks must be an integer in [1,"),
    (dict(max_model_len=1), "max_model_len must be an integer in [2,"),
    (dict(max_model_len=10**5), "exceeds the model's limit"),
    (dict(num_blocks=10**12), "num_blocks must be an integer in [1, 2,097,152]"),
    (dict(swap_space=float("inf")), "swap_space must be a number in [0, 1024] GiB"),
    (dict(swap_space=1e6), "swap_space must be a number in [0, 1024] GiB"),
    (dict(preemption="swap", swap_space=1000.0), "is more than this machine's memory"),
    (dict(device="tpu"), "unknown device 'tpu'"),
    (dict(dtype="int8"), "unknown dtype 'int8'"),
])
def test_bad_settings(settings, match):
    settings.setdefault("device", "cpu")
    with pytest.raises(KvscopeError) as excinfo:
        LLM("tiny", **settings)
    assert match in one_line_error(excinfo)


def test_unknown_model_name():
    with pytest.raises(KvscopeError) as excinfo:
        LLM("no-such-model-anywhere", device="cpu", dtype="float32")
    assert "neither a built-in model" in one_line_error(excinfo)


def test_model_dir_without_config(tmp_path):
    with pytest.raises(KvscopeError) as excinfo:
        LLM(str(tmp_path), device="cpu", dtype="float32")
    assert "has no config.json" in one_line_error(excinfo)


@pytest.mark.parametrize("config, match", [
    ({"model_type": "gpt2", "n_layer": 2}, "unsupported architecture 'gpt2'"),
    ({"architectures": ["Foo"]}, "unsupported architecture None"),
    ([1, 2, 3], "unsupported architecture None"),
])
def test_unsupported_architecture(tmp_path, config, match):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(KvscopeError) as excinfo:
        LLM(str(tmp_path), device="cpu", dtype="float32")
    assert match in one_line_error(excinfo)


def test_unreadable_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(KvscopeError) as excinfo:
        LLM(str(tmp_path), device="cpu", dtype="float32")
    assert "cannot read" in one_line_error(excinfo)


def test_checkpoint_without_weights(tmp_path, llama_dir):
    (tmp_path / "config.json").write_text((open(f"{llama_dir}/config.json")).read())
    with pytest.raises(KvscopeError) as excinfo:
        LLM(str(tmp_path), device="cpu", dtype="float32")
    assert "cannot load checkpoint" in one_line_error(excinfo)


def test_checkpoint_with_corrupt_weights(tmp_path, llama_dir):
    (tmp_path / "config.json").write_text((open(f"{llama_dir}/config.json")).read())
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(KvscopeError) as excinfo:
        LLM(str(tmp_path), device="cpu", dtype="float32")
    assert "cannot load checkpoint" in one_line_error(excinfo)


def test_checkpoint_whose_weights_do_not_match_its_config(tmp_path, llama_dir):
    config = json.loads(open(f"{llama_dir}/config.json").read())
    config["hidden_size"] *= 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(open(f"{llama_dir}/model.safetensors", "rb").read())
    with pytest.raises(KvscopeError) as excinfo:
        LLM(str(tmp_path), device="cpu", dtype="float32")
    assert "cannot load checkpoint" in one_line_error(excinfo)


def test_checkpoint_missing_a_tensor_is_refused_not_filled_with_random_weights(tmp_path, llama_dir):
    from safetensors.torch import load_file, save_file

    weights = load_file(f"{llama_dir}/model.safetensors")
    dropped = next(k for k in sorted(weights) if k.endswith("mlp.up_proj.weight"))
    del weights[dropped]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(open(f"{llama_dir}/config.json").read())
    with pytest.raises(KvscopeError) as excinfo:
        LLM(str(tmp_path), device="cpu", dtype="float32")
    assert dropped in one_line_error(excinfo)


# ---- per-request errors ------------------------------------------------------------------------------


def test_engine_add_request_rejects_and_publishes(recorder):
    llm = LLM("tiny", device="cpu", dtype="float32", num_blocks=4, block_size=16, sink=recorder)
    engine = llm.engine
    with pytest.raises(RequestRejected) as excinfo:
        engine.add_request([1] * 100, SamplingParams(max_tokens=4))
    msg = one_line_error(excinfo)
    (reject,) = recorder.of_type("reject")
    assert reject.reason == msg and reject.req == 0
    assert not engine.has_unfinished(), "a rejected request must not be queued"
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert [r.req_id for r in finished] == [rid] and finished[0].num_output_tokens == 4


@pytest.mark.parametrize("mode", MODES)
def test_mixed_good_and_bad_prompts(tiny_ref, mode):
    # 4 blocks of 16: the KV cache holds 64 tokens; max_model_len 48 is below that.
    llm = LLM("tiny", mode=mode, device="cpu", dtype="float32", num_blocks=4, block_size=16, max_model_len=48)
    good = token_prompts([5, 17, 30], 256, seed=3)
    ok = SamplingParams(max_tokens=12, ignore_eos=True)
    cases = [
        (good[0], ok, None),
        ([7] * 48, ok, "leaves no room to generate within max_model_len 48"),
        ([7] * 65, ok, "does not fit in the KV cache (64 tokens)"),
        (good[1], ok, None),
        ([], ok, "empty prompt"),
        ("", ok, "empty prompt"),
        ([5, 260], ok, "token id 260 is outside the vocabulary (0..259)"),
        ([5, -1], ok, "token id -1 is outside the vocabulary"),
        ([1.5, 2], ok, "a prompt must be a string or a list of token ids"),
        (good[2], SamplingParams(max_tokens=0), "max_tokens must be an integer in [1, 2^63)"),
        (good[2], SamplingParams(max_tokens=4, temperature=-1.0), "temperature must be >= 0"),
        (good[2], SamplingParams(max_tokens=4, top_p=0.0), "top_p must be in (0, 1]"),
        (good[2], ok, None),
    ]
    outs = llm.generate([c[0] for c in cases], [c[1] for c in cases])
    assert len(outs) == len(cases)
    for (prompt, params, error), out in zip(cases, outs):
        if error is None:
            assert out.error is None and out.finish_reason == "length"
            assert out.token_ids == tiny_ref.greedy(prompt, params.max_tokens)
        else:
            assert out.finish_reason == "rejected" and out.token_ids == [] and out.req_id is None
            assert out.error and "\n" not in out.error and error in out.error, out.error
    # the engine is still serving, with nothing left behind
    bm = llm.engine.block_manager
    assert bm.num_free == bm.num_blocks
    (again,) = llm.generate([good[0]], ok)
    assert again.token_ids == tiny_ref.greedy(good[0], 12)


def test_text_prompt_for_a_model_without_tokenizer(models):
    model_arg, ref, vocab = models["llama"]
    llm = LLM(model_arg, device="cpu", dtype="float32", num_blocks=16)
    assert llm.tokenizer is None
    prompt = token_prompts([9], vocab, seed=2)[0]
    bad_token, text, good = llm.generate([[vocab], "hello", prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    assert text.finish_reason == "rejected" and "has no tokenizer" in text.error and "\n" not in text.error
    assert bad_token.finish_reason == "rejected" and f"token id {vocab} is outside" in bad_token.error
    assert good.token_ids == ref.greedy(prompt, 8) and good.text == ""


@pytest.mark.parametrize("args, match", [(["--peers", "foo"], "unknown peer 'foo'"),
                                         (["--modes", "chunked,fast"], "unknown mode 'fast'")])
def test_bench_rejects_bad_row_names_before_running_anything(args, match, capsys):
    from kvscope.cli import main

    assert main(["bench", "--num-requests", "2", *args]) == 2
    err = capsys.readouterr().err
    assert match in err and "[bench]" not in err  # nothing ran first
    assert len(err.strip().splitlines()) == 1
