"""``hello.config``: what an engine runs, as the engine's own fields plus one optional
section per backend.

In Python an :class:`EngineInfo` holds the settings every engine has (model, mode,
policy, the KV pool, budgets, preemption...) and a section for what only one backend
reports: ``cpu`` (the model backend on a CPU), ``cuda`` (on a GPU), ``sim`` (the sim's
catalog GPU, model shape and efficiencies) and ``vllm`` (a recorded vLLM: what was
watched). A section is ``None`` when its backend reported nothing.

On the wire hello.config stays the one flat map of protocol v1 (docs/PROTOCOL.md), so
every trace ever written reads as before: :data:`WIRE_KEYS` names each key, in the
order an engine sends them, and the section field it lands in. The codec decodes the
flat map (:class:`EngineInfoWire`) and calls :func:`from_wire`; it encodes with
:func:`to_wire`. A section's fields are sent only when set (UNSET: absent from the map).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from .types import INT64_MAX, Count, Float, Int, Name, Text

PositiveInt = Annotated[int, Meta(ge=1, le=INT64_MAX)]
Efficiencies = Annotated[dict[Name, Float], Meta(max_length=64)]


class CpuInfo(Struct, kw_only=True):
    """The model backend on a CPU."""

    kv_cache_space: Float | None | UnsetType = UNSET  # GiB asked for the KV cache (None: sized from memory)
    threads: Count | None | UnsetType = UNSET  # torch threads, as chosen


class CudaInfo(Struct, kw_only=True):
    """The model backend on a GPU."""

    device_name: Text | UnsetType = UNSET  # the GPU's name (lets calibrate find it in the sim catalog)


class SimInfo(Struct, kw_only=True):
    """The sim backend: what it models."""

    gpu: Name | UnsetType = UNSET  # catalog GPU
    tp: Count | UnsetType = UNSET  # tensor-parallel degree
    kv_cache_dtype: Name | UnsetType = UNSET
    efficiency: Efficiencies | None | UnsetType = UNSET  # fitted efficiencies
    pace: Float | None | UnsetType = UNSET  # virtual time per wall second cap
    model: Name | UnsetType = UNSET  # catalog model shape
    weight_dtype: Name | UnsetType = UNSET


class VllmInfo(Struct, kw_only=True):
    """A recorded vLLM (backend "vllm"): what was watched."""

    url: Text | UnsetType = UNSET
    kv_events: Text | UnsetType = UNSET
    kv_replay: Text | UnsetType = UNSET
    interval: Float | UnsetType = UNSET  # seconds between scrapes


# An SLO target in milliseconds: finite, >= 0, at most about 11.6 days (kvscope.goodput.MAX_SLO_MS;
# the writer refuses what this refuses).
SloMs = Annotated[float, Meta(ge=0.0, le=1e9)]


class SloInfo(Struct, kw_only=True):
    """The run's service-level objectives (`--slo ttft:MS tpot:MS e2el:MS`, vLLM's --goodput keys);
    added within v1: older streams have none (docs/GOODPUT.md)."""

    ttft_ms: SloMs | UnsetType = UNSET
    tpot_ms: SloMs | UnsetType = UNSET
    e2el_ms: SloMs | UnsetType = UNSET


SECTIONS: dict[str, type[Struct]] = {"cpu": CpuInfo, "cuda": CudaInfo, "sim": SimInfo, "vllm": VllmInfo,
                                     "slo": SloInfo}


class EngineInfo(Struct, kw_only=True):
    """The engine's own settings, then one optional section per backend.

    Fields a stream leaves out decode to their defaults ("" / None: not reported).
    """

    model: Text = ""
    device: Name = ""
    dtype: Name = ""
    quantization: Name | UnsetType = UNSET  # "gguf": linear layers on the GGUF file's own blocks (--quantization)
    backend: Name = ""  # "model", "sim" or "vllm"
    mode: Name = ""  # naive, static, continuous, chunked
    policy: Text = ""
    scheduler: Name | UnsetType = UNSET  # "kvscope", or "vllm": vLLM's own V1 scheduler decides (--scheduler vllm)
    vllm_version: Name | UnsetType = UNSET  # the vLLM whose scheduler ran (scheduler "vllm"), or the vLLM watched
    engine: Name | UnsetType = UNSET  # "kvscope" or "vllm": whose engine loop ran (absent: see engine_name())
    block_size: PositiveInt = 16
    num_blocks: Count | None = None  # block ids are in [0, num_blocks)
    null_block: Count | UnsetType = UNSET  # an id that never holds KV and is never listed (vLLM's block 0)
    max_num_seqs: Count | None = None
    max_num_batched_tokens: Count | None = None
    max_model_len: Count | None = None
    seed: Int | None = None
    prefix_caching: bool = False
    preemption: Name = ""  # "recompute" or "swap"
    swap_space: Float | None = None  # GiB of CPU memory for swapped-out KV
    enforce_eager: bool = False
    gpu_memory_utilization: Float | None = None
    kv_cache_bytes: Count | UnsetType = UNSET  # the KV cache's size as chosen at start-up
    attention: Name = ""  # the attention implementation
    cpu: CpuInfo | None = None
    cuda: CudaInfo | None = None
    sim: SimInfo | None = None
    vllm: VllmInfo | None = None
    slo: SloInfo | None = None

    def __post_init__(self) -> None:
        for name in SECTIONS:  # a section that reports nothing is no section (the wire cannot tell them apart)
            section = getattr(self, name)
            if section is not None and all(getattr(section, f) is UNSET for f in section.__struct_fields__):
                setattr(self, name, None)

    def as_dict(self) -> dict:
        """The flat map hello.config is on the wire (the keys that are set), for display and tools."""
        return to_wire(self)


# (wire key, section or None, field): every key of the flat map, in the order an engine
# sends them. Two keys only decode: "max_waiting" was documented but never sent, and
# "preemption_mode" repeated "preemption" (older traces carry both).
WIRE_KEYS: tuple[tuple[str, str | None, str], ...] = (
    ("model", None, "model"),
    ("device", None, "device"),
    ("dtype", None, "dtype"),
    ("quantization", None, "quantization"),
    ("backend", None, "backend"),
    ("mode", None, "mode"),
    ("policy", None, "policy"),
    ("scheduler", None, "scheduler"),
    ("vllm_version", None, "vllm_version"),
    ("engine", None, "engine"),
    ("block_size", None, "block_size"),
    ("num_blocks", None, "num_blocks"),
    ("null_block", None, "null_block"),
    ("max_num_seqs", None, "max_num_seqs"),
    ("max_num_batched_tokens", None, "max_num_batched_tokens"),
    ("max_model_len", None, "max_model_len"),
    ("seed", None, "seed"),
    ("prefix_caching", None, "prefix_caching"),
    ("preemption", None, "preemption"),
    ("swap_space", None, "swap_space"),
    ("kv_cache_space", "cpu", "kv_cache_space"),
    ("cpu_threads", "cpu", "threads"),
    ("enforce_eager", None, "enforce_eager"),
    ("gpu_memory_utilization", None, "gpu_memory_utilization"),
    ("gpu", "sim", "gpu"),
    ("tp", "sim", "tp"),
    ("kv_cache_dtype", "sim", "kv_cache_dtype"),
    ("sim_efficiency", "sim", "efficiency"),
    ("sim_pace", "sim", "pace"),
    ("kv_cache_bytes", None, "kv_cache_bytes"),
    ("attention", None, "attention"),
    ("sim_model", "sim", "model"),
    ("weight_dtype", "sim", "weight_dtype"),
    ("device_name", "cuda", "device_name"),
    ("vllm_url", "vllm", "url"),
    ("vllm_kv_events", "vllm", "kv_events"),
    ("vllm_kv_replay", "vllm", "kv_replay"),
    ("vllm_interval", "vllm", "interval"),
    ("slo_ttft_ms", "slo", "ttft_ms"),
    ("slo_tpot_ms", "slo", "tpot_ms"),
    ("slo_e2el_ms", "slo", "e2el_ms"),
)
WIRE_ORDER = tuple(k for k, _, _ in WIRE_KEYS)
_WHERE = {k: (s, f) for k, s, f in WIRE_KEYS}


def _wire_struct() -> type[Struct]:
    """The flat map as a Struct (the codec decodes hello.config into it): each key typed as
    its field; a section's keys, and the two legacy ones, default to UNSET (absent)."""
    fields = []
    for key, section, name in WIRE_KEYS:
        owner = SECTIONS[section] if section else EngineInfo
        f = next(f for f in msgspec.structs.fields(owner) if f.name == name)
        fields.append((key, f.type, f.default))
    fields.append(("preemption_mode", Name | UnsetType, UNSET))
    fields.append(("max_waiting", Count | None | UnsetType, UNSET))
    return msgspec.defstruct("EngineInfoWire", fields, kw_only=True)


