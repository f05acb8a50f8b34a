"""The HTTP layer below the app: uvicorn's h11 protocol, with its own 400 answered in OpenAI's shape.

A request h11 cannot parse (a bad Content-Length, a broken request line or header) never
reaches Starlette: uvicorn answers it, by default with a plain-text 400. docs/HTTP.md says
every error is JSON, so this subclass overrides the one method that writes that answer and
sends the same 400 as OpenAI error JSON (``invalid_request_error``), then closes the
connection as uvicorn does. Nothing else of uvicorn's behaviour changes.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def malformed_http_body(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "malformed_http_request"}}).encode()


class JsonErrorsH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        body = malformed_http_body(f"malformed HTTP request (answered before the API read it): {msg}")
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            out = self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request"))
            out += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:  # mid-response (pipelining): no new answer can start; just hang up
            self.transport.close()
            return
        self.transport.write(out)
        self.transport.close()
