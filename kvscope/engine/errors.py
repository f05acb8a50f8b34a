"""User-facing errors: each carries a one-line message and is printed without a traceback."""


class KvscopeError(ValueError):
    """A mistake in what the user asked for (bad config, bad prompt, bad path)."""


class RequestRejected(KvscopeError):
    """A single request cannot be served; the engine keeps serving the others."""