EngineInfoWire = _wire_struct()


def from_flat(flat: dict) -> EngineInfo:
    """An EngineInfo from flat keys (a wire map already typed, or an engine's config dict).
    Keys it does not know are dropped."""
    core: dict = {}
    sections: dict[str, dict] = {}
    for key, value in flat.items():
        if value is UNSET or key not in _WHERE:
            continue
        section, name = _WHERE[key]
        (sections.setdefault(section, {}) if section else core)[name] = value
    if not core.get("preemption") and flat.get("preemption_mode") not in (None, UNSET, ""):
        core["preemption"] = flat["preemption_mode"]  # an older stream's second name for it
    for section, values in sections.items():
        core[section] = SECTIONS[section](**values)
    return EngineInfo(**core)


def from_wire(w) -> EngineInfo:
    return from_flat({k: getattr(w, k) for k in w.__struct_fields__})


def to_wire(info: EngineInfo) -> dict:
    """The flat map, in WIRE_ORDER, with the keys that are set."""
    out = {}
    for key, section, name in WIRE_KEYS:
        owner = getattr(info, section) if section else info
        if owner is None:
            continue
        value = getattr(owner, name)
        if value is not UNSET:
            out[key] = value
    return out


VLLM_BACKENDS = ("vllm", "vllm-scheduler", "vllm-plugin")  # a real vLLM: recorded from outside, its scheduler, its stats


