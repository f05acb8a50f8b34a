"""The OpenAI-compatible HTTP API (Starlette on uvicorn), beside the engine loop.

Every handler runs on the server's event loop thread. A request becomes a Job on
the bridge's queue; the engine thread answers through the job's deliver callback
into an asyncio.Queue. A client that disconnects gets its engine request aborted.
docs/HTTP.md describes the endpoints, parameters and errors.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvscope.engine.errors import KvscopeError
from kvscope.serve import openai_protocol as oa
from kvscope.serve.bridge import ACCEPTED, DONE, QUEUE_FULL, REJECTED, STOPPED, TOO_LONG, EngineBridge, Job, Update

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


@dataclass
class ApiInfo:
    served_model_name: str
    max_model_len: int
    chat_template: object | None = None  # callable(messages) -> str, from the tokenizer
    metrics: object | None = None  # kvscope.serve.metrics.PrometheusSink


def _error(e: oa.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _rejected(update: Update, prompt_param: str) -> oa.ApiError:
    if update.code == QUEUE_FULL:
        return oa.ApiError(429, update.error, code="rate_limit_exceeded", type="rate_limit_error")
    if update.code == STOPPED:
        return oa.ApiError(503, update.error, type="server_error")
    return oa.ApiError(400, update.error, param=prompt_param, code=TOO_LONG if update.code == TOO_LONG else None)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class HttpFrontEnd:
    def __init__(self, bridge: EngineBridge, info: ApiInfo) -> None:
        self.bridge = bridge
        self.info = info
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error,
                                                                 Exception: self._server_error})

    async def _http_error(self, request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(oa.ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind))

    async def _server_error(self, request: Request, exc: Exception) -> JSONResponse:
        return _error(oa.ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))

    # ---- plain endpoints --------------------------------------------------------------
    def _model_card(self) -> dict:
        name = self.info.served_model_name
        return {"id": name, "object": "model", "created": 0, "owned_by": "kvscope", "root": name, "parent": None,
                "max_model_len": self.info.max_model_len}

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> JSONResponse:
        name = request.path_params["model"]
        if name != self.info.served_model_name:
            return _error(oa.ApiError(404, f"The model `{name}` does not exist.", param="model",
                                      code="model_not_found"))
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        return Response(status_code=503 if self.bridge.closed else 200)

    async def metrics(self, request: Request) -> Response:
        if self.info.metrics is None:
            return _error(oa.ApiError(404, "metrics are not enabled", type="not_found_error"))
        body, content_type = self.info.metrics.exposition()
        return Response(body, media_type=content_type)

    # ---- generation ---------------------------------------------------------------------
    async def _body(self, request: Request, kind: type):
        declared = request.headers.get("content-length") or "0"
        if not declared.isdigit():
            raise oa.ApiError(400, f"bad Content-Length {declared[:32]!r}")
        if int(declared) > oa.MAX_BODY_BYTES:
            raise oa.ApiError(413, f"request body over {oa.MAX_BODY_BYTES} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > oa.MAX_BODY_BYTES:
                raise oa.ApiError(413, f"request body over {oa.MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
        req = oa.decode_body(b"".join(chunks), kind)
        if req.model != self.info.served_model_name:
            raise oa.ApiError(404, f"The model `{req.model}` does not exist.", param="model",
                              code="model_not_found")
        return req

    async def completions(self, request: Request) -> Response:
        try:
            req = await self._body(request, oa.CompletionRequest)
            prompt = oa.prompt_of(req)
            params = oa.sampling_params(req, req.max_tokens, oa.COMPLETION_DEFAULT_MAX_TOKENS)
            job_stop = oa.stop_strings(req)
        except oa.ApiError as e:
            return _error(e)
        except ClientDisconnect:
            return Response(status_code=400)
        return await self._run(request, req, Job(prompt, params, None, -req.priority, job_stop), chat=False)

    async def chat(self, request: Request) -> Response:
        try:
            req = await self._body(request, oa.ChatRequest)
            messages = oa.chat_messages(req)
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            params = oa.sampling_params(req, max_tokens, 1)
            stop = oa.stop_strings(req)
            prompt = self._chat_prompt(messages)
        except oa.ApiError as e:
            return _error(e)
        except ClientDisconnect:
            return Response(status_code=400)
        job = Job(prompt, params, None, -req.priority, stop, default_max_tokens=max_tokens is None)
        return await self._run(request, req, job, chat=True)

    def _chat_prompt(self, messages: list[dict[str, str]]) -> str:
        render = self.info.chat_template
        if render is None:
            return oa.plain_chat_prompt(messages)
        try:
            return render(messages)
        except Exception as e:  # a template may refuse (e.g. roles out of order): the client's mistake
            raise oa.ApiError(400, f"the chat template refused these messages: {e}", param="messages") from None

    async def _run(self, request: Request, req, job: Job, chat: bool) -> Response:
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
            return _error(_rejected(first, "messages" if chat else "prompt"))
        assert first.kind == ACCEPTED
        meta = oa.envelope(oa.new_id("chatcmpl" if chat else "cmpl"), "chat.completion" if chat else
                           "text_completion", self.info.served_model_name)
        if req.stream:
            usage_wanted = req.stream_options is not None and req.stream_options.include_usage
            if chat:
                meta["object"] = "chat.completion.chunk"
            return StreamingResponse(self._stream(job, updates, meta, chat, usage_wanted, first.prompt_tokens),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._collect(request, job, updates, meta, chat, first.prompt_tokens)

    async def _collect(self, request: Request, job: Job, updates: asyncio.Queue, meta: dict, chat: bool,
                       prompt_tokens: int) -> Response:
        parts: list[str] = []
        loop = asyncio.get_running_loop()
        next_check = loop.time() + DISCONNECT_POLL_S
        try:
            while True:
                try:
                    u = await asyncio.wait_for(updates.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    u = None
                if u is not None:
                    parts.append(u.text)
                    if u.kind == DONE:
                        break
                if loop.time() >= next_check:  # tokens may keep coming: look at the client on a clock
                    next_check = loop.time() + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        self.bridge.abort(job)
                        return Response(status_code=499)
        except asyncio.CancelledError:
            self.bridge.abort(job)
            raise
        reason = oa.openai_finish_reason(u.finish_reason)
        text = "".join(parts)
        choice = oa.chat_choice(text, reason) if chat else oa.completion_choice(text, reason)
        return JSONResponse({**meta, "choices": [choice], "usage": oa.usage(prompt_tokens, u.completion_tokens)})

    async def _stream(self, job: Job, updates: asyncio.Queue, meta: dict, chat: bool, usage_wanted: bool,
                      prompt_tokens: int) -> AsyncIterator[str]:
        extra = {"usage": None} if usage_wanted else {}
        done = False
        try:
            if chat:
                yield _sse({**meta, "choices": [oa.chat_delta({"role": "assistant", "content": ""}, None)], **extra})
            while not done:
                u = await updates.get()
                done = u.kind == DONE
                reason = oa.openai_finish_reason(u.finish_reason) if done else None
                if not u.text and not done:
                    continue
                if chat:
                    choice = oa.chat_delta({"content": u.text} if u.text else {}, reason)
                else:
                    choice = oa.completion_choice(u.text, reason)
                yield _sse({**meta, "choices": [choice], **extra})
            if usage_wanted:
                yield _sse({**meta, "choices": [], "usage": oa.usage(prompt_tokens, u.completion_tokens)})
            yield "data: [DONE]\n\n"
        finally:
            if not done:
                self.bridge.abort(job)  # the client hung up (or the server is stopping)


class HttpServer:
    """uvicorn on its own thread; the engine loop keeps the main thread."""

    def __init__(self, app, host: str, port: int) -> None:
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=2, access_log=False)
        self.server = uvicorn.Server(config)
        self.port = port
        self.thread = threading.Thread(target=self.server.run, name="kvscope-http", daemon=True)

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
