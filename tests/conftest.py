"""Shared fixtures for the engine tests: reference models and transformers' own greedy outputs.

The reference side always runs transformers' `generate`, one prompt at a time
(batch size 1, no padding), with do_sample=False. Outputs are cached for the
whole session so every mode and condition compares against the same answers
without recomputing them.
"""

from __future__ import annotations

import os
import random
import signal
from collections import Counter

import pytest

import kvscope  # noqa: F401 - before any torch op: an ISA cap (docs/CPU.md) reaches ATen and oneDNN
import torch

# Triton reads TRITON_INTERPRET once, when a kernel is decorated, and vLLM's scheduler (imported by
# many test modules at collection) imports triton: set it here, before any test module loads, so
# the kernel tests run under the interpreter whatever order the modules are collected in.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A suite started as a background job of a script (`sh -c 'make test &'`) inherits SIGINT ignored,
# and an ignored signal stays ignored across exec: the servers the tests stop with Ctrl-C, as a
# user does, would then never stop. A handler, unlike SIG_IGN, resets to the default on exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# A Llama that differs from the built-in tiny Qwen3 in every attention dimension:
# 6 query heads over 2 KV heads (group of 3), head_dim 16, 3 layers, its own vocab.
LLAMA_SHAPE = dict(
    vocab_size=300,
    hidden_size=96,
    intermediate_size=192,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    initializer_range=0.2,
    tie_word_embeddings=False,
)
LLAMA_EOS_PROBE_TOKENS = 24  # how far the EOS probe looks when picking the checkpoint's eos id


def token_prompts(lengths, vocab: int, seed: int) -> list[list[int]]:
    """Deterministic random token-id prompts, one per length (ids 3.. keep clear of specials)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def eos_probe_prompts() -> list[list[int]]:
    return token_prompts([3, 7, 12, 18, 25, 33, 40, 5, 9, 14, 21, 29], LLAMA_SHAPE["vocab_size"], seed=11)


class HFReference:
    """transformers' greedy generate for one model, cached per (prompt, max_new_tokens, stop_at_eos)."""

    def __init__(self, model) -> None:
        self.model = model
        self._cache: dict[tuple, list[int]] = {}
        self.eos_token_id = model.generation_config.eos_token_id

    def greedy(self, prompt: list[int], max_new_tokens: int, stop_at_eos: bool = False) -> list[int]:
        key = (tuple(prompt), max_new_tokens, stop_at_eos)
        if key not in self._cache:
            import torch

            ids = torch.tensor([prompt], dtype=torch.long)
            gen_config = self.model.generation_config
            # generate() fills unset arguments from the model's generation_config, so ignoring
            # eos means clearing it there for the duration of the call.
            saved, gen_config.eos_token_id = gen_config.eos_token_id, (self.eos_token_id if stop_at_eos else None)
            try:
                with torch.inference_mode():
                    out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                              max_new_tokens=max_new_tokens, do_sample=False)
            finally:
                gen_config.eos_token_id = saved
            tokens = out[0, len(prompt):].tolist()
            if not stop_at_eos:
                assert len(tokens) == max_new_tokens, "transformers stopped early although eos was disabled"
            self._cache[key] = tokens
        return self._cache[key]

    def greedy_all(self, prompts, max_new_tokens: int, stop_at_eos: bool = False) -> list[list[int]]:
        return [self.greedy(p, max_new_tokens, stop_at_eos) for p in prompts]


@pytest.fixture(scope="session")
def tiny_ref() -> HFReference:
    """The built-in tiny model as a plain transformers model: the same weights LLM(model="tiny") builds."""
    from kvscope.engine.loader.models import build_builtin

    return HFReference(build_builtin("tiny"))


