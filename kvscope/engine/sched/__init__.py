"""The scheduler: which tokens of which requests run each step, and the plain output it hands the worker. No torch.

``--scheduler kvscope`` is kvscope's own (scheduler.py). ``--scheduler vllm`` is vLLM's V1 scheduler,
wrapped in kvscope.vllm.inproc: the engine names it by a dotted path, as vLLM names a scheduler class
(``--scheduler-cls``), so the engine package imports nothing of kvscope.vllm, which sits above it.
"""

from __future__ import annotations

import importlib
from typing import Any

# --scheduler name -> "module:class" of a scheduler built as (config, num_blocks, max_model_len)
EXTERNAL_SCHEDULERS = {"vllm": "kvscope.vllm.inproc.scheduler:VllmScheduler"}


def external_scheduler(name: str) -> Any:
    """The class behind ``--scheduler NAME`` for a scheduler outside the engine package."""
    module, _, cls = EXTERNAL_SCHEDULERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
