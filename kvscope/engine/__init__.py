"""The kvscope engine: paged KV cache, iteration-level scheduler, model runner."""

from kvscope.engine.config import MODES, POLICIES, EngineConfig
from kvscope.engine.errors import KvscopeError, RequestRejected
from kvscope.engine.llm import LLM, RequestOutput
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "KvscopeError",
           "RequestRejected", "MODES", "POLICIES"]