def _pick_llama_eos(model) -> int:
    """A token the model emits mid-generation for some probe prompts but not right away for all of them."""
    ref = HFReference(model)
    first_at: dict[int, list[int]] = {}
    for prompt in eos_probe_prompts():
        out = ref.greedy(prompt, LLAMA_EOS_PROBE_TOKENS)
        seen = set()
        for pos, tok in enumerate(out):
            if tok not in seen:
                seen.add(tok)
                first_at.setdefault(tok, []).append(pos)
    # Prefer tokens that stop several prompts, each well inside the window (not at the first token).
    def score(item):
        tok, positions = item
        mid = [p for p in positions if 2 <= p <= LLAMA_EOS_PROBE_TOKENS - 4]
        early = [p for p in positions if p < 2]
        return (len(mid) - 3 * len(early), -tok)

    tok, positions = max(first_at.items(), key=score)
    assert any(2 <= p <= LLAMA_EOS_PROBE_TOKENS - 4 for p in positions), "no usable mid-generation eos candidate"
    return tok


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    """A LlamaForCausalLM checkpoint (config.json + safetensors, no tokenizer) whose eos id the model really emits."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**LLAMA_SHAPE, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        model = LlamaForCausalLM(config).eval()
    eos = _pick_llama_eos(model)
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    path = tmp_path_factory.mktemp("llama_ckpt")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def llama_ref(llama_dir) -> HFReference:
    """The saved checkpoint, read back by transformers itself."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, local_files_only=True).eval()
    return HFReference(model)


@pytest.fixture(scope="session")
def models(tiny_ref, llama_dir, llama_ref):
    """name -> (LLM model argument, HF reference, vocab size)."""
    return {
        "tiny": ("tiny", tiny_ref, tiny_ref.model.config.vocab_size),
        "llama": (llama_dir, llama_ref, LLAMA_SHAPE["vocab_size"]),
    }


class Recorder:
    """An EventSink that keeps every event."""

    def __init__(self) -> None:
        self.events = []

    def publish(self, event) -> None:
        self.events.append(event)

    def of_type(self, kind: str):
        return [e for e in self.events if e.type == kind]

    def prefill_chunks(self) -> Counter:
        """Prefill entries per request over all steps."""
        return Counter(b.req for e in self.of_type("step") for b in e.batch if b.kind == "prefill")


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


# Tiny windowed checkpoints, each written by save_pretrained and read back by
# transformers for the reference: windows that are not multiples of the block size, a
# Mistral (every layer slides), a hybrid Qwen3 (layer types full, sliding) and a Qwen2
# whose every layer slides through use_sliding_window + max_window_layers 0.
WINDOW_SHAPE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    initializer_range=0.2,
    tie_word_embeddings=False,
)
WINDOWED_CONFIGS = {
    "mistral-w24": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=24)),
    "qwen3-hybrid-w20": ("Qwen3Config", "Qwen3ForCausalLM",
                         dict(use_sliding_window=True, sliding_window=20, max_window_layers=1)),
    "qwen2-w13": ("Qwen2Config", "Qwen2ForCausalLM",
                  dict(use_sliding_window=True, sliding_window=13, max_window_layers=0)),
}


def save_checkpoint(path, config_cls: str, model_cls: str, seed: int = 7, **overrides) -> str:
    """A random tiny checkpoint of a transformers config/model class, written by save_pretrained."""
    import torch
    import transformers

    config = getattr(transformers, config_cls)(**{**WINDOW_SHAPE, **overrides}, bos_token_id=1, eos_token_id=2,
                                               pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_cls)(config).eval()
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def windowed_models(tmp_path_factory) -> dict:
    """name -> (checkpoint dir, HF reference read back from it)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for name, (config_cls, model_cls, overrides) in WINDOWED_CONFIGS.items():
        path = save_checkpoint(tmp_path_factory.mktemp(name), config_cls, model_cls, **overrides)
        out[name] = (path, HFReference(AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()))
    return out


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The real model's cached GGUF (tests/test_engine_gguf.py, tests/test_sim_smollm2.py)."""
    from kvscope.engine.loader import named_models

    name = "smollm2-135m"
    if named_models.is_cached(name):
        return named_models.cached_path(name)
    reason = f"{name} is not in the model cache: run `kvscope fetch {name}` (make test does)"
    if os.environ.get("CI") == "true":
        pytest.fail(reason)  # in CI the real model is part of the suite, never skipped
    pytest.skip(reason)
