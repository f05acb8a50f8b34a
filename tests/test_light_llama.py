"""A plain llama entry of the converted-model cache is read without transformers' model classes
(engine/loader/light_llama.py): the same weights under the same names, the same rotary tables, the same
greedy tokens, and anything else is left to transformers' loader."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from _cpu import BF16_PACKING_WHY_NOT, expected_forward
from conftest import HFReference, token_prompts
from kvscope.engine.loader import model_cache
from kvscope.engine.cpu.decoder import FORCE_ENV
from kvscope.engine.loader.light_llama import LightLlamaForCausalLM, unsupported

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.2,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)


def llama(tied: bool, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        return LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=tied, **extra)).eval()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(model_cache.NO_CACHE_ENV, raising=False)
    monkeypatch.delenv(FORCE_ENV, raising=False)
    monkeypatch.setattr(model_cache, "_last", None)
    source = tmp_path / "model.gguf"  # the cache keys the file by content only
    source.write_bytes(b"GGUF" + bytes(range(200)))
    return str(source)


def cached(source, model, dtype=torch.bfloat16, device="cpu"):
    """Write model's entry (as a first start does), then read it back as a later start does."""
    model_cache.load(source, dtype, device, lambda: (model.to(dtype), None), log=lambda m: None)
    model_cache._last = None
    return model_cache.load(source, dtype, device, lambda: pytest.fail("converted again"), log=lambda m: None)[0]


def transformers_reading(source, dtype=torch.bfloat16):
    """transformers' own model from the same entry (as the cache read it before the light model)."""
    from transformers import AutoModelForCausalLM

    path = model_cache.entry_for(source, dtype).path
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()


