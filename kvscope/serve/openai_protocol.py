"""OpenAI request and response bodies (msgspec Structs), their checks, and the error shape.

No parameter is silently ignored. Every field of vLLM's request models either works
(declared with its type below) or is refused with a 400 that names it unless it holds
its neutral value (`REFUSED_*`). Fields neither OpenAI nor vLLM defines are ignored, as
OpenAI does. docs/HTTP.md lists which is which.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Struct, UnsetType

from kvscope.engine.request import PRIORITY_MAX, PRIORITY_MIN
from kvscope.engine.sampling_params import MAX_LOGPROBS, MAX_N, MAX_STOP_TOKEN_IDS, SamplingParams

MAX_BODY_BYTES = 4 << 20  # a request body larger than this is refused (413)
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_STOP_CHARS = 256
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
MAX_REQUEST_ID_CHARS = 256


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---- requests ----------------------------------------------------------------------------------
class StreamOptions(Struct):
    include_usage: bool = True  # vLLM's default once stream_options is given
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class _Request(Struct, kw_only=True):
    """The fields completions and chat share (OpenAI's and vLLM's sampling parameters)."""

    model: str | None = None  # None: the first served model name
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM: -1 or 0 disable it
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    n: int = 1  # choices: parallel sampling, n sequences sharing the prompt's KV blocks (1..MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM: lower is served first. The engine's priority is its negation, so the range is symmetric,
    # -(2^63-1)..2^63-1: a 400 outside it, before anything reaches an event.
    priority: Annotated[int, msgspec.Meta(ge=PRIORITY_MIN, le=PRIORITY_MAX)] = 0
    user: str | None = None  # OpenAI's end-user id: recorded by OpenAI, no effect on the output
    request_id: str | None = None  # vLLM: the response id is built from it
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N"
    return_token_ids: bool = False  # the reply carries prompt_token_ids and each choice's token_ids
    add_special_tokens: bool | None = None  # completions default True, chat default False (vLLM's)
    # vLLM fields kvscope cannot honour: refused unless neutral (REFUSED_COMMON)
    best_of: Any = None
    use_beam_search: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    length_penalty: Any = None
    logit_bias: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    prompt_logprobs: Any = None
    echo: Any = None
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    logits_processors: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    mm_processor_kwargs: Any = None
    max_repetition_pattern_size: Any = None
    min_repetition_pattern_size: Any = None
    repetition_min_count: Any = None


_NONE = (None,)
_FALSE = (None, False)
# name -> the values that ask for nothing (anything else is a 400 naming the field)
REFUSED_COMMON: dict[str, tuple] = {
    "use_beam_search": _FALSE, "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1), "length_penalty": (None, 1), "logit_bias": (None, {}),
    "spaces_between_special_tokens": (None, True), "truncate_prompt_tokens": _NONE, "allowed_token_ids": _NONE,
    "bad_words": (None, []), "prompt_logprobs": _NONE, "structured_outputs": _NONE,
    "guided_json": _NONE, "guided_regex": _NONE, "guided_choice": _NONE, "guided_grammar": _NONE,
    "guided_decoding_backend": _NONE, "guided_whitespace_pattern": _NONE, "structural_tag": _NONE,
    "logits_processors": (None, []), "cache_salt": _NONE, "kv_transfer_params": _NONE, "vllm_xargs": (None, {}),
    "mm_processor_kwargs": (None, {}), "max_repetition_pattern_size": (None, 0),
    "min_repetition_pattern_size": (None, 0), "repetition_min_count": (None, 0),
}
# completions' echo would need the prompt's logprobs; best_of works on completions only
REFUSED_COMPLETION: dict[str, tuple] = {"suffix": (None, ""), "prompt_embeds": _NONE, "echo": _FALSE}
REFUSED_CHAT: dict[str, tuple] = {
    "best_of": (None, 1),
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "reasoning_effort": _NONE,
    "include_reasoning": (None, True), "documents": (None, []), "media_io_kwargs": (None, {}),
}


class CompletionRequest(_Request, kw_only=True):
    prompt: Any = None  # str, [int], [str] or [[int]] with one prompt: checked in prompt_of()
    logprobs: int | None = None  # the top k per token (0: only the sampled token's)
    suffix: Any = None
    prompt_embeds: Any = None


class ContentPart(Struct):
    type: str
    text: str | None = None


class Message(Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(_Request, kw_only=True):
    messages: list[Message]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # only about tools, which are refused: nothing to do
    tools: Any = None
    tool_choice: Any = None
    reasoning_effort: Any = None
    include_reasoning: Any = None
    documents: Any = None
    chat_template: Any = None  # refused unless the server trusts request templates (http.py)
    media_io_kwargs: Any = None


class TokenizeRequest(Struct, kw_only=True):
    """vLLM's /tokenize: a prompt, or chat messages rendered as /v1/chat/completions would."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: Any = None  # refused unless the server trusts request templates, as on chat
    return_token_strs: bool = False


class DetokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


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
    except RecursionError:  # a field typed Any (prompt, tools) holding [[[[... thousands deep
        raise ApiError(400, "invalid JSON body: nested too deeply") from None


def _same(value: Any, neutral: Any) -> bool:
    """value equals the neutral value, without True == 1 or 0 == False."""
    if neutral is None or isinstance(neutral, bool):
        return value is neutral
    if isinstance(neutral, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == neutral
    return type(value) is type(neutral) and value == neutral


def refuse_unsupported(req: Struct, table: dict[str, tuple]) -> None:
    for name, neutral in table.items():
        value = getattr(req, name)
        if not any(_same(value, n) for n in neutral):
            raise ApiError(400, f"{name} is not supported by kvscope (got {_short(value)})", param=name)


def check_request(req: _Request) -> None:
    """The checks vLLM makes before sampling: n, stream_options, and the refused fields."""
    if not 1 <= req.n <= MAX_N:
        raise ApiError(400, f"n must be in 1..{MAX_N} (got {req.n})", param="n")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
    if req.request_id is not None and not 0 < len(req.request_id) <= MAX_REQUEST_ID_CHARS:
        raise ApiError(400, f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} characters", param="request_id")
    refuse_unsupported(req, REFUSED_COMMON)
    if req.response_format is not None:
        kind = req.response_format.get("type") if isinstance(req.response_format, dict) else None
        if kind != "text":
            raise ApiError(400, "only the text response_format is supported", param="response_format")


def sampling_params(req: _Request, max_tokens: int | None, default_max_tokens: int, logprobs: int | None,
                    max_tokens_param: str = "max_tokens") -> SamplingParams:
    """``max_tokens_param``: the field max_tokens came from (chat's max_completion_tokens wins), named in errors."""
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"{max_tokens_param} must be at least 1 (got {max_tokens})", param=max_tokens_param)
    temperature = 1.0 if req.temperature is None else req.temperature
    if not math.isfinite(temperature) or not 0.0 <= temperature <= 2.0:
        raise ApiError(400, f"temperature must be in [0, 2] (got {temperature})", param="temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise ApiError(400, f"top_p must be in (0, 1] (got {top_p})", param="top_p")
    top_k = 0 if req.top_k in (None, -1) else req.top_k
    if top_k < 0:
        raise ApiError(400, f"top_k must be -1 (off), 0 (off) or positive (got {req.top_k})", param="top_k")
    min_p = 0.0 if req.min_p is None else req.min_p
    if not math.isfinite(min_p) or not 0.0 <= min_p <= 1.0:
        raise ApiError(400, f"min_p must be in [0, 1] (got {min_p})", param="min_p")
    if req.seed is not None and not 0 <= req.seed < 2**63:
        raise ApiError(400, f"seed must be in [0, 2^63) (got {req.seed})", param="seed")
    max_tokens = max_tokens or default_max_tokens
    if not 0 <= req.min_tokens <= max_tokens:
        raise ApiError(400, f"min_tokens must be in [0, max_tokens={max_tokens}] (got {req.min_tokens})",
                       param="min_tokens")
    stop_ids = req.stop_token_ids or []
    if len(stop_ids) > MAX_STOP_TOKEN_IDS or any(t < 0 for t in stop_ids):
        raise ApiError(400, f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids >= 0", param="stop_token_ids")
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          seed=req.seed, ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
                          stop=stop_strings(req), stop_token_ids=list(stop_ids),
                          include_stop_str_in_output=req.include_stop_str_in_output,
                          skip_special_tokens=req.skip_special_tokens, logprobs=logprobs, n=req.n)


def completion_best_of(req: CompletionRequest) -> int:
    """How many sequences to sample: best_of (vLLM: at least n; the n with the highest cumulative
    logprob are returned, so it cannot stream), n when it is not given."""
    best_of = req.best_of
    if best_of is None:
        return req.n
    if type(best_of) is not int or not req.n <= best_of <= MAX_N:
        raise ApiError(400, f"best_of must be an integer in n..{MAX_N} (n={req.n}, got {_short(best_of)})",
                       param="best_of")
    if req.stream and best_of > req.n:
        raise ApiError(400, "best_of > n cannot stream: the best are known only at the end", param="best_of")
    return best_of


def chat_echo(req: ChatRequest, messages: list[dict[str, str]]) -> str:
    """vLLM's chat echo: the reply's content starts with the last message's when that is the assistant's."""
    if req.echo is not None and type(req.echo) is not bool:
        raise ApiError(400, f"echo must be a boolean (got {_short(req.echo)})", param="echo")
    if req.echo and messages[-1]["role"] == "assistant":
        return messages[-1]["content"]
    return ""


def completion_logprobs(req: CompletionRequest) -> int | None:
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"logprobs must be in [0, {MAX_LOGPROBS}] (got {req.logprobs})", param="logprobs")
    return req.logprobs


