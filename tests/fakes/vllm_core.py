"""vLLM's scheduler as vLLM's engine core builds and drives it, on this CPU, without a model.

``build(...)`` makes a VllmConfig (a local config directory, skip_tokenizer_init, a CPU device)
naming ``scheduler_cls``, resolves the class as vllm/v1/engine/core.py does
(``scheduler_config.get_scheduler_cls()``) and constructs it with the engine core's arguments over a
KVCacheConfig of ``num_blocks`` blocks. ``Core`` then plays the engine core's loop: ``step()``
(schedule, run, update) as EngineCore.step does, or, with ``batch_queue=2`` (async scheduling),
schedule the next step before the previous one's output is applied, as step_with_batch_queue does.
The "model" samples a fixed token for every request that finished its prompt.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from collections import deque

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000,
          "max_position_embeddings": 8192, "torch_dtype": "float32"}


def model_dir() -> str:
    d = os.path.join(tempfile.gettempdir(), "kvscope-vllm-core-model")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "config.json")
    if not os.path.exists(path):
        with open(path, "w") as f:
            json.dump(CONFIG, f)
    return d


def build(scheduler_cls: str | None, *, num_blocks: int = 64, block_size: int = 16, max_num_seqs: int = 8,
          max_num_batched_tokens: int = 256, prefix_caching: bool = True, async_scheduling: bool = False,
          max_model_len: int = 4096, policy: str = "fcfs", long_prefill_token_threshold: int = 0):
    """vLLM's scheduler (``scheduler_cls`` by qualified name, None: vLLM's default) as its engine core makes it."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    mc = ModelConfig(model=model_dir(), skip_tokenizer_init=True, max_model_len=max_model_len, dtype="float32")
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=max_model_len, is_encoder_decoder=False, enable_chunked_prefill=True,
                         scheduler_cls=scheduler_cls, async_scheduling=async_scheduling, policy=policy,
                         long_prefill_token_threshold=long_prefill_token_threshold)
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, device_config=DeviceConfig(device="cpu"))
    vc.cache_config.num_gpu_blocks = num_blocks  # what the engine core sets after profiling
    kc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8,
                                                        dtype=torch.float32))])
    cls = vc.scheduler_config.get_scheduler_cls()  # vllm/v1/engine/core.py
    return cls(vllm_config=vc, kv_cache_config=kc, structured_output_manager=StructuredOutputManager(vc),
               include_finished_set=False, log_stats=True, block_size=block_size, hash_block_size=block_size)


class Core:
    """The engine core's loop over a scheduler; ``on_step(core)`` runs after every update."""

    def __init__(self, sched, *, batch_queue: int = 1, seed: int = 0) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        self.sched = sched
        self.batch_queue = batch_queue
        self.rng = random.Random(seed)
        self.next_id = 0
        self.inflight: deque = deque()
        hash_fn = get_hash_fn_by_name(sched.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(sched.block_size, hash_fn)
        self.finished: list[str] = []

    def add(self, prompt: list[int], max_tokens: int, priority: int = 0) -> str:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        rid = f"cmpl-{self.next_id}"
        self.next_id += 1
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                      arrival_time=time.time(), priority=priority, block_hasher=self.hasher)
        self.sched.add_request(req)
        return rid

    def abort(self, rid: str) -> None:
        from vllm.v1.request import RequestStatus

        self.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    def _schedule(self) -> None:
        out = self.sched.schedule()
        # which requests sample a token (the runner discards a partial prefill's), fixed at schedule time
        samples = {r: not self.sched.requests[r].is_prefill_chunk for r in out.num_scheduled_tokens}
        self.inflight.append((out, samples))

    def _update(self) -> None:
        from vllm.v1.outputs import ModelRunnerOutput

        out, samples = self.inflight.popleft()
        ids = list(out.num_scheduled_tokens)
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[7] if samples[r] else [] for r in ids])
        for outs in self.sched.update_from_output(out, mro).values():
            self.finished += [o.request_id for o in outs.outputs if o.finish_reason is not None]

    def step(self) -> None:
        """One engine-core iteration, as EngineCore.step (``batch_queue=1``) or step_with_batch_queue does."""
        if self.sched.has_requests():
            self._schedule()
            executed = self.inflight[-1][0].total_num_scheduled_tokens > 0
            if len(self.inflight) < self.batch_queue and (executed or self.sched.has_requests()):
                return  # the queue has room: schedule the next batch before this one's output is back
        elif not self.inflight:
            return
        self._update()

    def busy(self) -> bool:
        return bool(self.inflight) or self.sched.has_requests()
