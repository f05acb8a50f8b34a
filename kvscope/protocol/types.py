"""The schema's field types: every limit the decoder enforces is part of a type here.

``kvscope.protocol.events`` (the events), ``engine_info`` (hello.config) and
``vllm_watched`` (a recorded vLLM) build their Structs from these; msgspec checks each
bound while decoding.
"""

from typing import Annotated, ClassVar

from msgspec import Meta, Struct

MAX_LIST_LEN = 1 << 20  # any array (block lists of a large KV pool fit)
MAX_NAME_LEN = 1024  # reason / mode / name strings
MAX_TEXT_LEN = 64 << 10  # free text (a model path)
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
FLOAT_MAX = 1.7976931348623157e308

Int = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]  # request ids, steps, priorities
Count = Annotated[int, Meta(ge=0, le=INT64_MAX)]  # counts, lengths, block ids
Float = Annotated[float, Meta(ge=-FLOAT_MAX, le=FLOAT_MAX)]  # finite (NaN fails both bounds)
Name = Annotated[str, Meta(max_length=MAX_NAME_LEN)]
Text = Annotated[str, Meta(max_length=MAX_TEXT_LEN)]
IntList = Annotated[list[Int], Meta(max_length=MAX_LIST_LEN)]
CountList = Annotated[list[Count], Meta(max_length=MAX_LIST_LEN)]


def list_of(t):
    """A list of ``t``, capped at MAX_LIST_LEN items."""
    return Annotated[list[t], Meta(max_length=MAX_LIST_LEN)]


class ProtocolEvent(Struct, tag_field="type"):
    """A top-level event: a msgpack map whose ``type`` is the tag its class states once
    (``class StepEvent(ProtocolEvent, tag="step")``); ``cls.type`` and the registry
    (``events.EVENT_TYPES``) derive from the one union of events."""

    type: ClassVar[str]
