"""`kvscope web`: the TUI served to a browser by textual-serve, checked in headless Chromium.

Chromium (Debian's `chromium` package) loads the page; over the DevTools protocol the
test waits until the app's first bytes reached the page's terminal (textual-serve then
hides its intro dialog) and takes a screenshot. Skipped where Chromium is not installed.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from _helpers import DEADLINE_S, free_port

from kvscope.cli import main

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TRACE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "traces", "demo-cpu.kvtrace"))


def test_web_refuses_a_remote_host_without_the_flag(capsys):
    assert main(["web", "--host", "0.0.0.0", "replay", TRACE]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "loopback" in err[0]
    assert main(["web", "--port", "70000", "replay", TRACE]) == 2


def _wait_http(port: int, timeout: float) -> None:
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("kvscope web did not answer")


DRAWN_PNG_BYTES = 20_000  # a drawn dashboard, not the near-empty intro page


async def _browse(url: str, debug_port: int, wait_s: float, shot: str) -> bool:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        end = time.monotonic() + wait_s
        while True:  # Chromium's DevTools endpoint comes up after the browser has started
            try:
                async with http.get(f"http://127.0.0.1:{debug_port}/json/version") as r:
                    await r.json()
                break
            except aiohttp.ClientError:
                assert time.monotonic() < end, "Chromium's DevTools endpoint never answered"
                await asyncio.sleep(0.1)
        async with http.put(f"http://127.0.0.1:{debug_port}/json/new?{url}") as r:
            target = json.loads(await r.text())
        async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=64 << 20) as ws:
            ids = iter(range(1, 10_000))

            async def call(method: str, **params):
                mid = next(ids)
                await ws.send_json({"id": mid, "method": method, "params": params})
                while True:
                    msg = await ws.receive_json()
                    if msg.get("id") == mid:
                        return msg.get("result", {})

            started = False
            end = time.monotonic() + wait_s
            while time.monotonic() < end:
                res = await call("Runtime.evaluate", expression="document.body.classList.contains('-first-byte')",
                                 returnByValue=True)
                if res.get("result", {}).get("value") is True:
                    started = True
                    break
                await asyncio.sleep(0.5)
            # the dashboard draws its frames after the first byte: shoot until one shows it (or the deadline)
            while True:
                png = base64.b64decode((await call("Page.captureScreenshot", format="png"))["data"])
                if len(png) > DRAWN_PNG_BYTES or time.monotonic() > end:
                    break
                await asyncio.sleep(0.5)
            with open(shot, "wb") as f:
                f.write(png)
            return started


# what a user serves: a replay, the live demo (its engine starts when the page opens the app), the tour
SERVED = {"replay": ["replay", TRACE], "demo": ["demo"], "tour": ["tour"]}


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (apt-get install chromium)")
@pytest.mark.parametrize("served", list(SERVED))
def test_the_app_draws_in_a_browser(tmp_path, served):
    port, debug = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    web = subprocess.Popen([sys.executable, "-m", "kvscope", "web", "--port", str(port), *SERVED[served]],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tmp_path)
    browser = None
    try:
        _wait_http(port, DEADLINE_S)
        browser = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                                    f"--remote-debugging-port={debug}", "--window-size=1280,800",
                                    f"--user-data-dir={tmp_path / 'profile'}", "about:blank"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shot = tmp_path / "web.png"
        started = asyncio.run(_browse(f"http://127.0.0.1:{port}/", debug, DEADLINE_S, str(shot)))
        assert started, "the app's output never reached the browser's terminal"
        assert shot.stat().st_size > DRAWN_PNG_BYTES, "the browser never showed a drawn dashboard"
    finally:
        for p in (browser, web):
            if p is not None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
