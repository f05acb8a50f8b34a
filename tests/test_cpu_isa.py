"""One ISA cap for oneDNN, ATen and kvscope's own probes (kvscope/cpu_isa.py): a bigger CPU behaves as a smaller
one, so each CPU kind's paths can be run on any of them (docs/CPU.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvscope import cpu_isa
from kvscope.kernels.cpu import library as cpu_attention

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AVX512_BF16_CPU = frozenset({"sse4_1", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                             "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "aes"})
HERE = cpu_isa.read_cpu_flags() or frozenset()


def test_kvscope_s_own_switch_wins_over_onednn_s_and_default_means_none():
    assert cpu_isa.cap_name({}) is None
    assert cpu_isa.cap_name({"ONEDNN_MAX_CPU_ISA": "avx2"}) == "AVX2"
    assert cpu_isa.cap_name({"ONEDNN_MAX_CPU_ISA": "AVX2", "KVSCOPE_MAX_CPU_ISA": "AVX512_CORE"}) == "AVX512_CORE"
    assert cpu_isa.cap_name({"KVSCOPE_MAX_CPU_ISA": " default "}) is None
    with pytest.raises(cpu_isa.IsaCapError, match=r"KVSCOPE_MAX_CPU_ISA='AVX3' is not one of oneDNN's ISA names: "
                                                  r"SSE41, AVX, AVX2, .* or DEFAULT"):
        cpu_isa.cap_name({"KVSCOPE_MAX_CPU_ISA": "AVX3"})


def test_a_cap_hides_the_flags_above_it_and_keeps_the_rest():
    avx2 = cpu_isa.cap_flags(AVX512_BF16_CPU, "AVX2")
    assert avx2 == {"sse4_1", "avx", "avx2", "fma", "f16c", "aes"}
    core = cpu_isa.cap_flags(AVX512_BF16_CPU, "AVX512_CORE")
    assert "avx512bw" in core and "avx512_vnni" not in core and "avx512_bf16" not in core and "amx_bf16" not in core
    bf16 = cpu_isa.cap_flags(AVX512_BF16_CPU, "AVX512_CORE_BF16")
    assert "avx512_bf16" in bf16 and not bf16 & {"amx_tile", "amx_bf16", "amx_int8"}
    assert cpu_isa.cap_flags(AVX512_BF16_CPU, "AVX512_CORE_AMX") == AVX512_BF16_CPU


@pytest.mark.parametrize("cap", cpu_isa.NAMES)
def test_the_compiler_takes_every_cap_and_defines_nothing_above_it(cap):
    """A switch g++ refused would send the kernels' build to its generic flag set: every one must be accepted, and
    the macros the kernels test (__AVX512F__, __AVX512BF16__, __AMX_TILE__) must follow the cap."""
    flags = ["-march=native", *cpu_isa.gcc_flags(cap)]
    done = subprocess.run(["g++", *flags, "-dM", "-E", "-x", "c++", "-"], input="", capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    macros = done.stdout
    if cpu_isa.below("AVX512_CORE", cap):
        assert "__AVX512F__" not in macros
    if cpu_isa.below("AVX512_CORE_BF16", cap):
        assert "__AVX512BF16__" not in macros
    if cpu_isa.below("AVX512_CORE_AMX", cap):
        assert "__AMX_TILE__" not in macros
    if "avx2" in HERE and not cpu_isa.below("AVX2", cap):
        assert "__AVX2__" in macros, "a cap keeps what is at or below it"


def test_the_cap_is_part_of_the_kernels_build_key(monkeypatch):
    monkeypatch.delenv(cpu_isa.ENV, raising=False)
    monkeypatch.delenv(cpu_isa.ONEDNN_ENV, raising=False)
    plain = cpu_attention.flag_sets()
    monkeypatch.setenv(cpu_isa.ONEDNN_ENV, "AVX2")
    capped = cpu_attention.flag_sets()
    assert capped[0] == plain[0] + cpu_isa.gcc_flags("AVX2") and "-mno-avx512f" in capped[0]
    assert capped[-1] == plain[-1] == ["-O3", "-fopenmp"], "the generic set has nothing to cap"
    assert cpu_attention.build_dir(capped[0]) != cpu_attention.build_dir(plain[0])


def _run_capped(code: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in (cpu_isa.ENV, cpu_isa.ONEDNN_ENV, cpu_isa.ATEN_ENV)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                          env={**clean, "PYTHONPATH": REPO, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()


@pytest.mark.skipif("avx2" not in HERE, reason="needs a CPU with AVX2 to cap down to it")
def test_kvscope_s_switch_reaches_onednn_aten_and_every_probe():
    code = ("import os, torch, kvscope\n"
            "from kvscope.engine.cpu import dtype as cpu_dtype, linear as cpu_linear\n"
            "print(os.environ['ONEDNN_MAX_CPU_ISA']); print(torch.backends.cpu.get_cpu_capability())\n"
            "print(cpu_dtype.auto_cpu_dtype().reason)\n"
            "print(cpu_linear.packing_unavailable(torch.bfloat16)); print(cpu_linear.packing_unavailable(torch.float32))\n"
            "print(cpu_linear.amx_unavailable()); print(cpu_linear.dpbf16_unavailable())\n")
    onednn, aten, dtype_reason, bf16, f32, amx, dpbf16 = _run_capped(code, KVSCOPE_MAX_CPU_ISA="AVX2")
    assert (onednn, aten) == ("AVX2", "AVX2")
    assert dtype_reason.startswith("auto: this CPU has neither amx_bf16 nor avx512_bf16 under KVSCOPE_MAX_CPU_ISA=AVX2")
    assert "avx512bw, avx512vl and avx512dq" in bf16, "oneDNN itself refuses bf16 weights, as on an AVX2-only CPU"
    assert f32 == "None", "float32 weights are packed on every x86 CPU"
    assert amx == dpbf16 == "capped by KVSCOPE_MAX_CPU_ISA=AVX2"


def test_a_user_s_own_onednn_and_aten_settings_are_left_alone():
    env = {cpu_isa.ENV: "AVX2", cpu_isa.ONEDNN_ENV: "AVX512_CORE", cpu_isa.ATEN_ENV: "default"}
    cpu_isa.apply(env)
    assert env == {cpu_isa.ENV: "AVX2", cpu_isa.ONEDNN_ENV: "AVX512_CORE", cpu_isa.ATEN_ENV: "default"}
    env = {cpu_isa.ONEDNN_ENV: "AVX512_CORE_BF16"}
    cpu_isa.apply(env)
    assert env == {cpu_isa.ONEDNN_ENV: "AVX512_CORE_BF16"}, "ATen's AVX-512 kernels stay above AVX-512"
    env = {cpu_isa.ENV: "nonsense"}
    cpu_isa.apply(env)
    assert env == {cpu_isa.ENV: "nonsense"}, "a bad name changes nothing"


def test_a_bad_name_is_one_line_on_import_and_caps_nothing():
    lines = _run_capped("import kvscope; from kvscope import cpu_isa; print(cpu_isa.describe())",
                        KVSCOPE_MAX_CPU_ISA="avx-512")
    assert lines == ["ignored: KVSCOPE_MAX_CPU_ISA='avx-512' is not one of oneDNN's ISA names: "
                     + ", ".join(cpu_isa.NAMES) + " or DEFAULT"]
    done = subprocess.run([sys.executable, "-c", "import kvscope"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO, cpu_isa.ENV: "avx-512"})
    assert done.returncode == 0
    assert done.stderr.strip().splitlines() == [
        "kvscope: KVSCOPE_MAX_CPU_ISA='avx-512' is not one of oneDNN's ISA names: " + ", ".join(cpu_isa.NAMES)
        + " or DEFAULT; no cap applied"]
