"""Real text for real tokenizers: the workload's instructions, and prompts/completions carried by the events.

The model-backed side (SmolLM2 through the serve driver and the HTTP API) is in
test_engine_gguf.py; here a word-level tokenizer stands in, so these run in a blink.
"""

from __future__ import annotations

from msgspec import UNSET

from kvscope.protocol import codec
from kvscope.protocol.events import Finish, KvCounters, OutputText, RequestEvent, StepEvent
from kvscope.tui.model.state import TuiState, reduce
from kvscope.workload.text_prompts import TextPrompts, load_texts


class WordTokenizer:
    """One id per whitespace-separated word; a chat template that wraps the user's turn."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        words = {i: w for w, i in self.vocab.items()}
        return " ".join(words[i] for i in ids)

    def render_chat(self, messages) -> str:
        return "<system> be helpful </system> " + " ".join(f"<{m['role']}> {m['content']}" for m in messages) + \
            " <assistant>"


def test_prompts_are_real_instructions_seeded_and_sized():
    tok = WordTokenizer()
    texts = TextPrompts(tok, seed=3)
    short = texts.prompt(10, index=0)
    text = tok.decode(short)
    assert text.startswith("<system> be helpful") and any(q in text for q in load_texts()["instructions"])
    assert texts.prompt(10, index=0) == short  # same (seed, index): same prompt
    assert len({tuple(texts.prompt(10, index=i)) for i in range(12)}) > 3  # the instructions vary
    long = texts.prompt(600, index=5)
    text = tok.decode(long)
    data = load_texts()
    assert len(long) <= 600 and text.count(data["notes_intro"]) == 1
    # its question is about the note it carries, right before the question
    asked = next(i for i, qs in enumerate(data["note_questions"]) if any(text.endswith(f"{q} <assistant>")
                                                                          for q in qs))
    assert " ".join(data["notes"][asked].split()[-5:]) in text
    assert sum(" ".join(n.split()[:6]) in text for n in data["notes"]) == 1  # one note: a small model keeps to it
    assert len(texts.prompt(600, index=5, max_len=200)) <= 200


def test_events_carry_text_only_when_set_and_the_reducer_keeps_it():
    plain = RequestEvent(1, 5, 8, 0, 0.0)
    assert b"prompt_text" not in codec.encode(plain)  # older streams and byte-level models: unchanged bytes
    ev = RequestEvent(1, 5, 8, 0, 0.0, prompt_text="What is the capital of France?")
    step = StepEvent(step=0, t=0.1, dur=0.05, budget=64, finished=[Finish(1, 0.05, 0.1, 7, "stop")],
                     kv=KvCounters(total=8, free=8))
    assert step.outputs is UNSET and b"outputs" not in codec.encode(step)
    step.outputs = [OutputText(1, "The capital of France is Paris.")]
    state = TuiState()
    for e in (ev, step):
        reduce(state, codec.decode(codec.encode(e)))
    r = state.get(1)
    assert (r.prompt_text, r.output_text, r.finish_reason) == ("What is the capital of France?",
                                                                "The capital of France is Paris.", "stop")


def test_the_tiny_models_events_carry_no_text():
    from conftest import Recorder
    from kvscope.engine import LLM, SamplingParams

    rec = Recorder()
    LLM("tiny", device="cpu", num_blocks=16, sink=rec).generate(["hello"], SamplingParams(max_tokens=3))
    assert all(e.prompt_text is UNSET for e in rec.of_type("request"))
    assert all(e.outputs is UNSET for e in rec.of_type("step"))


def test_the_shipped_real_model_trace_shows_real_text_in_request_detail(tmp_path):
    """traces/smollm2-cpu.kvtrace (SmolLM2-135M on CPU): the detail shot is deterministic and shows the reply."""
    import os

    from kvscope.traces.reader import TraceReader
    from kvscope.tui.screenshots import make_detail_screenshot

    path = os.path.join(os.path.dirname(__file__), "..", "traces", "smollm2-cpu.kvtrace")
    events = list(TraceReader(path))
    assert events[0].config.model == "smollm2-135m"
    outputs = [o.text for e in events if e.type == "step" and e.outputs is not UNSET for o in e.outputs]
    assert outputs and all(o.strip() for o in outputs)
    a, b = (make_detail_screenshot(path, str(tmp_path / f"{n}.svg")) for n in "ab")
    with open(a, encoding="utf-8") as fa, open(b, encoding="utf-8") as fb:
        svg = fa.read()
        assert svg == fb.read()
    assert "COMPLETION" in svg and "PROMPT" in svg


def test_step_events_stream_each_completion_as_it_grows_and_the_reducer_follows():
    from types import SimpleNamespace

    from kvscope.engine.detokenizer import IncrementalDetokenizer
    from kvscope.engine.llm_engine import EVENT_TEXT_CHARS, LLMEngine
    from kvscope.engine.sampling_params import SamplingParams

    tok = WordTokenizer()
    words = "Paris is the capital of France and its largest city".split()
    ids = tok.encode(" ".join(words))
    detok = IncrementalDetokenizer(tok, SamplingParams(max_tokens=20))
    req = SimpleNamespace(req_id=1, finish_reason=None, event_text_chars=0, detokenizer=detok)
    state = TuiState()
    reduce(state, RequestEvent(1, 5, 20, 0, 0.0, prompt_text="Where is Paris?"))
    seen = []
    for step, i in enumerate(ids):
        detok.add([i])
        grown = LLMEngine._text_grown(None, [req])
        ev = StepEvent(step=step, t=step * 0.1, dur=0.05, budget=64, sampled=[1], running=[1],
                       kv=KvCounters(total=8, free=8), text=grown)
        reduce(state, codec.decode(codec.encode(ev)))
        seen.append(state.get(1).output_text)
    assert seen[0] == "Paris" and seen[-1] == " ".join(words), "the text grows step by step, all of it"
    assert all(a == b[:len(a)] for a, b in zip(seen, seen[1:]))
    finish = StepEvent(step=len(ids), t=9.0, dur=0.05, budget=64, kv=KvCounters(total=8, free=8),
                       finished=[Finish(1, 0.05, 1.0, len(ids), "stop")],
                       outputs=[OutputText(1, " ".join(words) + " .")])
    reduce(state, finish)
    assert state.get(1).output_text.endswith("city .")  # the finished text is the whole, final one
    req.event_text_chars = EVENT_TEXT_CHARS  # a runaway completion: the events stop carrying it
    detok.add(tok.encode("more words"))
    assert LLMEngine._text_grown(None, [req]) == []
