"""The one base class of a user's mistake, shared by every part of kvscope.

It lives here, outside the engine, so that the TUI, traces, analysis and adapters can
raise it without importing the engine. KvscopeError is deliberately not a ValueError: the
CLI turns a KvscopeError into one line and exit status 2, while a ValueError from a bug
keeps its traceback.
"""


class KvscopeError(Exception):
    """A mistake in what the user asked for (bad config, bad prompt, bad path, bad file)."""
