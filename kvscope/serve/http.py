"""The OpenAI-compatible HTTP API (Starlette on uvicorn), beside the engine loop.

Every handler runs on the server's event loop thread. A request becomes a Job on
the bridge's queue, stamped with the time the server received it (on the engine's
clock, so TTFT and queue time start there); the engine thread answers through the
job's deliver callback into an asyncio.Queue. A client that disconnects gets its
engine request aborted. docs/HTTP.md describes the endpoints, parameters and errors.

Work that takes as long as a request's text (rendering the chat template, tokenizing a
prompt of up to 4 MiB) runs on a few worker threads of their own, so the job reaches the
bridge as token ids: on the event loop it would stall every other connection, and in the
engine loop every running request's next token (vLLM tokenizes in its API server for the
same reason). A chat template renders in a worker process, bounded in time, memory and
output (chat_templates.py), so one slow render holds one thread for at most its time limit.
"""

from __future__ import annotations

import asyncio
import hmac
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvscope.errors import KvscopeError
from kvscope.serve import openai_protocol as oa
from kvscope.serve.bridge import (ACCEPTED, BAD_MIN_TOKENS, DONE, QUEUE_FULL, REJECTED, STOPPED, TOO_LONG, EngineBridge,
                                  Job, Update)
from kvscope.serve.replies import Reply

TEXT_THREADS = 6  # tokenizing and template renders at once: more than the render pool, so encodes go on
# chat_template_kwargs keys that are the renderer's own parameters, not template variables: the request's own
# fields set them, or they would change what the render returns
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversations", "conversation", "messages", "add_generation_prompt", "continue_final_message", "tokenize",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation", "max_length",
    "return_tensors", "sanitize_control_tokens", "template"})
UNTRUSTED_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
                      "Refused request with untrusted chat template.")  # vLLM's words


@dataclass
class ApiInfo:
    served_model_names: list[str]  # the first is the default and the name metrics carry
    max_model_len: int
    chat_template: object | None = None  # callable(messages, add_generation_prompt, **kwargs) -> str
    metrics: object | None = None  # kvscope.serve.metrics.PrometheusSink
    tokenizer: object | None = None  # for logprobs' token strings, /tokenize and /detokenize
    api_key: str | None = None  # every /v1 route then needs "Authorization: Bearer KEY"
    root: str = ""  # the --model argument (the model card's root)
    vocab_size: int = 0  # ids /detokenize accepts are below it
    # renders a request's own template (render(messages, add_generation_prompt, template=T, **kwargs)); set only when
    # the operator started the server with --trust-request-chat-template, else such a request is refused
    request_template: object | None = None


