"""The offline API users know from vLLM and nano-vllm: LLM(...).generate(prompts, params)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from kvscope.engine import outputs
from kvscope.engine.config import EngineConfig
from kvscope.engine.errors import RequestRejected
from kvscope.engine.llm_engine import EventSink, LLMEngine
from kvscope.engine.request import Request, RequestMetrics
from kvscope.engine.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    """One of a prompt's SamplingParams.n sampled sequences (vLLM's name)."""

    index: int
    req_id: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: RequestMetrics
    error: str | None = None
    logprobs: list | None = None


@dataclass
class RequestOutput:
    req_id: int | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # the first sequence's (outputs[0]); every sequence is in `outputs`
    text: str
    finish_reason: str | None  # "stop", "length", "max_model_len", "error", or "rejected"
    metrics: RequestMetrics | None
    error: str | None = None  # why the request was rejected, or (finish reason "error") why it failed
    logprobs: list | None = None  # a TokenLogprobs per output token, when SamplingParams.logprobs is set
    outputs: list[CompletionOutput] = field(default_factory=list)  # n of them, by index


class LLM:
    def __init__(self, model: str = "tiny", *, sink: EventSink | None = None, **settings) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **settings), sink=sink)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion. A rejected prompt gets an output with `error` set; the rest are served."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        params = params or SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(params_list) != len(prompts) or len(priorities) != len(prompts):
            raise ValueError("params and priority must be given once, or once per prompt")
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        slot_of: dict[int, int] = {}
        samples: dict[int, list[CompletionOutput]] = {}  # first sequence's id -> finished sequences
        for i, (prompt, p, prio) in enumerate(zip(prompts, params_list, priorities)):
            try:
                req_id = self.engine.add_request(prompt, p, prio)
                slot_of[req_id] = i
                samples[req_id] = []
            except RequestRejected as e:
                outputs[i] = RequestOutput(None, [], [], "", "rejected", None, error=str(e))
        while self.engine.has_unfinished():
            for req in self.engine.step():
                first = req.req_id if req.fork_of is None else req.fork_of
                done = samples[first]
                done.append(self._completion(req))
                if len(done) == params_list[slot_of[first]].n:
                    outputs[slot_of[first]] = self._output(first, req.prompt_token_ids, done)
        return outputs  # type: ignore[return-value]

    def _completion(self, req: Request) -> CompletionOutput:
        text = req.detokenizer.text if req.detokenizer is not None else ""  # kvscope.engine.detokenizer
        reason, error = outputs.ending(req)  # after the read: a fault it met is an error
        return CompletionOutput(req.sample_index, req.req_id, req.output_token_ids, text, reason,
                                req.metrics(), error=error, logprobs=req.logprobs)

    @staticmethod
    def _output(req_id: int, prompt: list[int], done: list[CompletionOutput]) -> RequestOutput:
        done.sort(key=lambda c: c.index)
        first = done[0]
        return RequestOutput(req_id, list(prompt), first.token_ids, first.text, first.finish_reason, first.metrics,
                             error=first.error, logprobs=first.logprobs, outputs=done)
