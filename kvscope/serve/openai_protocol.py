"""OpenAI request bodies (msgspec Structs), their checks, and the response and error shapes.

Only what kvscope can honour is accepted: one prompt, one choice (n=1), no
logprobs, penalties, tools or echo. Anything else is refused with a 400 that
names the parameter, never silently ignored. docs/HTTP.md lists it all.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from kvscope.engine.sampling_params import SamplingParams

MAX_BODY_BYTES = 4 << 20  # a request body larger than this is refused (413)
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_STOP_CHARS = 256
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; accepted, usage still comes once at the end


class _Sampling(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension; -1 or 0 disable it
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension
    priority: int = 0  # vLLM extension: lower is served first
    user: str | None = None  # accepted and ignored, as OpenAI logs it
    # refused unless left at their defaults (kvscope cannot honour them)
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_logprobs: int | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Any  # str, [int], [str] or [[int]] with one prompt: checked in prompt_of()
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class Message(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(_Sampling, kw_only=True):
    messages: list[Message]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


def decode_body(body: bytes, kind: type) -> Any:
    """JSON -> struct, or an ApiError naming the field that is missing or of the wrong type."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        text = str(e)
        param = text.rsplit("at `$.", 1)[1].rstrip("`").split("[")[0].split(".")[0] if "at `$." in text else None
        if param is None and "missing required field" in text:
            param = text.split("`")[1] if "`" in text else None
        raise ApiError(400, f"invalid request: {text}", param=param) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"invalid JSON body: {e}") from None


def _refuse(req: _Sampling, names: dict[str, Any]) -> None:
    for name, default in names.items():
        value = getattr(req, name)
        if value is not None and value != default:
            raise ApiError(400, f"{name} is not supported by kvscope (got {value!r})", param=name)


def sampling_params(req: _Sampling, max_tokens: int | None, default_max_tokens: int) -> SamplingParams:
    if req.n != 1:
        raise ApiError(400, f"n must be 1: kvscope returns one choice per request (got {req.n})", param="n")
    _refuse(req, {"best_of": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                  "logit_bias": {}, "top_logprobs": 0})
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1 (got {max_tokens})", param="max_tokens")
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= 2.0:
        raise ApiError(400, f"temperature must be in [0, 2] (got {temperature})", param="temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise ApiError(400, f"top_p must be in (0, 1] (got {top_p})", param="top_p")
    top_k = 0 if req.top_k in (None, -1) else req.top_k
    if top_k < 0:
        raise ApiError(400, f"top_k must be -1 (off), 0 (off) or positive (got {req.top_k})", param="top_k")
    if req.seed is not None and not 0 <= req.seed < 2**63:
        raise ApiError(400, f"seed must be in [0, 2^63) (got {req.seed})", param="seed")
    return SamplingParams(max_tokens=max_tokens or default_max_tokens, temperature=temperature, top_k=top_k,
                          top_p=top_p, seed=req.seed, ignore_eos=req.ignore_eos)


def stop_strings(req: _Sampling) -> list[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} chars",
                       param="stop")
    return [s for s in stop if s]


def prompt_of(req: CompletionRequest) -> str | list[int]:
    """The one prompt: text or token ids (a list holding one of them is unwrapped)."""
    _refuse(req, {"echo": False, "suffix": "", "logprobs": 0})
    p = req.prompt
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(type(t) is int for t in p):
        return p
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise ApiError(400, "one prompt per request: kvscope does not batch prompts", param="prompt")
    raise ApiError(400, "prompt must be a string or a non-empty list of token ids", param="prompt")


def chat_messages(req: ChatRequest) -> list[dict[str, str]]:
    if req.logprobs:
        raise ApiError(400, "logprobs is not supported by kvscope", param="logprobs")
    if req.tools:
        raise ApiError(400, "tools are not supported by kvscope", param="tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise ApiError(400, "only the text response_format is supported", param="response_format")
    if not req.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    out = []
    for m in req.messages:
        if isinstance(m.content, list):
            if any(part.type != "text" or part.text is None for part in m.content):
                raise ApiError(400, "only text content parts are supported", param="messages")
            text = "".join(part.text for part in m.content)
        else:
            text = m.content or ""
        out.append({"role": m.role, "content": text})
    return out


def plain_chat_prompt(messages: list[dict[str, str]]) -> str:
    """The documented join for tokenizers without a chat template: "role: content" lines, then "assistant: "."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


# ---- responses -------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def openai_finish_reason(engine_reason: str | None) -> str | None:
    """Engine reasons -> OpenAI's: max_model_len is a length cut."""
    return {"max_model_len": "length"}.get(engine_reason, engine_reason)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(rid: str, obj: str, model: str, created: int | None = None) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created or int(time.time()), "model": model}


def completion_choice(text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


def chat_choice(text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason}


def chat_delta(delta: dict[str, str], finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
