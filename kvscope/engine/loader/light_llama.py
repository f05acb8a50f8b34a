"""A converted llama checkpoint read without transformers' model code, for the CPU decoder (decoder.py).

Importing transformers' llama config and model classes costs about 1.7 s of a 2-core CPU (they pull in
torch.distributed.tensor, torch._dynamo and sympy), more than reading the weights. On a CPU kvscope
runs a llama model through its own forward (decoder.py), which needs the weights, the shapes and the
rotary tables, not the classes. So a converted-cache entry (model_cache.py) whose config.json is
plainly llama (default RoPE, SiLU, no biases, no sliding window) is read straight from its
safetensors into the modules here, named as transformers names them (so pack_linears, the decoder and
weight counts treat both alike), and its tokenizer is transformers' tokenizers-backed class, loaded
without the config machinery. Anything else keeps transformers' loader.

Nothing here computes: forward() refuses, and the decoder's logits are tested bit for bit against
transformers' own model on the same entry (tests/test_light_llama.py).
"""

from __future__ import annotations

import json
import os
import threading
from types import SimpleNamespace

import torch
from torch import nn

from kvscope.engine.cpu.decoder import FORCE_ENV

ARCHITECTURE = "LlamaForCausalLM"
REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "rms_norm_eps", "max_position_embeddings")
FAST_TOKENIZERS = {"TokenizersBackend", "PreTrainedTokenizerFast"}  # the classes tokenizer_config.json names


def read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError("config.json is not an object")
    return config


def rope_theta(config: dict) -> float | None:
    """The RoPE base of a default (unscaled) RoPE, None for any other kind."""
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        if params.get("rope_type", "default") != "default" or set(params) - {"rope_type", "rope_theta"}:
            return None
        return params.get("rope_theta")
    if config.get("rope_scaling") not in (None, {}):
        return None
    return config.get("rope_theta", 10000.0)


def unsupported(config: dict, device: str) -> str | None:
    """Why this config needs transformers' own classes; None when the light model holds it exactly."""
    if os.environ.get(FORCE_ENV) == "transformers":
        return f"{FORCE_ENV}=transformers"
    if device != "cpu":
        return "not a CPU"
    if config.get("architectures") != [ARCHITECTURE] or config.get("model_type") != "llama":
        return f"architectures {config.get('architectures')!r}"
    missing = [k for k in REQUIRED if not isinstance(config.get(k), (int, float)) or isinstance(config.get(k), bool)]
    if missing:
        return f"config.json lacks {missing[0]}"
    if config.get("hidden_act", "silu") != "silu":
        return f"activation {config.get('hidden_act')!r}"
    if config.get("attention_bias") or config.get("mlp_bias"):
        return "biases"
    if config.get("pretraining_tp", 1) != 1 or config.get("quantization_config"):
        return "tensor-parallel or quantized weights"
    if config.get("sliding_window") or config.get("layer_types"):
        return "sliding windows"
    theta = rope_theta(config)
    if not isinstance(theta, (int, float)) or theta <= 0:
        return "a RoPE other than the default"
    return None


def _meta(*shape: int) -> nn.Parameter:
    """A parameter with a shape and no memory: load() assigns the file's tensor in its place."""
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


def _linear(in_features: int, out_features: int) -> nn.Linear:
    """A torch Linear (what pack_linears packs) built without its random initialisation, which on the meta
    device runs through torch's Python references and imports torch._dynamo (a second of a start)."""
    m = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(m)
    m.in_features, m.out_features = in_features, out_features
    m.weight = _meta(out_features, in_features)
    m.register_parameter("bias", None)
    return m


def _embedding(num: int, dim: int) -> nn.Embedding:
    return nn.Embedding(num, dim, _weight=_meta(num, dim), _freeze=True)


class LightRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = _meta(size)
        self.variance_epsilon = eps


