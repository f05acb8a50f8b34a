"""kvscope: a small, real LLM inference engine whose scheduler you can watch."""

from kvscope import cpu_isa as _cpu_isa

_cpu_isa.apply()  # an ISA cap reaches oneDNN and ATen before they run a kernel (docs/CPU.md)
