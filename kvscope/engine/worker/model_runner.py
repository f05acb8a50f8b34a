"""Runs one packed forward per step over the paged KV cache. Computes; decides nothing.

All scheduled tokens of all sequences go into one row of input ids (varlen
packing, no padding; built by kvscope.engine.worker.inputs). Static mode's padding rows
are computed too, as a padded server would, over a scratch area of the cache that
no request owns. The cache's rows are the pool's blocks, then the null block (the block
manager's ``null_block``, standing in for blocks a sliding window released; only read
at masked positions), then the scratch blocks.
"""

from __future__ import annotations

import torch

from kvscope.engine.worker import attention
from kvscope.engine.kv.block_manager import blocks_needed
from kvscope.engine.cpu.linear import use_amx, use_dpbf16
from kvscope.engine.cpu.threads import StepTuner
from kvscope.engine.cpu.decoder import PagedDecoder
from kvscope.engine.worker.inputs import InputBuilder
from kvscope.engine.worker.kv_sizing import zeroed_cpu_tensor
from kvscope.engine.loader.models import LoadedModel
from kvscope.engine.worker.sampler import Sampler, TokenLogprobs
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.sched.output import SchedulerOutput
from kvscope.kernels import select_attention_ops


class ModelRunner:
    def __init__(self, loaded: LoadedModel, *, device: torch.device, dtype: torch.dtype, num_blocks: int,
                 block_size: int, scratch_tokens: int = 0, seed: int = 0, gguf_weights=None) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_scratch_blocks = blocks_needed(scratch_tokens, block_size)
        rows = num_blocks + 1 + self.num_scratch_blocks  # the pool, the null block, the scratch blocks
        shape = (loaded.num_layers, 2, rows, block_size, loaded.num_kv_heads, loaded.head_dim)
        # On CPU the pool's pages are committed as blocks are first written, not all at start-up.
        self.kv_cache = (zeroed_cpu_tensor(shape, dtype) if device.type == "cpu"
                         else torch.zeros(shape, dtype=dtype, device=device))
        self.ops = select_attention_ops(device.type)
        if self.ops.name == "cpu-paged":  # the CPU kernels are loaded: decode-sized GEMMs on AMX tiles or AVX-512 BF16
            for note in (use_amx(self.model), use_dpbf16(self.model)):
                if note and note not in loaded.linear_note:
                    loaded.linear_note += f"; {note}"
        self.inputs = InputBuilder(block_size, num_blocks + 1, self.num_scratch_blocks, device)
        self.graphs = None  # DecodeGraphs once capture_cuda_graphs() has run (CUDA, not enforce_eager)
        self.step_timer = None  # a StepTimer (step_timer.py) when something measures steps; off by default
        self.sampler = Sampler(seed)
        # of the last run(): the logprobs asked for, and the rows that could not be sampled
        self.logprobs: dict[int, TokenLogprobs] = {}
        self.failures: dict[int, str] = {}
        self.tuner: StepTuner | None = None  # CPU without --cpu-threads: picks the thread count per step
        attention.install(self.model)
        # On a CPU the written-out forward (decoder.py) runs the same operations with far fewer calls;
        # CUDA keeps transformers' forward, which its captured graphs replay.
        # gguf_weights (--quantization gguf, gguf_blocks.py): its linear layers are the GGUF's blocks.
        self.decoder, why = (PagedDecoder.build(self.model, gguf_weights) if device.type == "cpu"
                             else (None, "CUDA graphs"))
        self.forward_name = self.decoder.name if self.decoder is not None else f"transformers ({why})"

    def _forward(self, out: SchedulerOutput) -> torch.Tensor:
        inputs = self.inputs.build(out)
        rows = inputs.sample_rows
        keep = torch.tensor(rows if rows else [0], dtype=torch.long, device=self.device)
        if self.step_timer is not None:
            self.step_timer.forward_begins(out, graph=False)
        if self.decoder is not None:
            return self.decoder.forward(inputs.input_ids, inputs.position_ids, keep, self.kv_cache, inputs.meta,
                                        self.ops)
        ctx = attention.ForwardContext(self.kv_cache, inputs.meta, self.ops)
        with attention.forward_context(ctx):
            return self.model(input_ids=inputs.input_ids, position_ids=inputs.position_ids, use_cache=False,
                              logits_to_keep=keep).logits[0]

    def capture_cuda_graphs(self, max_batch: int, max_model_len: int) -> None:
        """CUDA only: capture decode-step graphs (see cuda_graphs.py); eager if capture fails."""
        from kvscope.engine.worker.cuda_graphs import try_capture

        self.graphs = try_capture(self, max_batch, max_model_len)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, params: dict[int, SamplingParams]) -> dict[int, int]:
        """Compute the step; returns the sampled token of every sequence with sample=True, except the
        rows whose sampling failed (listed in `failures`). `params` may offer `suppressed(req_id)`: the
        token ids that request must not sample this step (min_tokens)."""
        self.sampler.forget(out.finished_req_ids)
        self.logprobs, self.failures = {}, {}
        if out.is_empty:
            return {}
        if self.tuner is not None:
            with self.tuner.step(out):
                return self._run(out, params)
        return self._run(out, params)

    def _run(self, out: SchedulerOutput, params: dict[int, SamplingParams]) -> dict[int, int]:
        timer = self.step_timer
        if self.graphs is not None and self.graphs.can_run(out):
            b = self.graphs.prepare(out)  # a decode-only step: replay the captured forward
            if timer is not None:
                timer.forward_begins(out, graph=True)
            logits = self.graphs.replay(b, len(out.seqs))
        else:
            logits = self._forward(out)
        if timer is not None:
            timer.forward_ends()
        sampled_ids = [s.req_id for s in out.seqs if s.sample]
        if not sampled_ids:
            return {}
        result = self.sampler.sample(logits.float(), sampled_ids, [params[r] for r in sampled_ids],
                                     getattr(params, "suppressed", None))
        self.logprobs, self.failures = result.logprobs, result.failures
        return result.tokens