@pytest.mark.parametrize("tied", [True, False])
def test_the_light_model_holds_transformers_weights_and_rotary_tables(cache, tied):
    light = cached(cache, llama(tied))
    reference = transformers_reading(cache)
    assert isinstance(light, LightLlamaForCausalLM)
    # read with its linear layers packed for oneDNN, where oneDNN packs bf16 (not on an AVX2-only CPU)
    assert type(light.lm_head).__name__ == ("Linear" if BF16_PACKING_WHY_NOT else "PackedLinear")
    for name, want in reference.named_parameters():  # a packed layer's .weight reads back unpacked
        module, attr = name.rsplit(".", 1)
        got = getattr(light.get_submodule(module), attr)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), name
    assert torch.equal(light.lm_head.weight, light.model.embed_tokens.weight) == tied
    x = torch.zeros(1, dtype=torch.bfloat16)
    positions = torch.arange(0, 400, 7)[None]
    for a, b in zip(light.model.rotary_emb(x, positions), reference.model.rotary_emb(x, positions)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("tied", [True, False])
def test_an_engine_on_the_light_model_gives_transformers_greedy_tokens(cache, tied, monkeypatch):
    from kvscope.engine import LLM, SamplingParams
    from kvscope.engine.worker import model_backend
    from kvscope.engine.loader import models

    light = cached(cache, llama(tied))
    reference = HFReference(transformers_reading(cache))
    # model_backend imported before either patch: imported after, it would bind the patched loader for good
    load_light = lambda *a, **k: models._loaded(light, None, frozenset({2}), "light")  # noqa: E731
    monkeypatch.setattr(models, "load_model", load_light)
    monkeypatch.setattr(model_backend, "load_model", load_light)
    prompts = token_prompts([3, 17, 40], 300, seed=5)
    llm = LLM("light", device="cpu", dtype="bfloat16", mode="chunked", max_num_batched_tokens=16)
    assert llm.engine.runner.forward_name == expected_forward("bfloat16")
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference.greedy_all(prompts, 10)


def test_what_the_light_model_does_not_hold_goes_to_transformers(cache, monkeypatch):
    from transformers import LlamaForCausalLM

    scaled = cached(cache, llama(True, rope_scaling={"rope_type": "linear", "factor": 2.0}))
    assert isinstance(scaled, LlamaForCausalLM), "a scaled RoPE keeps transformers' classes"
    base = dict(architectures=["LlamaForCausalLM"], model_type="llama", **SHAPE, rms_norm_eps=1e-5)
    assert unsupported(base, "cpu") is None
    assert unsupported(base, "cuda") == "not a CPU"
    assert unsupported({**base, "architectures": ["Qwen2ForCausalLM"]}, "cpu") == "architectures ['Qwen2ForCausalLM']"
    assert unsupported({**base, "hidden_act": "gelu"}, "cpu") == "activation 'gelu'"
    assert unsupported({**base, "attention_bias": True}, "cpu") == "biases"
    assert unsupported({**base, "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}},
                       "cpu") == "a RoPE other than the default"
    assert unsupported({**base, "sliding_window": 64}, "cpu") == "sliding windows"
    del base["vocab_size"]
    assert unsupported(base, "cpu") == "config.json lacks vocab_size"
    monkeypatch.setenv(FORCE_ENV, "transformers")
    assert unsupported({**base, "vocab_size": 300}, "cpu") == f"{FORCE_ENV}=transformers"


def test_a_light_entry_missing_a_tensor_is_rebuilt(cache):
    import os

    from safetensors.torch import load_file, save_file

    cached(cache, llama(False))
    entry = model_cache.entry_for(cache, torch.bfloat16)
    path = os.path.join(entry.path, "model.safetensors")
    state = load_file(path)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, path, metadata={"format": "pt"})
    manifest = model_cache._read_manifest(entry)  # a consistent manifest: only the light loader can tell
    manifest["files"]["model.safetensors"] = {"size": os.path.getsize(path), "sha256": model_cache.file_sha256(path)}
    with open(os.path.join(entry.path, model_cache.MANIFEST), "w") as f:
        import json

        json.dump(manifest, f)
    model_cache._last = None
    logs = []
    model, _, how = model_cache.load(cache, torch.bfloat16, "cpu", lambda: (llama(False).to(torch.bfloat16), None),
                                     log=logs.append)
    assert any("damaged" in m and "up_proj" in m for m in logs), logs
    assert how == "converted into the cache"


def test_the_real_models_start_imports_no_transformers_model_code(smollm2_path):
    """What the light model is for: a cached SmolLM2 starts without transformers' llama classes (and what they
    pull in: torch._dynamo), and its tokenizer is the one AutoTokenizer gives."""
    code = (
        "import sys, torch\n"
        "from kvscope.engine import LLM\n"
        "llm = LLM('smollm2-135m', device='cpu')\n"
        "heavy = [m for m in ('transformers.models.llama.modeling_llama', 'torch._dynamo') if m in sys.modules]\n"
        "print(type(llm.engine.loaded.model).__name__, '|', llm.engine.runner.forward_name, '|', heavy)\n"
        "from transformers import AutoTokenizer\n"
        "from kvscope.engine.loader.model_cache import entry_for\n"
        f"auto = AutoTokenizer.from_pretrained(entry_for({smollm2_path!r}, llm.engine.backend.torch_dtype).path)\n"
        "mine = llm.engine.loaded.tokenizer\n"
        "chat = [{'role': 'user', 'content': 'Why is the sky blue? ünïcödé'}]\n"
        "text = auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)\n"
        "assert mine.render_chat(chat) == text\n"
        "ids = auto.encode(text, add_special_tokens=False)\n"
        "assert mine.encode(text) == ids and mine.decode(ids) == auto.decode(ids, skip_special_tokens=True)\n"
        "assert mine.eos_token_id == auto.eos_token_id\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # the forward: kvscope's decoder, on the dense weights or (--quantization auto in float32) the GGUF's blocks
    assert out.stdout.split("\n")[0] in ("LightLlamaForCausalLM | kvscope decoder | []",
                                          "LightLlamaForCausalLM | kvscope decoder, linear layers on GGUF blocks | []")
