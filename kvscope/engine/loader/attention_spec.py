"""What a checkpoint asks of attention, read with transformers' own rules: per-layer windows, or a refusal.

kvscope runs transformers' model code with its own paged attention, so anything
the model's attention does beyond causal softmax over a paged context, or over a
sliding window of it, must be implemented here or refused. Which layers slide is
decided exactly as transformers' modeling code of each family decides it:

- Mistral: every layer slides by ``sliding_window`` when it is set. A mistral
  config.json that lists ``layer_types`` is read by transformers' AutoConfig as
  Ministral, whose rule is Qwen's below, while MistralForCausalLM ignores them: kvscope
  refuses such a checkpoint unless both readings agree.
- Qwen2 / Qwen3: layer i slides by ``sliding_window`` when ``layer_types[i]`` is
  ``"sliding_attention"``; the config class derives ``layer_types`` from
  ``use_sliding_window`` and ``max_window_layers`` (layers >= max_window_layers
  slide) when it is not given, and clears ``sliding_window`` unless
  ``use_sliding_window`` is true.
- Llama: no window.

A window w means the query at position p sees keys p-w+1 .. p (w keys, itself
included), as transformers' ``sliding_window_overlay`` (kv_idx > q_idx - w).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.errors import KvscopeError

FULL = "full_attention"
SLIDING = "sliding_attention"

# config.json fields that switch on attention behaviour kvscope does not implement,
# with what they are called in the refusal.
UNSUPPORTED_FIELDS = {
    "attn_logit_softcapping": "attention logit soft-capping",
    "final_logit_softcapping": "final logit soft-capping",
    "logit_softcapping": "logit soft-capping",
    "attention_chunk_size": "chunked attention",
    "no_rope_layers": "layers without rotary embeddings",
    "query_pre_attn_scalar": "a custom attention scale",
    "attention_multiplier": "a custom attention scale",
}
# rotary variants whose frequencies depend on the longest position in the forward
# pass: in a packed batch or a prefill chunk that differs from transformers' generate
POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")

WINDOW_ATTR = "kvscope_sliding_window"  # set on an attention module whose layer has a window (attention.py)


@dataclass(frozen=True)
class AttentionSpec:
    layer_windows: tuple[int | None, ...]  # per layer: the sliding window, or None for full attention

    @property
    def any_window(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer slides by the same one (KV outside it can be freed), else None."""
        windows = set(self.layer_windows)
        if len(windows) == 1 and None not in windows:
            return windows.pop()
        return None


def _set(value) -> bool:
    """A config value that switches its feature on (absent, null, false and 0 leave it off)."""
    return value is not None and value is not False and value != 0


def check_raw_config(raw: dict, where: str) -> None:
    """Refuse, in one line naming the field, config.json features kvscope's attention does not implement."""
    for field, what in UNSUPPORTED_FIELDS.items():
        if _set(raw.get(field)):
            raise KvscopeError(f"{where}: {field}={raw[field]!r} asks for {what}, which kvscope does not implement")
    for field, value in raw.items():
        if "sink" in field.lower() and _set(value):
            raise KvscopeError(f"{where}: {field}={value!r} asks for attention sinks, which kvscope does not implement")
    arch = raw.get("model_type")
    types = raw.get("layer_types")
    if arch == "mistral" and types is not None:
        mistral_rule = SLIDING if raw.get("sliding_window") is not None else FULL
        if not isinstance(types, list) or any(t != mistral_rule for t in types):
            raise KvscopeError(f"{where}: layer_types on a mistral checkpoint: MistralForCausalLM ignores it "
                               "but AutoModelForCausalLM reads the checkpoint as Ministral, and the two disagree")
    if arch == "llama" and _set(raw.get("sliding_window")):
        raise KvscopeError(f"{where}: sliding_window={raw['sliding_window']!r} on a llama checkpoint, whose "
                           "transformers model ignores it; use model_type mistral for a windowed model")


def attention_spec(config, where: str) -> AttentionSpec:
    """Per-layer windows from a parsed transformers config (after its __post_init__), or a one-line refusal."""
    arch = config.model_type
    n = config.num_hidden_layers
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type") if isinstance(rope, dict) else None
    if rope_type in POSITION_DEPENDENT_ROPE:
        raise KvscopeError(f"{where}: rope_type {rope_type!r} (rope_parameters) scales positions by the longest "
                           "sequence in a forward pass, which a packed batch changes; kvscope does not implement it")
    window = getattr(config, "sliding_window", None)
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise KvscopeError(f"{where}: sliding_window must be a positive integer or null, got {window!r}")
    if window == 1:
        # transformers' sliding cache keeps the last w-1 keys as [-(w-1):], which for w=1 is all
        # of them: its generate then disagrees with its own forward, so there is no answer to match
        raise KvscopeError(f"{where}: sliding_window=1 is not supported (transformers' generate attends "
                           "over the whole cache for it)")
    if arch == "mistral":
        return AttentionSpec((window,) * n)
    if arch in ("qwen2", "qwen3", "ministral"):
        types = list(getattr(config, "layer_types", None) or [FULL] * n)
        if len(types) != n:
            raise KvscopeError(f"{where}: layer_types lists {len(types)} layers, num_hidden_layers is {n}")
        unknown = sorted({t for t in types if t not in (FULL, SLIDING)}, key=str)
        if unknown:
            raise KvscopeError(f"{where}: layer_types has {unknown[0]!r}; kvscope implements {FULL!r} and {SLIDING!r}")
        if SLIDING in types and window is None:
            raise KvscopeError(f"{where}: layer_types has {SLIDING!r} layers but sliding_window is not set "
                               "(use_sliding_window is false or sliding_window is null)")
        return AttentionSpec(tuple(window if t == SLIDING else None for t in types))
    return AttentionSpec((None,) * n)
