"""One OpenAI reply being built from engine updates: the final object, or its stream of SSE chunks.

It is built per choice index: a request with n choices is n ChoiceStates, one per engine
sequence (SamplingParams.n). Streamed, every chunk carries one choice's index and each choice
ends with its own finish_reason chunk (as OpenAI and vLLM stream). usage counts the prompt
once and sums the choices' tokens (vLLM's count). With completions' best_of > n the engine
samples best_of sequences and the reply keeps the n with the highest cumulative logprob.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from kvscope.serve import openai_protocol as oa
from kvscope.serve.bridge import DONE, Update

LOGPROB_FLOOR = -9999.0  # what vLLM reports for a -inf logprob (JSON has no infinity)


@dataclass
class ChoiceState:
    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # TokenLogprobs
    finish_reason: str | None = None
    text_offset: int = 0  # completions' logprobs: where the next token's text starts
    completion_tokens: int = 0

    @property
    def cumulative_logprob(self) -> float:
        return sum(e.logprob for e in self.logprobs)


class Reply:
    def __init__(self, req, model: str, *, chat: bool, tokenizer, sequences: int = 1, echo: str = "") -> None:
        """sequences: how many the engine samples (n, or best_of); echo: chat's text the content starts with."""
        self.chat = chat
        self.model = model
        self.tokenizer = tokenizer
        self.id = oa.new_id("chatcmpl" if chat else "cmpl", req.request_id)
        self.object = "chat.completion" if chat else "text_completion"
        self.created = oa.now_s()
        self.stream = req.stream
        opts = req.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous_usage = bool(opts and opts.include_usage and opts.continuous_usage_stats)
        self.wants_logprobs = (req.logprobs is not None) if not chat else bool(req.logprobs)
        self.keep = req.n  # choices in the reply (fewer than sequences with best_of)
        self.echo = echo
        self.as_token_ids = req.return_tokens_as_token_ids
        self.return_token_ids = req.return_token_ids
        self.choices = {i: ChoiceState(i) for i in range(sequences)}
        self.prompt_ids: list[int] = []
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._sent_prompt_ids = False

    def accepted(self, u: Update) -> None:
        self.prompt_ids, self.prompt_tokens = u.token_ids, u.prompt_tokens

    # ---- logprobs --------------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        if self.as_token_ids or self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chat_logprobs(self, entries: list) -> oa.ChatLogprobs | None:
        if not self.wants_logprobs:
            return None
        content = []
        for e in entries:
            tok = self._token(e.token_id)
            top = [oa.ChatLogprob(t, max(lp, LOGPROB_FLOOR), list(t.encode()))
                   for t, lp in ((self._token(i), lp) for i, lp in e.top)]
            content.append(oa.ChatLogprobContent(tok, max(e.logprob, LOGPROB_FLOOR), list(tok.encode()), top))
        return oa.ChatLogprobs(content)

    def _completion_logprobs(self, state: ChoiceState, entries: list) -> oa.CompletionLogprobs | None:
        if not self.wants_logprobs:
            return None
        lp = oa.CompletionLogprobs([], [], [], [])
        for e in entries:
            tok = self._token(e.token_id)
            top = {self._token(i): max(v, LOGPROB_FLOOR) for i, v in e.top}
            top.setdefault(tok, max(e.logprob, LOGPROB_FLOOR))  # the sampled token is always listed (vLLM)
            lp.tokens.append(tok)
            lp.token_logprobs.append(max(e.logprob, LOGPROB_FLOOR))
            lp.top_logprobs.append(top)
            lp.text_offset.append(state.text_offset)
            state.text_offset += len(tok)
        return lp

    # ---- the whole reply -------------------------------------------------------------------
    def add(self, u: Update) -> None:
        c = self.choices[u.index]
        c.text.append(u.text)
        c.token_ids += u.token_ids
        c.logprobs += u.logprobs
        self._count(u)
        if u.kind == DONE:
            c.finish_reason = oa.openai_finish_reason(u.finish_reason)

    def _count(self, u: Update) -> None:
        self.choices[u.index].completion_tokens = u.completion_tokens
        self.completion_tokens = sum(c.completion_tokens for c in self.choices.values())

    def _kept(self) -> list[tuple[int, ChoiceState]]:
        """(reply index, choice): all of them, or with best_of the `keep` best by cumulative logprob."""
        states = list(self.choices.values())
        if len(states) > self.keep:
            states = sorted(states, key=lambda c: (-c.cumulative_logprob, c.index))[: self.keep]
        return list(enumerate(states))

    def final(self):
        ids = (lambda c: c.token_ids) if self.return_token_ids else (lambda c: msgspec.UNSET)
        kept = self._kept()
        if self.chat:
            choices = [oa.ChatChoice(i, oa.ChatMessage("assistant", self.echo + "".join(c.text)),
                                     self._chat_logprobs(c.logprobs), c.finish_reason, ids(c)) for i, c in kept]
            cls = oa.ChatResponse
        else:
            choices = [oa.CompletionChoice(i, "".join(c.text), self._completion_logprobs(c, c.logprobs),
                                           c.finish_reason, ids(c)) for i, c in kept]
            cls = oa.CompletionResponse
        return cls(self.id, self.object, self.created, self.model, choices,
                   oa.usage(self.prompt_tokens, sum(c.completion_tokens for _, c in kept)),
                   self.prompt_ids if self.return_token_ids else msgspec.UNSET)

    # ---- streaming -------------------------------------------------------------------------
    @staticmethod
    def sse(obj) -> bytes:
        return b"data: " + msgspec.json.encode(obj) + b"\n\n"

    def _chunk(self, choices: list, usage=msgspec.UNSET) -> bytes:
        if usage is msgspec.UNSET and self.include_usage:
            usage = oa.usage(self.prompt_tokens, self.completion_tokens) if self.continuous_usage else None
        prompt_ids = msgspec.UNSET
        if self.return_token_ids and not self._sent_prompt_ids:
            prompt_ids, self._sent_prompt_ids = self.prompt_ids, True
        cls = oa.ChatResponse if self.chat else oa.CompletionResponse
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self.sse(cls(self.id, obj, self.created, self.model, choices, usage, prompt_ids))

    def opening(self) -> list[bytes]:
        """Chat opens each choice with its role (then the echoed text), one chunk per choice as vLLM does."""
        if not self.chat:
            return []
        out = [self._chunk([oa.ChatStreamChoice(i, oa.DeltaMessage(role="assistant", content=""))])
               for i in self.choices]
        if self.echo:
            out += [self._chunk([oa.ChatStreamChoice(i, oa.DeltaMessage(content=self.echo))]) for i in self.choices]
        return out

    def chunks(self, u: Update) -> list[bytes]:
        self._count(u)
        done = u.kind == DONE
        if not (u.text or u.logprobs or done or (self.return_token_ids and u.token_ids)):
            return []
        reason = oa.openai_finish_reason(u.finish_reason) if done else None
        ids = u.token_ids if self.return_token_ids else msgspec.UNSET
        c = self.choices[u.index]
        if self.chat:
            delta = oa.DeltaMessage(content=u.text) if u.text else oa.DeltaMessage()
            choice = oa.ChatStreamChoice(u.index, delta, self._chat_logprobs(u.logprobs), reason, ids)
        else:
            choice = oa.CompletionChoice(u.index, u.text, self._completion_logprobs(c, u.logprobs), reason, ids)
        return [self._chunk([choice])]

    def closing(self) -> list[bytes]:
        if not self.include_usage:
            return []
        return [self._chunk([], oa.usage(self.prompt_tokens, self.completion_tokens))]
