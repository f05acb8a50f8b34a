"""Small helpers the tests share: a free loopback port, and waits on a condition.

A test that waits for something waits on the condition itself, with a deadline generous
enough for a loaded 2-core machine (a flaky test is a defect); the deadline only bounds a
hang, so passing tests never pay it.
"""

from __future__ import annotations

import asyncio
import socket
import time

DEADLINE_S = 120.0  # a model load and a few steps, at nice 19 beside other jobs


def free_port() -> int:
    """A port the OS just handed out on 127.0.0.1 (free at the time of asking)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, timeout: float = DEADLINE_S, every: float = 0.02) -> bool:
    """Poll cond() until it is true (True) or the deadline passes (False)."""
    end = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() > end:
            return False
        time.sleep(every)


async def async_wait_for(cond, timeout: float = DEADLINE_S, every: float = 0.05) -> bool:
    """wait_for inside an event loop (a Textual pilot test): the app keeps running while it waits."""
    end = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() > end:
            return False
        await asyncio.sleep(every)