def chat_logprobs(req: ChatRequest) -> int | None:
    top = req.top_logprobs or 0
    if not 0 <= top <= MAX_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}] (got {top})", param="top_logprobs")
    if top and not req.logprobs:
        raise ApiError(400, "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
    return top if req.logprobs else None


def stop_strings(req: _Request) -> list[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} chars",
                       param="stop")
    return [s for s in stop if s]


def prompt_of(req: CompletionRequest) -> str | list[int]:
    """The one prompt: text or token ids (a list holding one of them is unwrapped)."""
    refuse_unsupported(req, REFUSED_COMPLETION)
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


def chat_messages(req: ChatRequest | TokenizeRequest) -> list[dict[str, str]]:
    if isinstance(req, ChatRequest):
        refuse_unsupported(req, REFUSED_CHAT)
    if req.continue_final_message and req.add_generation_prompt:
        raise ApiError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                       param="continue_final_message")
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


def plain_chat_prompt(messages: list[dict[str, str]], add_generation_prompt: bool = True,
                      continue_final_message: bool = False) -> str:
    """The documented join for tokenizers without a chat template: "role: content" lines, then
    "assistant: " (or, continuing the final message, that message left open)."""
    lines = [f"{m['role']}: {m['content']}\n" for m in messages]
    if continue_final_message:
        return "".join(lines)[:-1]
    return "".join(lines) + ("assistant: " if add_generation_prompt else "")


def _short(v: Any, limit: int = 60) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."


# ---- responses ---------------------------------------------------------------------------------
class UsageInfo(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | UnsetType = UNSET  # with return_token_ids


class CompletionResponse(Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET


class ChatLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprobContent(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatLogprob]


class ChatLogprobs(Struct):
    content: list[ChatLogprobContent] | None


class ChatMessage(Struct):
    role: str
    content: str


class ChatChoice(Struct):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | UnsetType = UNSET


class DeltaMessage(Struct, omit_defaults=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET


class ChatStreamChoice(Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | UnsetType = UNSET


class ChatResponse(Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice] | list[ChatStreamChoice]
    usage: UsageInfo | None | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET


class ModelCard(Struct):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "kvscope"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | UnsetType = UNSET


class DetokenizeResponse(Struct):
    prompt: str


def new_id(prefix: str, request_id: str | None = None) -> str:
    return f"{prefix}-{request_id or uuid.uuid4().hex}"


def openai_finish_reason(engine_reason: str | None) -> str | None:
    """Engine reasons -> OpenAI's: max_model_len is a length cut; "abort" stays "abort", as vLLM reports
    it; "error" never reaches a choice (the reply is an error instead)."""
    return {"max_model_len": "length"}.get(engine_reason, engine_reason)


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


def now_s() -> int:
    return int(time.time())
