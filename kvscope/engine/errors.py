"""User-facing errors of the engine: each carries a one-line message and is printed without a traceback."""

from kvscope.errors import KvscopeError

__all__ = ["RequestRejected"]


class RequestRejected(KvscopeError):
    """A single request cannot be served; the engine keeps serving the others."""
