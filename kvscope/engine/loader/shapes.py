"""The built-in model shapes, as transformers Qwen3Config arguments (no torch: the sim catalog reads them too)."""

from __future__ import annotations

from kvscope.engine.loader.tokenizer import ByteTokenizer

# Built-in shapes. "tiny" is small enough for a CPU demo; std 0.2 keeps greedy
# outputs varied and dependent on the whole context (a model that repeats one
# token would prove nothing in the equality tests).
BUILTIN_SHAPES: dict[str, dict] = {
    "tiny": dict(
        vocab_size=ByteTokenizer.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=16384,
        rope_theta=10000.0,
        initializer_range=0.2,
        tie_word_embeddings=True,
    ),
    "qwen3-0.6b-shape": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        initializer_range=0.02,
        tie_word_embeddings=True,
    ),
}
