"""Real text prompts for models whose tokenizer reads text and has a chat template.

A synthetic workload draws prompt lengths as token counts; with a real model the
engine is then served real instructions instead (texts/instructions.json, data shipped
in the package), each through the model's chat template. A prompt that the spec wants
longer than a note carries one note to read first and asks a question about that note
(texts' note_questions), so short chats stay short and longer prompts stay longer, up to
one note's length: given three or all eight notes (230-500 tokens), SmolLM2-135M (checked
greedily) often copied the first note instead of answering. Every prompt starts with
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
        """Token ids of a real chat prompt of at most about target_len tokens (and at most max_len)."""
        rng = Random(f"kvscope.workload/{self.seed}/text/{index}")
        question = rng.choice(self.instructions)
        ids = self._ids(question)
        limit = min(target_len, max_len) if max_len is not None else target_len
        if limit - len(ids) <= NOTES_MARGIN + min(self._note_len):
            return ids if max_len is None or len(ids) <= max_len else ids[-max_len:]
        asked = rng.randrange(len(self.notes))
        question = rng.choice(self.note_questions[asked])
        room = limit - len(self._ids(f"{self.intro}\n\n{question}")) - NOTES_MARGIN - self._note_len[asked]
        if room < 0:  # not even the note its question is about fits: the plain instruction
            return ids
        return self._ids(f"{self.intro}\n\n{self.notes[asked]}\n\n{question}")
