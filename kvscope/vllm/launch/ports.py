"""Addresses of a real vLLM and its watchers: free runs of loopback ports, one per data-parallel rank (vLLM's
base port + rank rule), and the relay that keeps vLLM's KV events on loopback."""

from __future__ import annotations

import socket

from kvscope.errors import KvscopeError


def offset_port(addr: str, rank: int) -> str:
    """vLLM's rule for a data-parallel rank's endpoint (ZmqEventPublisher.offset_endpoint_port): a tcp port
    plus the rank (port 0 is left to the OS), an inproc name with `_dp{rank}`."""
    if rank == 0:
        return addr
    if addr.startswith("inproc://"):
        return f"{addr}_dp{rank}"
    base, sep, port = addr.rpartition(":")
    if addr.startswith("tcp://") and sep and port.isdigit():
        return addr if int(port) == 0 else f"{base}:{int(port) + rank}"
    raise KvscopeError(f"{addr}: a data-parallel rank's address needs tcp://HOST:PORT")


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as zmq and uvicorn bind: TIME_WAIT is free
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_run(addr: str, count: int, *, movable: bool) -> str:
    """``addr`` if its port and the count-1 after it are free (one per data-parallel rank); else, when the
    address is kvscope's default (movable), the first free run of ports the OS suggests; else one line."""
    base, _, port = addr.removeprefix("tcp://").rpartition(":")
    host = base.strip("[]")
    if int(port) and all(port_free(host, int(port) + r) for r in range(count)):
        return addr
    if not movable and int(port):
        taken = "is taken" if count == 1 else f"or one of the {count - 1} ports after it is taken"
        raise KvscopeError(f"{addr} {taken}")
    for _ in range(50):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
            first = s.getsockname()[1]
        if first + count <= 65536 and all(port_free(host, first + r) for r in range(count)):
            return f"tcp://{base}:{first}"
    raise KvscopeError(f"no {count} free ports in a row on {host}")


def free_http(host: str, port: int, *, movable: bool) -> int:
    """``port`` if free; else (or for port 0), when movable, one the OS hands out; else one line."""
    if port and port_free(host, port):
        return port
    if port and not movable:
        raise KvscopeError(f"cannot listen on {host}:{port}: the port is taken")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class KvEventsRelay:
    """vLLM's KV events on a loopback address. vLLM 0.32 binds its KV-event PUB only on a wildcard endpoint
    (`tcp://*:P`, every interface) and connects it to any other, so kvscope gives it an inside port to connect
    to and relays each rank's messages unchanged (XSUB to XPUB, the watchers' subscriptions flowing back) to
    the address watchers use, bound on loopback unless allowed otherwise. A thread per rank."""

    def __init__(self, pairs: list[tuple[str, str]], *, allow_remote: bool = False) -> None:
        import threading

        import zmq

        from kvscope.protocol.pubsub import check_bind_address

        self._ctx = zmq.Context.instance()
        self._threads: list[threading.Thread] = []
        self._controls = []
        self.addresses: list[str] = []
        for i, (inside, outside) in enumerate(pairs):
            check_bind_address(outside, allow_remote)
            xsub, xpub = self._ctx.socket(zmq.XSUB), self._ctx.socket(zmq.XPUB)
            ctl_in, ctl_out = self._ctx.socket(zmq.PAIR), self._ctx.socket(zmq.PAIR)
            for sock in (xsub, xpub, ctl_in, ctl_out):
                sock.setsockopt(zmq.LINGER, 0)
            try:
                xsub.bind(inside)
                xpub.bind(outside)
                name = f"inproc://kvscope-kv-relay-{id(self)}-{i}"
                ctl_out.bind(name)
                ctl_in.connect(name)
            except zmq.ZMQError as e:
                for sock in (xsub, xpub, ctl_in, ctl_out):
                    sock.close(0)
                self.close()
                raise KvscopeError(f"cannot relay vLLM's KV events from {inside} to {outside}: {e}") from None
            self.addresses.append(outside)
            self._controls.append(ctl_out)
            t = threading.Thread(target=self._run, args=(xsub, xpub, ctl_in), name=f"kvscope-kv-relay-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    @staticmethod
    def _run(xsub, xpub, control) -> None:
        import zmq

        try:
            zmq.proxy_steerable(xsub, xpub, None, control)
        except zmq.ZMQError:
            pass
        finally:
            for sock in (xsub, xpub, control):
                sock.close(0)

    def close(self) -> None:
        for ctl in self._controls:
            try:
                ctl.send(b"TERMINATE")
            except Exception:  # noqa: BLE001 - a relay already gone
                pass
        for t in self._threads:
            t.join(timeout=2.0)
        for ctl in self._controls:
            ctl.close(0)
        self._controls, self._threads = [], []
