"""The kvscope engine: paged KV cache, iteration-level scheduler, model runner.

Names are imported lazily, so pure-Python parts (workload, scheduler) load without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "kvscope.engine.llm",
    "RequestOutput": "kvscope.engine.llm",
    "CompletionOutput": "kvscope.engine.llm",
    "LLMEngine": "kvscope.engine.llm_engine",
    "EngineConfig": "kvscope.engine.config",
    "MODES": "kvscope.engine.config",
    "POLICIES": "kvscope.engine.config",
    "SamplingParams": "kvscope.engine.sampling_params",
    "KvscopeError": "kvscope.errors",
    "RequestRejected": "kvscope.engine.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvscope.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
