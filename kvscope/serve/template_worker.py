"""`python -m kvscope.serve.template_worker`: renders chat templates for the HTTP server, one at a time.

A chat template is a program (Jinja) from a checkpoint or, with --trust-request-chat-template, from a
client. It runs here, in transformers' own renderer (an ImmutableSandboxedEnvironment, the one
`apply_chat_template` uses), in a process of its own so that the server can bound what one render
takes: the server kills a render past its time limit, the data segment of this process is capped
(a template that builds gigabytes fails with MemoryError here, not in the server), and text past the
size limit never leaves this process.

Frames on stdin/stdout: a 4-byte little-endian length, then msgpack (never pickle).
  request: {"template", "messages", "add_generation_prompt", "continue_final_message", "kwargs"}
  reply:   {"text": str} or {"error": str, "restart": bool}; the first frame out is {"ready": true}.
"""

from __future__ import annotations

import os
import resource
import signal
import struct
import sys
import threading
import time

FRAME = struct.Struct("<I")


def _data_bytes() -> int:
    """This process's data segment now (VmData), the base its memory cap is added to."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def _exit_with_parent(parent: int) -> None:
    """A render the server gave up on, or a server that died, must not leave this process running."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(0)


def _read(stream, n: int) -> bytes | None:
    data = stream.read(n)
    return data if len(data) == n else None


def _write(stream, msgspec, reply: dict) -> None:
    body = msgspec.msgpack.encode(reply)
    stream.write(FRAME.pack(len(body)) + body)
    stream.flush()


def main(argv: list[str]) -> int:
    memory_bytes, max_chars = int(argv[0]), int(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when this process ends
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    import msgspec
    from transformers.utils.chat_template_utils import render_jinja_template

    cap = _data_bytes() + memory_bytes
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    _write(out, msgspec, {"ready": True})
    while True:
        head = _read(inp, FRAME.size)
        if head is None:
            return 0  # the server closed the pipe
        body = _read(inp, FRAME.unpack(head)[0])
        if body is None:
            return 0
        restart = False
        try:
            job = msgspec.msgpack.decode(body)
            rendered, _ = render_jinja_template(
                conversations=[job["messages"]], chat_template=job["template"],
                add_generation_prompt=job["add_generation_prompt"],
                continue_final_message=job["continue_final_message"], **job["kwargs"])
            text = rendered[0]
            reply = ({"text": text} if len(text) <= max_chars else
                     {"error": f"the rendered prompt is over {max_chars} characters", "restart": False})
        except MemoryError:
            restart = True  # the heap may be in no state to go on
            reply = {"error": f"the template needs more than {memory_bytes >> 20} MiB to render", "restart": True}
        except RecursionError:
            reply = {"error": "the template recursed too deeply", "restart": False}
        except Exception as e:  # the template's own refusal (raise_exception) or a sandbox violation
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            reply = {"error": f"{type(e).__name__}: {first}", "restart": False}
        _write(out, msgspec, reply)
        if restart:
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
