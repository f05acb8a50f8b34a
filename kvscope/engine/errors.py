"""User-facing errors: each carries a one-line message and is printed without a traceback.

KvscopeError is deliberately not a ValueError: the CLI turns a KvscopeError into one
line and exit status 2, while a ValueError from a bug keeps its traceback.
"""


class KvscopeError(Exception):
    """A mistake in what the user asked for (bad config, bad prompt, bad path, bad file)."""


class RequestRejected(KvscopeError):
    """A single request cannot be served; the engine keeps serving the others."""
