"""Dotted paths users type into vLLM, kept where they were: ``--scheduler-cls
kvscope.adapters.vllm_watch.WatchedScheduler`` and the stat-logger plugin. The code lives in kvscope.vllm."""