class LightRotary(nn.Module):
    """transformers' default RoPE: the same inverse frequencies and the same cos/sin arithmetic."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = 1.0

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class LightAttention(nn.Module):
    def __init__(self, c: SimpleNamespace, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = c.head_dim
        self.scaling = c.head_dim ** -0.5
        self.q_proj = _linear(c.hidden_size, c.num_attention_heads * c.head_dim)
        self.k_proj = _linear(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.v_proj = _linear(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.o_proj = _linear(c.num_attention_heads * c.head_dim, c.hidden_size)


class LightMLP(nn.Module):
    def __init__(self, c: SimpleNamespace) -> None:
        super().__init__()
        self.gate_proj = _linear(c.hidden_size, c.intermediate_size)
        self.up_proj = _linear(c.hidden_size, c.intermediate_size)
        self.down_proj = _linear(c.intermediate_size, c.hidden_size)


class LightDecoderLayer(nn.Module):
    def __init__(self, c: SimpleNamespace, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LightAttention(c, layer_idx)
        self.mlp = LightMLP(c)
        self.input_layernorm = LightRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = LightRMSNorm(c.hidden_size, c.rms_norm_eps)


class LightBody(nn.Module):
    def __init__(self, c: SimpleNamespace) -> None:
        super().__init__()
        self.embed_tokens = _embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(LightDecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = LightRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = LightRotary(c.head_dim, c.rope_theta)


class LightLlamaForCausalLM(nn.Module):
    """The weights of a LlamaForCausalLM under transformers' names; run by decoder.py only."""

    decoder_only = True  # attention.install registers nothing with transformers for it

    def __init__(self, config: SimpleNamespace, generation_config: SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        self.model = LightBody(config)
        self.lm_head = _linear(config.hidden_size, config.vocab_size)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def forward(self, *args, **kwargs):
        raise RuntimeError("a light llama model runs through kvscope's decoder (engine/cpu/decoder.py) only")


def _namespace(config: dict) -> SimpleNamespace:
    c = SimpleNamespace(**{k: v for k, v in config.items() if isinstance(k, str) and k.isidentifier()})
    c.head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    c.rope_theta = float(rope_theta(config))
    c.hidden_act = config.get("hidden_act", "silu")
    c.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
    c.sliding_window = None
    return c


def load(path: str, config: dict, dtype: torch.dtype) -> LightLlamaForCausalLM:
    """The model from an entry's model.safetensors; ValueError when its tensors are not the config's."""
    from safetensors.torch import load_file

    c = _namespace(config)
    generation = {}
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path, encoding="utf-8") as f:
            generation = json.load(f)
    model = LightLlamaForCausalLM(c, SimpleNamespace(eos_token_id=generation.get("eos_token_id")))
    state = load_file(os.path.join(path, "model.safetensors"), device="cpu")
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        state["lm_head.weight"] = state.get("model.embed_tokens.weight")
    expected = {name: p.shape for name, p in model.named_parameters()}
    if set(state) != set(expected) or any(state[n] is None for n in state):
        missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        raise ValueError(f"weights {'missing ' + missing[0] if missing else 'not in a llama model: ' + extra[0]}")
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise ValueError(f"{name} has shape {tuple(state[name].shape)}, the config says {tuple(shape)}")
    state = {n: t if t.dtype == dtype else t.to(dtype) for n, t in state.items()}
    if c.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if c.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.requires_grad_(False).eval()


def load_tokenizer(path: str):
    """The entry's tokenizer: transformers' tokenizers-backed class directly when tokenizer_config.json names it
    (AutoTokenizer would first import the model's config class), else AutoTokenizer."""
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    if name in FAST_TOKENIZERS:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_with_tokenizer(path: str, dtype: torch.dtype, with_tokenizer: bool):
    """(model with its linear layers packed for oneDNN, tokenizer or None). The tokenizer (Python: imports and
    JSON) loads on a second thread while the weights are packed (oneDNN, which lets go of the GIL), so the two
    overlap on two cores; pack_linears then finds the model packed."""
    from kvscope.engine.cpu.linear import pack_linears, packing_unavailable

    result: dict = {}

    def tokenizer_thread() -> None:
        try:
            result["tokenizer"] = load_tokenizer(path)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            result["error"] = e

    thread = threading.Thread(target=tokenizer_thread, name="kvscope-tokenizer", daemon=True)
    if with_tokenizer:
        thread.start()
    try:
        model = load(path, read_config(path), dtype)
        if packing_unavailable(dtype) is None:
            pack_linears(model)
    finally:
        if with_tokenizer:
            thread.join()
    if "error" in result:
        raise result["error"]
    return model, result.get("tokenizer")
