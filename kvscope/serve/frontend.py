"""What `kvscope serve --http / --metrics-port` starts beside the engine loop, and stops after it."""

from __future__ import annotations

import ipaddress
import os

from kvscope.errors import KvscopeError

LOOPBACK_NAMES = ("localhost",)
API_KEY_ENV = ("KVSCOPE_API_KEY", "VLLM_API_KEY")  # read in this order when --api-key is not given


def api_key_of(flag: str | None) -> str | None:
    """--api-key, else $KVSCOPE_API_KEY, else $VLLM_API_KEY (vLLM's variable); empty means none."""
    for value in (flag, *(os.environ.get(name) for name in API_KEY_ENV)):
        if value:
            return value
    return None


def parse_host_port(value: str, allow_remote: bool, what: str = "--http") -> tuple[str, int]:
    """"HOST:PORT" (or ":PORT", or "[::1]:PORT") -> (host, port); a non-loopback host needs allow_remote."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise KvscopeError(f"{what} takes HOST:PORT, e.g. 127.0.0.1:8000 (got {value!r})")
    host = host.strip("[]") or "127.0.0.1"
    check_loopback(host, allow_remote, what)
    return host, int(port)


def bind_http(host: str, port: int):
    """Bind and listen on HOST:PORT now, before the model loads, so a port in use fails at once in one line;
    uvicorn serves on this socket later."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise KvscopeError(f"cannot serve HTTP on {host}:{port}: {e.strerror or e}") from None
    except BaseException:
        sock.close()
        raise
    return sock


def check_loopback(host: str, allow_remote: bool, what: str) -> None:
    if allow_remote or host in LOOPBACK_NAMES:
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise KvscopeError(f"{what} {host} is not a loopback address; pass --allow-remote to serve other hosts")


def chat_templates_of(tokenizer, trust_request_chat_template: bool):
    """(the model's chat template as render(messages, add_generation_prompt, **kwargs) -> text or None (then the
    plain join is used), a request template's render or None (refused), the render pool to close or None).
    Both render in the bounded pool of kvscope.serve.chat_templates."""
    from kvscope.serve.chat_templates import ChatTemplates, RenderPool, model_template_of

    template, special = model_template_of(tokenizer)
    if template is None and not trust_request_chat_template:
        return None, None, None
    pool = RenderPool()
    templates = ChatTemplates(pool, template, special)
    return (templates.render if template is not None else None,
            templates.render if trust_request_chat_template else None, pool)


class FrontEnd:
    """The HTTP API (with /metrics) and/or a bare /metrics server, around one engine."""

    def __init__(self, engine, *, http: str | None, metrics_port: int | None,
                 served_model_name: str | list[str] | None = None, allow_remote: bool = False,
                 max_waiting: int | None = None, api_key: str | None = None, http_socket=None,
                 trust_request_chat_template: bool = False) -> None:
        from kvscope.serve.metrics import PrometheusSink

        from kvscope.serve.bridge import EngineBridge

        self.engine = engine
        # vLLM's rule: the served names default to the --model argument as given (a name, a directory,
        # a .gguf path); the first name is the default `model` and the one metrics carry
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
        self.served_model_names = names or [engine.config.model]
        self.api_key = api_key_of(api_key)
        self.metrics = PrometheusSink(self.served_model_names[0])
        self.http_address = parse_host_port(http, allow_remote) if http else None
        self.bridge = EngineBridge(engine, max_waiting=max_waiting) if http else None
        self.http = None
        self.http_socket = http_socket  # bound already (bind_http), or None: uvicorn binds at start
        self.trust_request_chat_template = trust_request_chat_template
        self._render_pool = None
        self._http_front = None
        self._metrics_server = None
        self._metrics_port = metrics_port
        self.allow_remote = allow_remote
        if metrics_port is not None and not 0 < metrics_port <= 65535:
            raise KvscopeError(f"--metrics-port takes a port number 1..65535 (got {metrics_port})")

    @property
    def sink(self):
        return self.metrics

    def start(self) -> None:
        if self.http_address is not None:
            from kvscope.serve.http import ApiInfo, HttpFrontEnd, HttpServer

            model_template, request_template, self._render_pool = chat_templates_of(
                self.engine.tokenizer, self.trust_request_chat_template)
            if self._render_pool is not None:
                self._render_pool.start()
            info = ApiInfo(self.served_model_names, self.engine.max_model_len, model_template, self.metrics,
                           tokenizer=self.engine.tokenizer, api_key=self.api_key, root=self.engine.config.model,
                           vocab_size=self.engine.loaded.vocab_size, request_template=request_template)
            self._http_front = HttpFrontEnd(self.bridge, info)
            self.http = HttpServer(self._http_front.app, *self.http_address, sock=self.http_socket)
            self.http.start()
        if self._metrics_port is not None:
            from prometheus_client import start_http_server

            host = "0.0.0.0" if self.allow_remote else "127.0.0.1"
            try:
                self._metrics_server = start_http_server(self._metrics_port, addr=host,
                                                         registry=self.metrics.registry)
            except OSError as e:
                raise KvscopeError(f"cannot serve metrics on {host}:{self._metrics_port}: {e.strerror}") from None

    def close(self) -> None:
        if self.bridge is not None:
            self.bridge.close()
        if self._http_front is not None:
            self._http_front.close()
        if self._render_pool is not None:
            self._render_pool.close()  # a render in flight ends now, not when its time runs out
        if self.http is not None:
            self.http.stop()
        if self.http_socket is not None:
            self.http_socket.close()
        if self._metrics_server is not None:
            server, thread = self._metrics_server
            server.shutdown()
            server.server_close()
            thread.join(2.0)
