"""A small local web server for the explorer page (stdlib only).

Routes::

    GET  /                 the page (static/index.html)
    GET  /static/<file>    its script and style sheet, shipped inside the package (works offline)
    GET  /api/layers       layers, layouts, defaults and limits (builds the page's controls)
    POST /api/scope        a worked example (normscope.explorer.api.scope_example)

Limits, because the server answers whatever a browser on this machine sends it: request bodies are
capped (413), tensors are capped by the API (413), each connection has a socket timeout (a slow
client cannot hold a thread), and the Host header must name this server (a DNS-rebinding page on
another origin cannot read the API). It binds to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import json
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources

from .api import LIMITS, ApiError, layers_info, scope_example

__all__ = ["make_server", "serve_in_thread", "Handler"]

_STATIC = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
_LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}


def _static(name: str) -> bytes:
    return resources.files("normscope.explorer").joinpath("static", name).read_bytes()


class Handler(BaseHTTPRequestHandler):
    server_version = "normscope-explorer"
    timeout = 10  # seconds a client may idle mid-request before its socket is closed
    quiet = True

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's signature
        if not self.quiet:
            super().log_message(format, *args)

    # -- helpers ------------------------------------------------------------------------------------

    def _send(self, status: int, body: bytes, ctype: str, close: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        # everything the page needs is served from here: no CDN, no inline script
        self.send_header("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'")
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: object, close: bool = False) -> None:
        self._send(status, json.dumps(obj, separators=(",", ":")).encode(), "application/json", close)

    def _error(self, status: int, message: str, close: bool = False) -> None:
        self._json(status, {"error": message, "status": status}, close)

    def _host_ok(self) -> bool:
        host = (self.headers.get("Host") or "").strip()
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        bound = self.server.server_address[0]
        return name in _LOOPBACK or name == bound

    # -- routes -------------------------------------------------------------------------------------

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        if not self._host_ok():
            return self._error(
                HTTPStatus.FORBIDDEN, "unexpected Host header: open the page at the address the server printed"
            )
        path = self.path.split("?", 1)[0]
        if path in ("/", "/index.html"):
            return self._send(200, _static("index.html"), _STATIC["index.html"])
        if path.startswith("/static/"):
            name = path[len("/static/") :]
            if name in _STATIC:  # a fixed list: no path ever reaches the file system from the URL
                return self._send(200, _static(name), _STATIC[name])
        if path == "/favicon.ico":  # browsers ask; answering "nothing" keeps their consoles clean
            self.send_response(HTTPStatus.NO_CONTENT)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        if path == "/api/layers":
            return self._json(200, layers_info())
        return self._error(HTTPStatus.NOT_FOUND, f"no such page: {path}")

    def do_HEAD(self) -> None:  # noqa: N802
        self.do_GET()

    def do_POST(self) -> None:  # noqa: N802
        if not self._host_ok():
            return self._error(
                HTTPStatus.FORBIDDEN,
                "unexpected Host header: open the page at the address the server printed",
                close=True,
            )
        path = self.path.split("?", 1)[0]
        if path != "/api/scope":
            return self._error(HTTPStatus.NOT_FOUND, f"no such endpoint: POST {path}", close=True)
        length = self.headers.get("Content-Length")
        if length is None:
            return self._error(HTTPStatus.LENGTH_REQUIRED, "expected a Content-Length header", close=True)
        try:
            n = int(length)
            if n < 0:
                raise ValueError
        except ValueError:
            return self._error(
                HTTPStatus.BAD_REQUEST, f"expected a non-negative Content-Length, got {length!r}", close=True
            )
        if n > LIMITS["max_body_bytes"]:
            # drain a moderately large body so the client sees the 413 rather than a reset; refuse a
            # huge one unread (the connection is closed, so its bytes are never parsed as a request)
            if n <= 64 * LIMITS["max_body_bytes"]:
                try:
                    self.rfile.read(n)
                except (TimeoutError, OSError):
                    pass
            return self._error(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"request body of {n} bytes exceeds the limit of {LIMITS['max_body_bytes']} bytes",
                close=True,
            )
        try:
            raw = self.rfile.read(n)
        except TimeoutError:
            return self._error(HTTPStatus.REQUEST_TIMEOUT, "timed out reading the request body", close=True)
        if len(raw) < n:
            return self._error(HTTPStatus.BAD_REQUEST, f"expected {n} body bytes, got {len(raw)}", close=True)
        try:
            req = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return self._error(HTTPStatus.BAD_REQUEST, f"expected a JSON body: {e}")
        except RecursionError:  # "[[[[..." within the size limit still nests too deep for json
            return self._error(HTTPStatus.BAD_REQUEST, "expected a JSON body: nested too deeply")
        try:
            return self._json(200, scope_example(req))
        except ApiError as e:
            return self._error(e.status, e.message)
        except Exception as e:  # a bug must still answer, not kill the thread or hang the page
            return self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {type(e).__name__}: {e}")


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # Ctrl-C must not wait for idle keep-alive connections
    request_queue_size = 16


def make_server(
    host: str = "127.0.0.1", port: int = 0, quiet: bool = True, timeout: float = 10.0
) -> ThreadingHTTPServer:
    """A bound (not yet serving) explorer server; ``port=0`` picks a free port (``server.server_port``).

    ``timeout`` is the socket timeout of each connection, in seconds.
    """
    handler = type("BoundHandler", (Handler,), {"quiet": quiet, "timeout": timeout})
    return _Server((host, port), handler)


def serve_in_thread(
    host: str = "127.0.0.1", port: int = 0, timeout: float = 10.0
) -> tuple[ThreadingHTTPServer, threading.Thread, str]:
    """Start a server on a daemon thread; returns (server, thread, url). Stop with ``server.shutdown()``."""
    srv = make_server(host, port, timeout=timeout)
    t = threading.Thread(target=srv.serve_forever, name="normscope-explorer", daemon=True)
    t.start()
    h, p = srv.server_address[:2]
    return srv, t, f"http://{'[' + h + ']' if ':' in h else h}:{p}/"
