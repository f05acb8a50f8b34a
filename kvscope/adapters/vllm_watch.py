"""``--scheduler-cls kvscope.adapters.vllm_watch.WatchedScheduler``: the watched scheduler (kvscope.vllm.inproc.watched)."""

from kvscope.vllm.inproc.watched import WatchedAsyncScheduler, WatchedScheduler

__all__ = ["WatchedScheduler", "WatchedAsyncScheduler"]
