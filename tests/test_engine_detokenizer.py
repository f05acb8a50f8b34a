"""The one incremental detokenizer: whole characters only, stop strings, special tokens, and the LLM API's text."""

from __future__ import annotations

from kvscope.engine import LLM, SamplingParams
from kvscope.engine.detokenizer import IncrementalDetokenizer, detokenize
from kvscope.engine.loader.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
TEXT = "ok 🔭 día ✨"


def test_every_cut_of_a_multibyte_text_ends_on_a_whole_character():
    ids = TOK.encode(TEXT)
    for n in range(1, len(ids) + 1):
        text = detokenize(TOK, ids[:n])
        assert not text.endswith("\ufffd") and TEXT.startswith(text)
        assert len(TOK.decode(ids[:n]).rstrip("\ufffd")) == len(text)  # nothing but the cut character is left out


def test_streamed_pieces_are_whole_characters_and_add_up():
    d = IncrementalDetokenizer(TOK, SamplingParams())
    pieces = []
    for t in TOK.encode(TEXT):
        d.add([t])
        pieces.append(d.take())
    d.finish()
    pieces.append(d.take())
    assert "".join(pieces) == TEXT and all("\ufffd" not in p for p in pieces)


def test_a_stop_string_is_held_back_until_settled_then_cut():
    d = IncrementalDetokenizer(TOK, SamplingParams(stop=["END"]))
    out = ""
    for t in TOK.encode("abcEN"):
        d.add([t])
        out += d.take()
    assert out == "abc"  # "EN" could still become "END"
    assert d.add(TOK.encode("D tail")) and d.take() == "" and d.text == "abc"
    kept = IncrementalDetokenizer(TOK, SamplingParams(stop=["END"], include_stop_str_in_output=True))
    kept.add(TOK.encode("abcEND tail"))
    assert kept.text == "abcEND"


def test_special_tokens_are_skipped_unless_asked():
    ids = [104, 105, ByteTokenizer.EOS, 33]
    assert detokenize(TOK, ids) == "hi!"
    assert detokenize(TOK, ids, SamplingParams(skip_special_tokens=False)) == "hi<|eos|>!"


def test_the_llm_api_text_comes_from_the_same_detokenizer():
    llm = LLM("tiny", device="cpu", num_blocks=32)
    outs = llm.generate([TEXT, "abc"], SamplingParams(max_tokens=7, ignore_eos=True))
    for o in outs:
        assert o.text == detokenize(llm.tokenizer, o.token_ids)
        assert not o.text.endswith("\ufffd")
    text = llm.generate("abc", SamplingParams(max_tokens=12, ignore_eos=True))[0].text
    stop = text[1:3]
    stopped = llm.generate("abc", SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    assert len(stop) == 2 and stopped.finish_reason == "stop" and stopped.text == text[: text.index(stop)]
    off = llm.generate("abc", SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False))[0]
    assert off.text == "" and len(off.token_ids) == 3


class CountingTokenizer(ByteTokenizer):
    """The byte tokenizer, counting its decode calls and the ids each call is given."""

    def __init__(self) -> None:
        self.calls = 0
        self.ids = 0
        self.fail_on: int | None = None  # an id whose decode raises

    def decode(self, token_ids, skip_special_tokens=True):
        self.calls += 1
        self.ids += len(token_ids)
        if self.fail_on is not None and self.fail_on in token_ids:
            raise RuntimeError("injected tokenizer fault")
        return super().decode(token_ids, skip_special_tokens)


def _followed(tok, ids: list[int], params: SamplingParams, drop_last: bool = False) -> IncrementalDetokenizer:
    """A detokenizer following a request's token list (prompt "ab"), the ids appended as steps would."""
    tokens = [97, 98]
    d = IncrementalDetokenizer(tok, params, tokens)
    d.follow(tokens, 2)
    tokens.extend(ids)
    d.end(drop_last)
    return d


def test_a_followed_text_is_the_text_fed_id_by_id():
    ids = [*TOK.encode(TEXT), ByteTokenizer.EOS, *TOK.encode(" más"), 0xF0, 0x9F]  # ends mid-character
    for params in (SamplingParams(), SamplingParams(skip_special_tokens=False)):
        fed = IncrementalDetokenizer(TOK, params, [97, 98])
        fed.add(ids)
        fed.finish()
        assert _followed(TOK, ids, params).text == fed.text
    # a stop token that ended the request is not text, unless asked for (vLLM's rule)
    stop = SamplingParams(skip_special_tokens=False)
    assert _followed(TOK, [104, 105, ByteTokenizer.EOS], stop, drop_last=True).text == "hi"
    kept = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    assert _followed(TOK, [104, 105, ByteTokenizer.EOS], kept, drop_last=True).text == "hi<|eos|>"


def test_the_engine_decodes_no_text_until_it_is_read_unless_a_stop_string_needs_it():
    llm = LLM("tiny", device="cpu", num_blocks=64)
    tok = CountingTokenizer()
    llm.engine.tokenizer = tok
    plain = llm.engine.add_request("abc", SamplingParams(max_tokens=12, ignore_eos=True))
    stopping = llm.engine.add_request("abd", SamplingParams(max_tokens=12, ignore_eos=True, stop=["\x00never"]))
    reqs = dict(llm.engine.scheduler.requests)
    calls_at_start = tok.calls
    finished = []
    while llm.engine.has_unfinished():
        finished += llm.engine.step()
    assert {r.req_id for r in finished} == {plain, stopping}
    only_stop = tok.calls - calls_at_start
    assert only_stop >= 12, "the request with a stop string is decoded as its ids come"
    text = reqs[plain].detokenizer.text  # read: decoded now, id by id
    assert tok.calls - calls_at_start > only_stop
    assert text == detokenize(TOK, reqs[plain].output_token_ids)


def test_ids_that_add_no_text_are_settled_in_short_windows():
    tok = CountingTokenizer()
    d = IncrementalDetokenizer(tok, SamplingParams())
    d.add([ByteTokenizer.PAD] * 2000 + TOK.encode("ok"))  # a long run of skipped special tokens
    d.finish()
    assert d.text == "ok"
    assert tok.ids < 2002 * 20, "each decode sees a short window, not the whole run"


def test_a_tokenizer_fault_met_when_a_followed_text_is_read_ends_that_request_alone():
    llm = LLM("tiny", device="cpu", num_blocks=64)
    tok = CountingTokenizer()
    llm.engine.tokenizer = tok
    bad = llm.engine.add_request("abc", SamplingParams(max_tokens=20, ignore_eos=True))
    good = llm.engine.add_request("xyz", SamplingParams(max_tokens=20, ignore_eos=True))
    reqs = dict(llm.engine.scheduler.requests)
    llm.engine.step()
    llm.engine.step()
    tok.fail_on = reqs[bad].output_token_ids[-1]
    before = reqs[bad].detokenizer.take()  # read: the fault is met at its second id
    assert reqs[bad].detokenizer.error and before == detokenize(TOK, reqs[bad].output_token_ids[:1])
    tok.fail_on = None
    ended = llm.engine.step()
    assert [r.req_id for r in ended] == [bad] and reqs[bad].finish_reason == "error"
    assert "injected tokenizer fault" in reqs[bad].error
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert reqs[good].finish_reason == "length" and reqs[good].detokenizer.error is None
