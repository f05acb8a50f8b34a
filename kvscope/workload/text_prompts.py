"""Real text prompts for models whose tokenizer reads text and has a chat template.

A synthetic workload draws prompt lengths as token counts; with a real model the
engine is then served real instructions instead (texts/instructions.json, data shipped
in the package), each through the model's chat template. A prompt that the spec wants
long carries notes to read first, added until it reaches about the drawn length, so
the workload's shape (short chats, a few long prompts) stays, and its question is about the notes
(the last note, the one nearest the question, asked before the notes and again after them). Each note
appears at most once: a very long drawn length gets a shorter prompt rather than notes repeated, which
SmolLM2-135M (checked greedily) answers by copying the notes instead of the question. Every prompt starts with
the template's system turn, so prefix caching sees a shared prefix as in real chat traffic.
Choices are seeded by (seed, request index): the same run gives the same prompts.
"""

from __future__ import annotations

import json
from importlib import resources
from random import Random
from typing import Protocol

NOTES_MARGIN = 16  # stop adding notes this many tokens short of the drawn length


class ChatTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def render_chat(self, messages: list[dict[str, str]]) -> str: ...


def load_texts() -> dict:
    return json.loads(resources.files("kvscope.workload").joinpath("texts/instructions.json").read_text("utf-8"))


class TextPrompts:
    def __init__(self, tokenizer: ChatTokenizer, seed: int = 0) -> None:
        texts = load_texts()
        self.tokenizer = tokenizer
        self.seed = seed
        self.instructions: list[str] = texts["instructions"]
        self.intro: str = texts["notes_intro"]
        self.notes: list[str] = texts["notes"]
        self.note_questions: list[list[str]] = texts["note_questions"]
        self._note_len = [len(tokenizer.encode(n + "\n\n")) for n in self.notes]

    def _ids(self, content: str) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.render_chat([{"role": "user", "content": content}]))

    def prompt(self, target_len: int, index: int, max_len: int | None = None) -> list[int]:
        """Token ids of a real chat prompt of about target_len tokens (at most max_len)."""
        rng = Random(f"kvscope.workload/{self.seed}/text/{index}")
        question = rng.choice(self.instructions)
        ids = self._ids(question)
        limit = min(target_len, max_len) if max_len is not None else target_len
        if limit - len(ids) <= NOTES_MARGIN + min(self._note_len):
            return ids if max_len is None or len(ids) <= max_len else ids[-max_len:]
        asked = rng.randrange(len(self.notes))
        question = rng.choice(self.note_questions[asked])
        room = limit - len(self._ids(f"{self.intro} {question}\n\n{question}")) - NOTES_MARGIN - self._note_len[asked]
        if room < 0:  # not even the note its question is about fits: the plain instruction
            return ids
        parts = []
        for k in range(asked + 1, asked + len(self.notes)):  # the other notes first, each at most once
            n = k % len(self.notes)
            if room >= self._note_len[n]:
                parts.append(self.notes[n])
                room -= self._note_len[n]
        parts.append(self.notes[asked])
        # the question before the notes and again after them: a small model then keeps to it in a long context
        return self._ids(f"{self.intro} {question}\n\n" + "\n\n".join(parts) + f"\n\n{question}")
