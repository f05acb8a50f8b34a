"""`kvscope diagnose` of a recorded vLLM: the flags for what its metrics do not say (docs/DIAGNOSE.md,
"A recorded vLLM"), and the dispatch of a recording to kvscope.vllm.diagnose.run."""

from __future__ import annotations

import argparse

from kvscope.cli.common import float_type, int_type

def _vllm_policy(text: str) -> str:
    """vLLM's own names only: this flag carries vLLM's vocabulary, never kvscope's `--policy module:Class`."""
    from kvscope.vllm.diagnose.signals import vllm_scheduling_policy
    from kvscope.errors import KvscopeError

    try:
        return vllm_scheduling_policy(text)
    except KvscopeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# (flag, VllmFlags field, argparse type, help)
VLLM_FLAGS = (
    ("--vllm-max-num-seqs", "max_num_seqs", int_type(1), "the vLLM's --max-num-seqs (else inferred from the "
     "running count)"),
    ("--vllm-max-num-batched-tokens", "max_num_batched_tokens", int_type(1),
     "the vLLM's --max-num-batched-tokens (else inferred from vllm:iteration_tokens_total)"),
    ("--vllm-gpu-memory-utilization", "gpu_memory_utilization", float_type(0.0, 1.0, positive=True),
     "the vLLM's --gpu-memory-utilization (else from vllm:cache_config_info)"),
    ("--vllm-kv-cache-dtype", "kv_cache_dtype", str, "the vLLM's --kv-cache-dtype (else from vllm:cache_config_info)"),
    ("--vllm-tensor-parallel-size", "tensor_parallel_size", int_type(1), "the vLLM's --tensor-parallel-size "
     "(else 1)"),
    ("--vllm-scheduling-policy", "scheduling_policy", lambda text: _vllm_policy(text),
     "the vLLM's --scheduling-policy: fcfs or priority (else fcfs)"),
)
SWITCHES = (("enable-chunked-prefill", "chunked prefill (else vLLM V1's default: on)"),
            ("enable-prefix-caching", "prefix caching (else from vllm:cache_config_info)"))


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("a recorded vLLM (what its metrics do not say; --model and --gpu enable the what-if)")
    for flag, field, kind, text in VLLM_FLAGS:
        g.add_argument(flag, dest="vllm_" + field, type=kind, default=None, help=text)
    for name, text in SWITCHES:
        dest = "vllm_" + name.replace("-", "_")
        g.add_argument(f"--vllm-{name}", dest=dest, action="store_const", const=True, default=None,
                       help=f"the vLLM ran with {text}")
        g.add_argument(f"--vllm-no-{name}", dest=dest, action="store_const", const=False, help="... or without")


def vllm_flags(args: argparse.Namespace):
    from kvscope.vllm.diagnose.signals import VllmFlags

    flags = VllmFlags(model=getattr(args, "model", None), gpu=getattr(args, "gpu", None),
                      enable_chunked_prefill=getattr(args, "vllm_enable_chunked_prefill", None),
                      enable_prefix_caching=getattr(args, "vllm_enable_prefix_caching", None))
    for _, field, _, _ in VLLM_FLAGS:
        setattr(flags, field, getattr(args, "vllm_" + field, None))
    return flags


def diagnose_file(args: argparse.Namespace, what_if: bool):
    """A kvscope engine trace, or a recorded vLLM with the --vllm-* flags."""
    from kvscope.analysis.diagnose import diagnose_trace
    from kvscope.traces.reader import TraceReader

    if TraceReader(args.file).vllm_recording:
        from kvscope.vllm.diagnose.run import diagnose_vllm_trace

        return diagnose_vllm_trace(args.file, flags=vllm_flags(args), window=args.window, what_if=what_if)
    from kvscope.cli.common import slo_from_args

    return diagnose_trace(args.file, window=args.window, what_if=what_if, slo=slo_from_args(args) or None)
