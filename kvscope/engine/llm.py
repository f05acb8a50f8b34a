"""The offline API users know from vLLM and nano-vllm: LLM(...).generate(prompts, params)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvscope.engine.config import EngineConfig
from kvscope.engine.errors import RequestRejected
from kvscope.engine.llm_engine import EventSink, LLMEngine
from kvscope.engine.request import Request, RequestMetrics
from kvscope.engine.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class RequestOutput:
    req_id: int | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop", "length", "max_model_len", "error", or "rejected"
    metrics: RequestMetrics | None
    error: str | None = None  # why the request was rejected, or (finish reason "error") why it failed
    logprobs: list | None = None  # a TokenLogprobs per output token, when SamplingParams.logprobs is set


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
        for i, (prompt, p, prio) in enumerate(zip(prompts, params_list, priorities)):
            try:
                slot_of[self.engine.add_request(prompt, p, prio)] = i
            except RequestRejected as e:
                outputs[i] = RequestOutput(None, [], [], "", "rejected", None, error=str(e))
        while self.engine.has_unfinished():
            for req in self.engine.step():
                outputs[slot_of[req.req_id]] = self._output(req)
        return outputs  # type: ignore[return-value]

    def _output(self, req: Request) -> RequestOutput:
        text = req.detokenizer.text if req.detokenizer is not None else ""  # kvscope.engine.detokenizer
        return RequestOutput(req.req_id, list(req.prompt_token_ids), req.output_token_ids, text, req.finish_reason,
                             req.metrics(), error=req.error, logprobs=req.logprobs)