def engine_name(info: EngineInfo) -> str:
    """Whose engine loop ran: the ``engine`` key, or for a stream from before it, what the backend implies."""
    if isinstance(info.engine, str) and info.engine:
        return info.engine
    return "vllm" if info.backend in VLLM_BACKENDS else ("kvscope" if info.backend else "")


_VLLM_HOW = {"vllm-scheduler": "its scheduler watched from inside", "vllm-plugin": "its stat logger",
             "vllm": "watched from outside"}


def engine_label(info: EngineInfo) -> str:
    """One line naming the engine, the scheduler that decided, vLLM's version and the device, e.g.
    ``vLLM 0.32.0 (its scheduler watched from inside) on cpu`` or ``kvscope with vLLM 0.33.0's scheduler on cpu``."""
    version = info.vllm_version if isinstance(info.vllm_version, str) and info.vllm_version else ""
    vllm = f"vLLM {version}" if version else "vLLM"
    engine = engine_name(info)
    if engine == "vllm":
        how = _VLLM_HOW.get(info.backend, "")
        head = f"{vllm} ({how})" if how else vllm
    elif engine == "kvscope":
        if info.scheduler == "vllm":
            head = f"kvscope with {vllm}'s scheduler"
        else:
            head = "kvscope" + (f" ({info.mode} scheduling)" if info.mode else "")
        if info.backend == "sim":
            head += ", sim backend"
    else:
        head = "engine not named"
    return head + (f" on {info.device}" if info.device else "")


def usable_blocks(info: EngineInfo) -> int | None:
    """Blocks that can hold KV (``kv.total``): ``num_blocks`` less the null block, if any; None if unknown."""
    if info.num_blocks is None:
        return None
    return max(0, info.num_blocks - (0 if info.null_block is UNSET else 1))


def engine_info(config: dict | EngineInfo) -> EngineInfo:
    """An EngineInfo from an engine's flat config dict (keys it does not know are dropped)."""
    return config if isinstance(config, EngineInfo) else from_flat(config)
