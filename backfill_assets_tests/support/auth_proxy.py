"""A credential-checking reverse proxy in front of a real HTTP server, for what cannot require
credentials here: the local Apicurio Registry (in-memory, no Keycloak) answers anyone, so the
registry's credentials are checked by this proxy instead. It is test support, said plainly in
every test that uses it: the registry behind it is real, the 401 comes from here.

Python's ``http.server`` in a thread on 127.0.0.1; every request must carry exactly the
``Authorization`` header given (basic or bearer), else 401 with a Confluent-style error body;
the rest is forwarded as it is (method, path, body, content type) and answered with the
upstream's status, content type and body.
"""

from __future__ import annotations

import base64
import hmac
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def basic(user_info: str) -> str:
    """The Authorization header value of HTTP basic ``user:password``."""
    return "Basic " + base64.b64encode(user_info.encode()).decode()


def _handler(upstream: str, expected: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def _forward(self) -> None:
            given = self.headers.get("Authorization") or ""
            if not hmac.compare_digest(given.encode(), expected.encode()):
                refusal = b'{"error_code":401,"message":"Unauthorized"}'
                self._answer(401, "application/json", refusal)
                return
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            request = urllib.request.Request(upstream + self.path, data=body, method=self.command)
            if self.headers.get("Content-Type"):
                request.add_header("Content-Type", self.headers["Content-Type"])
            try:
                with urllib.request.urlopen(request, timeout=30) as resp:
                    self._answer(resp.status, resp.headers.get("Content-Type"), resp.read())
            except urllib.error.HTTPError as exc:
                self._answer(exc.code, exc.headers.get("Content-Type"), exc.read())

        def _answer(self, status: int, content_type: str | None, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type or "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_DELETE = _forward

    return Handler


@contextmanager
def auth_proxy(upstream: str, authorization: str) -> Iterator[str]:
    """Serve a proxy to ``upstream`` (``http://host:port``) that requires the Authorization
    header ``authorization``; yields its base URL, stops it afterwards."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(upstream, authorization))
    thread = threading.Thread(target=server.serve_forever, name="auth-proxy", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