def kvscope_version() -> str:
    """The installed package's version (vLLM's /version answers its own the same way)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvscope")
    except PackageNotFoundError:
        return "unknown"


def _json(struct, status: int = 200) -> Response:
    return Response(msgspec.json.encode(struct), status_code=status, media_type="application/json")


def _error(e: oa.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _rejected(update: Update, prompt_param: str) -> oa.ApiError:
    if update.code == QUEUE_FULL:
        return oa.ApiError(429, update.error, code="rate_limit_exceeded", type="rate_limit_error")
    if update.code == STOPPED:
        return oa.ApiError(503, update.error, type="server_error")
    if update.code == BAD_MIN_TOKENS:
        return oa.ApiError(400, update.error, param="min_tokens")
    return oa.ApiError(400, update.error, param=prompt_param, code=TOO_LONG if update.code == TOO_LONG else None)


def _failed(update: Update) -> oa.ApiError:
    """A request that the engine ended with reason "error": its own failure, a 500."""
    return oa.ApiError(500, f"the request failed in the engine: {update.error or 'unknown error'}",
                       type="server_error")


async def _client_gone(request: Request) -> None:
    """Returns when the client hangs up. The body has been read, so the next ASGI message is
    http.disconnect, sent the moment uvicorn sees the connection close (vLLM listens the same way)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ApiKeyGuard:
    """ASGI middleware: /v1 routes need "Authorization: Bearer KEY" (401 otherwise), as in vLLM."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith("/v1"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                body = oa.ApiError(401, "Incorrect or missing API key: send Authorization: Bearer KEY",
                                   code="invalid_api_key").body()
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class HttpFrontEnd:
    def __init__(self, bridge: EngineBridge, info: ApiInfo) -> None:
        self.bridge = bridge
        self.info = info
        self._text_worker = ThreadPoolExecutor(max_workers=TEXT_THREADS, thread_name_prefix="kvscope-text")
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]
        starlette = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error,
                                                                  Exception: self._server_error})
        self.app = ApiKeyGuard(starlette, info.api_key) if info.api_key else starlette

    async def _http_error(self, request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(oa.ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind))

    async def _server_error(self, request: Request, exc: Exception) -> JSONResponse:
        return _error(oa.ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))

    # ---- plain endpoints --------------------------------------------------------------
    def _model_name(self, asked: str | None) -> str:
        """The model a request asked for (None: the first served name); 404 for any other."""
        names = self.info.served_model_names
        if asked is None:
            return names[0]
        if asked not in names:
            raise oa.ApiError(404, f"The model `{asked}` does not exist.", param="model", code="model_not_found")
        return asked

    def _model_card(self, name: str) -> oa.ModelCard:
        return oa.ModelCard(name, root=self.info.root or name, max_model_len=self.info.max_model_len)

    async def models(self, request: Request) -> Response:
        return _json(oa.ModelList([self._model_card(n) for n in self.info.served_model_names]))

    async def model(self, request: Request) -> Response:
        try:
            return _json(self._model_card(self._model_name(request.path_params["model"])))
        except oa.ApiError as e:
            return _error(e)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": kvscope_version()})

    async def health(self, request: Request) -> Response:
        return Response(status_code=503 if self.bridge.closed else 200)

    async def metrics(self, request: Request) -> Response:
        if self.info.metrics is None:
            return _error(oa.ApiError(404, "metrics are not enabled", type="not_found_error"))
        body, content_type = self.info.metrics.exposition()
        return Response(body, media_type=content_type)

    def _tokenizer(self):
        if self.info.tokenizer is None:
            raise oa.ApiError(400, "this model has no tokenizer: send token ids")
        return self.info.tokenizer

    async def _off_loop(self, fn, *args):
        """fn(*args) on a text worker thread; its ApiError comes back here."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._text_worker, fn, *args)
        except RuntimeError as e:  # the executor was shut down: the server is stopping
            raise oa.ApiError(503, f"the server is stopping ({e})", type="server_error") from None

    def close(self) -> None:
        """No new text work; threads waiting on a render are freed by the render pool's close."""
        self._text_worker.shutdown(wait=False, cancel_futures=True)

    def _encode(self, text: str, special: bool, param: str = "prompt") -> list[int]:
        tok = self._tokenizer()
        try:
            return tok.encode(text, add_special_tokens=True) if special else tok.encode(text)
        except Exception as e:  # a tokenizer's own refusal of some text: the client's input
            raise oa.ApiError(400, f"cannot tokenize the {param}: {e}", param=param) from None

    def _tokenize_reply(self, req) -> oa.TokenizeResponse:
        tok = self._tokenizer()
        if req.messages is not None:
            ids = self._encode(self._chat_prompt(oa.chat_messages(req), req), bool(req.add_special_tokens), "messages")
        else:
            ids = self._encode(req.prompt, req.add_special_tokens is not False)
        strs = [tok.decode([t], skip_special_tokens=False) for t in ids] if req.return_token_strs else oa.UNSET
        return oa.TokenizeResponse(len(ids), self.info.max_model_len, ids, strs)

    async def tokenize(self, request: Request) -> Response:
        try:
            req = await self._body(request, oa.TokenizeRequest)
            self._model_name(req.model)
            self._tokenizer()
            if (req.prompt is None) == (req.messages is None):
                raise oa.ApiError(400, "give exactly one of prompt and messages", param="prompt")
            return _json(await self._off_loop(self._tokenize_reply, req))
        except oa.ApiError as e:
            return _error(e)
        except ClientDisconnect:
            return Response(status_code=400)

    async def detokenize(self, request: Request) -> Response:
        try:
            req = await self._body(request, oa.DetokenizeRequest)
            self._model_name(req.model)
            tok = self._tokenizer()
            vocab = self.info.vocab_size
            bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise oa.ApiError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens")
            return _json(oa.DetokenizeResponse(tok.decode(req.tokens)))
        except oa.ApiError as e:
            return _error(e)
        except ClientDisconnect:
            return Response(status_code=400)

    # ---- generation ---------------------------------------------------------------------
    async def _body(self, request: Request, kind: type):
        declared = request.headers.get("content-length") or "0"
        if not (declared.isascii() and declared.isdigit()):
            raise oa.ApiError(400, f"bad Content-Length {declared[:32]!r}")
        if int(declared) > oa.MAX_BODY_BYTES:
            raise oa.ApiError(413, f"request body over {oa.MAX_BODY_BYTES} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > oa.MAX_BODY_BYTES:
                raise oa.ApiError(413, f"request body over {oa.MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
        return oa.decode_body(b"".join(chunks), kind)

    async def completions(self, request: Request) -> Response:
        received = self.bridge.now()  # the request's arrival, on the engine's clock
        try:
            req = await self._body(request, oa.CompletionRequest)
            name = self._model_name(req.model)
            oa.check_request(req)
            prompt = oa.prompt_of(req)
            params = oa.sampling_params(req, req.max_tokens, oa.COMPLETION_DEFAULT_MAX_TOKENS,
                                        oa.completion_logprobs(req))
            params.n = oa.completion_best_of(req)
            if params.n > req.n and params.logprobs is None:
                params.logprobs = 0  # the sampled tokens' logprobs rank the best_of sequences
            special = req.add_special_tokens is not False
            if isinstance(prompt, str) and self.info.tokenizer is not None:
                prompt = await self._off_loop(self._encode, prompt, special)
        except oa.ApiError as e:
            return _error(e)
        except ClientDisconnect:
            return Response(status_code=400)
        job = Job(prompt, params, None, -req.priority, arrival=received, add_special_tokens=special)
        return await self._run(request, job, Reply(req, name, chat=False, tokenizer=self.info.tokenizer,
                                                   sequences=params.n))

    async def chat(self, request: Request) -> Response:
        received = self.bridge.now()
        try:
            req = await self._body(request, oa.ChatRequest)
            name = self._model_name(req.model)
            oa.check_request(req)
            messages = oa.chat_messages(req)
            given = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            # vLLM's default output length for chat is the rest of the context; the bridge sets it once the prompt's
            # length is known, so until then the bound for min_tokens is the whole context
            params = oa.sampling_params(req, max_tokens, self.info.max_model_len, oa.chat_logprobs(req),
                                        max_tokens_param=given)
            prompt = await self._off_loop(self._chat_ids, messages, req)
            echo = oa.chat_echo(req, messages)
        except oa.ApiError as e:
            return _error(e)
        except ClientDisconnect:
            return Response(status_code=400)
        job = Job(prompt, params, None, -req.priority, default_max_tokens=max_tokens is None, arrival=received,
                  add_special_tokens=bool(req.add_special_tokens))
        return await self._run(request, job, Reply(req, name, chat=True, tokenizer=self.info.tokenizer,
                                                   sequences=params.n, echo=echo))

    def _chat_ids(self, messages: list[dict[str, str]], req) -> str | list[int]:
        """The chat prompt through the template, as token ids where the model has a tokenizer."""
        text = self._chat_prompt(messages, req)
        return self._encode(text, bool(req.add_special_tokens), "messages") if self.info.tokenizer else text

    def _request_template(self, req, kwargs: dict) -> str | None:
        """A template the request brings (top-level chat_template, or inside chat_template_kwargs): refused unless
        the operator trusts request templates (vLLM's --trust-request-chat-template)."""
        given = [(p, v) for p, v in (("chat_template", req.chat_template),
                                     ("chat_template_kwargs", kwargs.pop("chat_template", None))) if v is not None]
        for param, value in given:
            if self.info.request_template is None:
                raise oa.ApiError(400, UNTRUSTED_TEMPLATE, param=param)
            if not isinstance(value, str):
                raise oa.ApiError(400, f"chat_template must be a string (got {type(value).__name__})", param=param)
        return given[0][1] if given else None

    def _chat_prompt(self, messages: list[dict[str, str]], req) -> str:
        from kvscope.serve.chat_templates import RenderError, RenderStopped

        kwargs = dict(req.chat_template_kwargs or {})
        template = self._request_template(req, kwargs)
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
        if reserved:
            raise oa.ApiError(400, f"chat_template_kwargs cannot set {reserved[0]!r}: it is the renderer's own "
                                   "parameter (use the request's field where there is one)", param="chat_template_kwargs")
        render = self.info.chat_template if template is None else self.info.request_template
        if render is None:
            return oa.plain_chat_prompt(messages, req.add_generation_prompt, req.continue_final_message)
        if req.continue_final_message:
            kwargs["continue_final_message"] = True
        if template is not None:
            kwargs["template"] = template
        try:
            return render(messages, add_generation_prompt=req.add_generation_prompt, **kwargs)
        except RenderStopped:
            raise oa.ApiError(503, "the server is stopping", type="server_error") from None
        except Exception as e:  # a template may refuse (e.g. roles out of order), or run past its bounds
            param = "messages" if template is None else ("chat_template" if req.chat_template is not None
                                                         else "chat_template_kwargs")
            what = "refused these messages" if not isinstance(e, RenderError) else "failed"
            raise oa.ApiError(400, f"the chat template {what}: {e}", param=param) from None

    async def _collect(self, job: Job, updates: asyncio.Queue, reply: Reply) -> Response:
        """A non-streaming reply: every update until the last sequence ends."""
        while True:
            u = await updates.get()
            if u.kind == DONE and u.finish_reason == "error":
                self.bridge.abort(job)  # one of its n sequences failed: the reply cannot be whole
                return _error(_failed(u))  # this request's own failure: a 500; the others go on
            reply.add(u)
            if u.kind == DONE and u.remaining == 0:
                return _json(reply.final())

    async def _run(self, request: Request, job: Job, reply: Reply) -> Response:
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[Update] = asyncio.Queue()

        def deliver(update: Update) -> None:  # called on the engine thread
            try:
                loop.call_soon_threadsafe(updates.put_nowait, update)
            except RuntimeError:
                pass  # the server's event loop is gone (shutting down): nobody is listening

        job.deliver = deliver
        self.bridge.submit(job)
        try:
            first = await updates.get()
        except asyncio.CancelledError:
            self.bridge.abort(job)  # gone before the engine took it: the abort follows it through the queue
            raise
        if first.kind == REJECTED:
            return _error(_rejected(first, "messages" if reply.chat else "prompt"))
        assert first.kind == ACCEPTED
        reply.accepted(first)
        if reply.stream:
            # headers go out now, as vLLM sends them; a failure later arrives as an error event in the stream
            return StreamingResponse(self._stream(job, updates, reply), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        # the reply races the client: a hang-up ends the wait at once and aborts the engine request
        collect = asyncio.ensure_future(self._collect(job, updates, reply))
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self.bridge.abort(job)  # the server is stopping
            raise
        finally:
            collect.cancel()
            gone.cancel()
        if collect.done() and not collect.cancelled():
            return collect.result()
        self.bridge.abort(job)
        return Response(status_code=499)

    async def _stream(self, job: Job, updates: asyncio.Queue, reply: Reply) -> AsyncIterator[bytes]:
        done = False
        try:
            for chunk in reply.opening():
                yield chunk
            while not done:
                u = await updates.get()
                if u.kind == DONE and u.finish_reason == "error":
                    self.bridge.abort(job)  # the job's other sequences end with it
                    done = True
                    yield reply.sse(_failed(u).body())
                    break
                done = u.kind == DONE and u.remaining == 0  # every choice has ended
                for chunk in reply.chunks(u):
                    yield chunk
                if done:
                    for chunk in reply.closing():
                        yield chunk
            yield b"data: [DONE]\n\n"
        finally:
            if not done:
                self.bridge.abort(job)  # the client hung up (or the server is stopping)


class HttpServer:
    """uvicorn on its own thread; the engine loop keeps the main thread."""

    def __init__(self, app, host: str, port: int, sock=None) -> None:
        import uvicorn

        from kvscope.serve.http_wire import JsonErrorsH11Protocol

        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=2, access_log=False, http=JsonErrorsH11Protocol)
        self.server = uvicorn.Server(config)
        self.port = port
        run = self.server.run if sock is None else (lambda: self.server.run(sockets=[sock]))
        self.thread = threading.Thread(target=run, name="kvscope-http", daemon=True)

    def start(self, timeout: float = 10.0) -> None:
        self.thread.start()
        waited = 0.0
        while not self.server.started and self.thread.is_alive() and waited < timeout:
            self.thread.join(0.05)
            waited += 0.05
        if self.server.started:
            self.port = self.server.servers[0].sockets[0].getsockname()[1]  # the real one when port 0 was asked
        else:
            raise KvscopeError(f"the HTTP server could not start on {self.server.config.host}:{self.server.config.port}"
                               " (is the port in use?)")

    def stop(self, timeout: float = 5.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
