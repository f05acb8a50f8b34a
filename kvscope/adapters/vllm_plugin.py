"""The stat-logger plugin under the entry point an older install registered (kvscope.vllm.inproc.plugin)."""

from kvscope.vllm.inproc.plugin import KvscopeStatLogger

__all__ = ["KvscopeStatLogger"]
