"""Which side of vLLM's KV-event socket binds, and which vLLM serves (what its HTTP server says of itself).

vLLM's ``--kv-events-config`` ``endpoint`` is bound when it is a wildcard (``tcp://*:5557``) or an
ipc/inproc address, and *connected* otherwise (``tcp://127.0.0.1:5557``: vLLM expects a proxy or a
subscriber to bind there; vllm/distributed/kv_events.py ``_is_bind_endpoint``). So kvscope connects to
a vLLM that binds, and binds where a vLLM connects: ``--kv-events bind:ADDR`` says so, and with
``--vllm URL`` kvscope asks the server (``GET URL/kv_event_sources``, vLLM 0.32 on) and binds by
itself when the address given is one vLLM connects to. The replay socket is always vLLM's to bind.
"""

from __future__ import annotations

import json
import time

BIND = "bind:"
MAX_SOURCES_BYTES = 64 << 10
SOURCES_TIMEOUT_S = 3.0


def _get_json(url: str, client, path: str, budget_s: float = SOURCES_TIMEOUT_S):
    """GET url+path as JSON, bounded in size (64 KiB) and in total time (a server that trickles its body
    gets ``budget_s`` in all, not per chunk); None for anything else."""
    deadline = time.monotonic() + budget_s
    try:
        with client.stream("GET", f"{url}{path}", timeout=budget_s) as resp:
            if resp.status_code != 200:
                return None
            body = b""
            for chunk in resp.iter_raw():
                body += chunk
                if len(body) > MAX_SOURCES_BYTES or time.monotonic() > deadline:
                    return None
        return json.loads(body)
    except Exception:  # noqa: BLE001 - network errors, bad JSON: not known
        return None


def server_version(url: str, client, budget_s: float = SOURCES_TIMEOUT_S) -> str | None:
    """vLLM's version from its OpenAI server's ``GET /version`` (``{"version": "0.32.0"}``), or None."""
    got = _get_json(url, client, "/version", budget_s)
    v = got.get("version") if isinstance(got, dict) else None
    return v if isinstance(v, str) and 0 < len(v) <= 64 and v.isprintable() else None


def vllm_binds(endpoint: str) -> bool:
    """vLLM's own rule for its PUB endpoint (kv_events.py ``_is_bind_endpoint``)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def split_mode(addr: str) -> tuple[bool, str]:
    """(kvscope binds, the zmq address) of a ``--kv-events`` value."""
    return (True, addr[len(BIND):]) if addr.startswith(BIND) else (False, addr)


def vllm_connects_to(url: str, client, addr: str) -> bool:
    """Does the vLLM at ``url`` connect its KV-event PUB to ``addr`` (so kvscope must bind it)? False when
    the server does not say (an older vLLM, an error, anything malformed: kvscope then connects, as always)."""
    sources = _get_json(url, client, "/kv_event_sources")
    if not isinstance(sources, dict):
        return False
    for cfg in list(sources.values())[:64]:  # one per engine (data-parallel rank)
        endpoint = cfg.get("endpoint") if isinstance(cfg, dict) else None
        if isinstance(endpoint, str) and endpoint == addr and cfg.get("enable_kv_cache_events") is not False:
            return not vllm_binds(endpoint)
    return False
