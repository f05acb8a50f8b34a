"""Tokenizers: a byte-level one for built-in models, or a checkpoint's own through transformers."""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; special tokens sit above them. No chat template, and no BOS is added
    (add_special_tokens has nothing to add)."""

    has_chat_template = False

    NUM_BYTES = 256
    EOS, BOS, PAD, UNK = 256, 257, 258, 259
    NUM_SPECIAL = 4
    SPECIAL_NAMES = ("<|eos|>", "<|bos|>", "<|pad|>", "<|unk|>")  # how skip_special_tokens=False shows them
    vocab_size = NUM_BYTES + NUM_SPECIAL

    eos_token_id: int | None = EOS

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            return bytes(t for t in token_ids if 0 <= t < self.NUM_BYTES).decode("utf-8", errors="replace")
        out, run = [], bytearray()
        for t in token_ids:
            if 0 <= t < self.NUM_BYTES:
                run.append(t)
            elif self.NUM_BYTES <= t < self.vocab_size:
                out.append(run.decode("utf-8", errors="replace") + self.SPECIAL_NAMES[t - self.NUM_BYTES])
                run = bytearray()
        return "".join(out) + run.decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's tokenizer, loaded from its directory (never from a hub)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.eos_token_id = self._tok.eos_token_id

    @classmethod
    def wrap(cls, hf_tokenizer) -> "HFTokenizer":
        """One transformers already loaded (from a GGUF file's own vocabulary and template)."""
        self = cls.__new__(cls)
        self._tok = hf_tokenizer
        self.eos_token_id = hf_tokenizer.eos_token_id
        return self

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **kwargs) -> str:
        """The checkpoint's chat template applied to messages (by default ending with the assistant's turn);
        kwargs reach the template (vLLM's chat_template_kwargs, continue_final_message)."""
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **kwargs)
