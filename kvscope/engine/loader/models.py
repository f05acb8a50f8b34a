"""Where models come from: built-in shapes with deterministic random weights, a local checkpoint
directory, a GGUF file (gguf.py), or a named real model fetched once into a cache (named_models.py).

The model code itself is transformers'; kvscope swaps in its own attention
(see attention.py) so every layer reads and writes the paged KV cache.
Nothing is ever fetched from a hub.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from kvscope.engine.loader.attention_spec import AttentionSpec, attention_spec, check_raw_config
from kvscope.errors import KvscopeError
from kvscope.engine.loader.shapes import BUILTIN_SHAPES
from kvscope.engine.loader.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")

@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Tokenizer | None
    eos_token_ids: frozenset[int]
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    vocab_size: int
    attention: AttentionSpec = AttentionSpec(())  # per-layer sliding windows (none: full attention everywhere)
    source: str = ""  # where the weights came from, for the start-up line (e.g. "GGUF Q4_1, dequantized")
    weight_bytes: int = 0  # memory the weights take in the engine's dtype
    linear_note: str = ""  # how the linear layers run on a CPU (cpu_linear.py), for start-up
    gguf_path: str = ""  # the GGUF file the weights were read from (--quantization gguf reads its blocks)

    def describe(self, dtype: str) -> str:
        """The start-up line: which model, where from, the dtype its weights run in and their memory."""
        origin = f" ({self.source})" if self.source else ""
        linear = f"; {self.linear_note}" if self.linear_note else ""
        return f"model {self.name}{origin}: weights in {dtype}, {self.weight_bytes / 2**20:,.0f} MiB{linear}"


def build_builtin(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    """A transformers Qwen3ForCausalLM with deterministic random weights (eager/sdpa attention)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**BUILTIN_SHAPES[name], eos_token_id=ByteTokenizer.EOS, bos_token_id=ByteTokenizer.BOS,
                         pad_token_id=ByteTokenizer.PAD)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.pad_token_id = ByteTokenizer.PAD
    return model.to(device=device, dtype=dtype).eval()


def _read_config(path: str) -> dict:
    config_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise KvscopeError(f"model {path!r} is neither a built-in model ({', '.join(BUILTIN_SHAPES)}) nor a directory")
    if not os.path.isfile(config_path):
        raise KvscopeError(f"model directory {path!r} has no config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise KvscopeError(f"cannot read {config_path}: {e}") from None
    arch = config.get("model_type") if isinstance(config, dict) else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise KvscopeError(
            f"unsupported architecture {arch!r} in {config_path} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    check_raw_config(config, config_path)
    return config


def _read_hf_config(path: str):
    """The checkpoint's config parsed by transformers itself (its defaults and derived fields applied)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers' own validation (e.g. layer_types) raises ValueError and others
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise KvscopeError(f"cannot read the config of {path!r}: {first_line}") from None


def _load_gguf(name: str, path: str, dtype: torch.dtype, device: str) -> LoadedModel:
    from kvscope.engine.loader import gguf
    from kvscope.engine.loader import model_cache

    header = gguf.check_servable(path)  # refused in one line before any conversion or cache read

    def convert():
        return gguf.load_gguf(path, dtype, device)[:2]

    model, hf_tokenizer, how = model_cache.load(path, dtype, device, convert)
    attention_spec(model.config, path)  # refuse sliding-window layouts kvscope does not implement
    tokenizer = HFTokenizer.wrap(hf_tokenizer) if hf_tokenizer is not None else None
    quants = "+".join(q for q in header.quant_names() if q not in ("F32", "F16", "BF16")) or "float"
    cached = f"; {how}" if how else ""
    return _loaded(model, tokenizer, _eos_ids(model, tokenizer), name,
                   source=f"{os.path.basename(path)}, {header.architecture}, {quants} dequantized by transformers"
                          f"{cached}",
                   weight_bytes=gguf.weight_bytes(model), gguf_path=path)


def load_model(name: str, dtype: torch.dtype, device: str, seed: int = 0) -> LoadedModel:
    from kvscope.engine.loader import named_models
    from kvscope.engine.loader.gguf import is_gguf_path

    if name in named_models.NAMED_MODELS:
        return _load_gguf(name, named_models.fetch(name), dtype, device)
    if is_gguf_path(name):
        if not os.path.isfile(name):
            raise KvscopeError(f"GGUF file {name!r} does not exist")
        return _load_gguf(name, name, dtype, device)
    if name in BUILTIN_SHAPES:
        model = build_builtin(name, dtype=dtype, device=device, seed=seed)
        tokenizer: Tokenizer | None = ByteTokenizer()
        eos = frozenset({ByteTokenizer.EOS})
    else:
        _read_config(name)
        hf_config = _read_hf_config(name)
        attention_spec(hf_config, os.path.join(name, "config.json"))  # refuse before reading any weights
        from transformers import AutoModelForCausalLM

        try:
            model, info = AutoModelForCausalLM.from_pretrained(name, config=hf_config, dtype=dtype,
                                                               local_files_only=True, output_loading_info=True)
        except Exception as e:  # a corrupt file or mismatched shapes surface as several exception types
            first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise KvscopeError(f"cannot load checkpoint {name!r}: {first_line}") from None
        missing = sorted(info.get("missing_keys") or [])
        if missing:  # transformers would quietly fill these with random values
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise KvscopeError(f"checkpoint {name!r} lacks weights: {missing[0]}{more}")
        sinks = sorted(k for k in info.get("unexpected_keys") or [] if "sink" in k.lower())
        if sinks:  # e.g. per-head attention sink logits, which transformers would drop
            raise KvscopeError(f"checkpoint {name!r} has attention-sink weights ({sinks[0]}), "
                               "which kvscope does not implement")
        model = model.to(device).eval()
        try:
            tokenizer = HFTokenizer(name)
        except Exception:  # a checkpoint without tokenizer files takes token-id prompts only
            tokenizer = None
        eos = _eos_ids(model, tokenizer)
    from kvscope.engine.loader.gguf import weight_bytes

    return _loaded(model, tokenizer, eos, name, weight_bytes=weight_bytes(model))


def _loaded(model, tokenizer, eos: frozenset[int], name: str, **extra) -> LoadedModel:
    cfg = model.config
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=eos,
        name=name,
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        vocab_size=cfg.vocab_size,
        attention=attention_spec(cfg, name),
        **extra,
    )


def _eos_ids(model, tokenizer) -> frozenset[int]:
    """Every id that ends generation, as transformers' generate would stop on it."""
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return frozenset(int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos]))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return frozenset({int(tokenizer.eos_token_id)})
    return frozenset()
