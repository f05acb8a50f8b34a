"""Output token ids -> text, incrementally, emitting only complete characters.

The one detokenizer of kvscope: the engine keeps one per request that wants text
(`SamplingParams.detokenize`), and the HTTP API, the `LLM` API and stop strings all read
it. Each step decodes only a short window of recent ids (with a few ids of context before
it, so tokenizers that drop a leading space on the first id still space words right), and
text that ends in an incomplete UTF-8 character is held back until the next id completes
it. A reply cut by max_tokens in the middle of a character ends before that character:
no U+FFFD the model did not produce ends up in the text. Ids that add no text (special tokens
skipped, bytes that never form a character) are settled after MAX_PENDING_IDS, so a long run
of them costs no more per id than any other text.

A request without stop strings needs no text while the engine steps, so its detokenizer
follows the request's token list and decodes only when its text is read (take, peek, text):
the engine loop does no detokenizing for it, and the text is the same, id by id.
"""

from __future__ import annotations

from kvscope.engine.isolation import describe
from kvscope.engine.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"
CONTEXT_IDS = 6  # prompt ids decoded before the output, for tokenizers whose decode depends on the left
# more pending ids than any character needs (UTF-8: 4 bytes, one id each at worst): settle what they decode to
MAX_PENDING_IDS = 8


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params: SamplingParams, prompt_ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = [s for s in params.stop if s]
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # a stop string may still be forming in the last (longest - 1) characters: hold them back
        self.hold = 0 if self.include_stop else max((len(s) for s in self.stop), default=1) - 1
        context = list(prompt_ids[-CONTEXT_IDS:]) if prompt_ids else []
        if context and self._decode(context).endswith(REPLACEMENT):
            context = []  # a prompt that ends mid-character would lend its bytes to the first output
        self._ids = context
        self._prefix = 0  # ids[prefix:read] is the decoded context of the next piece
        self._read = len(context)
        self._before: str | None = None  # decode(ids[prefix:read]), kept until the offsets move
        self.num_ids = 0  # output ids added
        self._text = ""  # settled output text (a stop string's cut applied)
        self.sent = 0  # characters of text handed out by take()
        self.stopped = False  # a stop string ended the text
        self.finished = False
        self.error: str | None = None  # a tokenizer fault met while following (the text ends there)
        # following a request's token list (follow()): ids are read from it when text is asked for
        self._source: list[int] | None = None
        self.following = False  # an attribute, not a property: the engine reads it per request per step
        self._source_start = 0
        self._final_end: int | None = None  # where the followed ids end, once the request has ended

    @property
    def text(self) -> str:
        """The settled output text (a stop string's cut applied)."""
        self._catch_up()
        return self._text

    def follow(self, token_ids: list[int], start: int) -> None:
        """Read output ids from token_ids[start:] (a request's growing list) only when text is asked
        for. Only for a detokenizer without stop strings: those must be read as each id comes."""
        if self.stop:
            raise ValueError("stop strings are checked as ids come: feed them with add()")
        self._source, self._source_start = token_ids, start
        self.following = True

    def end(self, drop_last: bool) -> None:
        """The followed request has ended: its ids so far are all there will be, less the last one
        when drop_last (a stop token that ended it; kept with include_stop_str_in_output)."""
        if self._source is not None and self._final_end is None:
            drop = 1 if drop_last and not self.include_stop else 0
            self._final_end = max(self._source_start + self.num_ids, len(self._source) - drop)

    def _catch_up(self) -> None:
        source = self._source
        if source is None or self.finished:
            return
        end = len(source) if self._final_end is None else self._final_end
        start = self._source_start + self.num_ids
        try:
            for token_id in source[start:end]:  # one at a time: each id may complete a character
                self._add_one(token_id)
        except Exception as e:  # noqa: BLE001 - a tokenizer fault ends this text only
            self.error = f"detokenizing failed: {describe(e)}"
            self.finished = True
            return
        if self._final_end is not None:
            self.finished = True

    def _decode(self, ids: list[int]) -> str:
        if self.skip_special_tokens:
            return self.tokenizer.decode(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def add(self, new_ids: list[int]) -> bool:
        """Append output ids; True once a stop string appears (the text is then cut there)."""
        for token_id in new_ids:  # one at a time: each id may complete a character
            if self.stopped or self.finished:
                break
            self._add_one(token_id)
        return self.stopped

    def _add_one(self, token_id: int) -> None:
        self._ids.append(token_id)
        self.num_ids += 1
        if self._before is None:
            self._before = self._decode(self._ids[self._prefix:self._read])
        before = self._before
        now = self._decode(self._ids[self._prefix:])
        if (len(now) <= len(before) or now.endswith(REPLACEMENT)) and len(self._ids) - self._read < MAX_PENDING_IDS:
            return  # an incomplete character at the end: wait for the next id
        start = len(self._text)
        self._text += now[len(before):]
        del self._ids[: self._read]  # the piece just read is the next piece's context; older ids go
        self._prefix, self._read = 0, len(self._ids)
        self._before = None
        self._check_stop(start)

    def _check_stop(self, new_from: int) -> bool:
        if not self.stop or self.num_ids < self.min_tokens:
            return False
        longest = max(len(s) for s in self.stop)
        start = max(0, new_from - longest + 1)
        hits = [(i, s) for i, s in ((self._text.find(s, start), s) for s in self.stop) if i >= 0]
        if not hits:
            return False
        i, s = min(hits)
        self._text = self._text[: i + len(s)] if self.include_stop else self._text[:i]
        self.stopped = True
        return True

    def finish(self) -> None:
        """No more ids: whatever is settled is final (an incomplete last character is dropped)."""
        if self._source is not None:
            self.end(drop_last=False)  # unless end() already said where the ids end
            return  # settled when read
        self.finished = True

    def peek(self, start: int) -> str:
        """The settled text from character ``start`` on, without moving take()'s place (the step events'
        own reader): the same characters take() would hand out."""
        self._catch_up()
        end = len(self._text)
        if not (self.finished or self.stopped):
            end -= self.hold
        return self._text[start:end] if end > start else ""

    def take(self) -> str:
        """Text settled since the last call. Until finish(), the last characters that could still
        turn out to be a stop string are held back."""
        self._catch_up()
        end = len(self._text)
        if not (self.finished or self.stopped):
            end -= self.hold
        if end <= self.sent:
            return ""
        out, self.sent = self._text[self.sent:end], end
        return out


def detokenize(tokenizer, token_ids: list[int], params: SamplingParams | None = None) -> str:
    """The settled text of a whole output at once, by the same rules."""
    d = IncrementalDetokenizer(tokenizer, params or SamplingParams())
    d.add(list(token_ids))
    d.finish()
    return d.text
