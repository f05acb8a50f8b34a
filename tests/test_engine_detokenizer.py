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
