"""A small local web server for the explorer page (stdlib only).

Routes::

    GET  /                 the page (static/index.html)
    GET  /static/<file>    its script and style sheet, shipped inside the package (works offline)
    GET  /api/layers       layers, layouts, defaults and limits (builds the page's controls)
    POST /api/scope        a worked example (normscope.tools.explorer.api.scope_example)

Limits, because the server answers whatever a browser on this machine sends it: request bodies are
capped (413), tensors are capped by the API (413), a malformed body gets a 4xx with a JSON message,
and the listen backlog takes a burst of hundreds of simultaneous connections (each then gets its
own daemon thread). Each *read* has a socket timeout, so a client that goes silent is dropped; one
that trickles a byte at a time can still hold its thread (and only its own) for as long as it keeps
sending -- the server is for one person's browser, not for the open internet.

Addresses: it binds to 127.0.0.1 unless told otherwise; IPv6 addresses (``::1``, ``::``) get an
IPv6 socket. The Host header must name this server -- a loopback name, the bound address, any IP
address when bound to all interfaces (``0.0.0.0`` / ``::``), this machine's host name then, or a
name passed in ``allowed`` (``--allow-host``) -- which stops a DNS-rebinding page on another origin from reading
the API. That check is **not access control**: anyone who can reach the port can use the page, so
bind to a non-loopback address only on a network you trust.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
from collections.abc import Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources

from .api import LIMITS, ApiError, layers_info, scope_example

__all__ = ["make_server", "serve_in_thread", "Handler", "address_family", "allowed_hosts", "host_name"]

_STATIC = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
_WILDCARD = frozenset({"0.0.0.0", "::", ""})


def address_family(host: str) -> socket.AddressFamily:
    """AF_INET6 for an IPv6 address (``::1``, ``::``, ``fe80::1%eth0``), else AF_INET (an IPv4
    address or a host name, which the stdlib server resolves to IPv4)."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return socket.AF_INET
    return socket.AF_INET6 if ip.version == 6 else socket.AF_INET


def host_name(header: str) -> str:
    """The name part of a Host header: ``"[::1]:8765"`` -> ``"::1"``, ``"Example.org.:80"`` -> ``"example.org"``."""
    h = header.strip().lower()
    if h.startswith("["):
        h = h[1 : h.find("]")] if "]" in h else h[1:]
    elif h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


def allowed_hosts(bound: str, extra: Iterable[str] = ()) -> frozenset[str]:
    """The Host names a server bound to ``bound`` answers (a wildcard bind also answers any IP address).

    Loopback names always; the bound address itself; for a wildcard bind, this machine's host name
    and (see :meth:`Handler._host_ok`) any IP address, since the page is then meant to be opened
    from other machines by address. A DNS-rebinding page always arrives under *its* name, which is
    in none of these.
    """
    names = set(_LOOPBACK) | {host_name(h) for h in extra} | {bound.lower()}
    if bound in _WILDCARD:
        names.add(socket.gethostname().lower())  # not getfqdn: that may wait on DNS
    return frozenset(names - {""})


def _static(name: str) -> bytes:
    return resources.files("normscope.tools.explorer").joinpath("static", name).read_bytes()


class Handler(BaseHTTPRequestHandler):
    server_version = "normscope-explorer"
    timeout = 10  # seconds a client may idle mid-request (per read) before its socket is closed
    quiet = True
    hosts: frozenset[str] = _LOOPBACK
    any_ip = False  # bound to all interfaces: a Host that is an IP address is fine

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
        try:  # bare NaN/Infinity is not JSON: the page's parser would fail on it
            body = json.dumps(obj, separators=(",", ":"), allow_nan=False)
        except ValueError:
            status, body = 422, json.dumps({"error": "the result is not finite (NaN or inf)", "status": 422})
        self._send(status, body.encode(), "application/json", close)

    def _error(self, status: int, message: str, close: bool = False) -> None:
        self._json(status, {"error": message, "status": status}, close)

    def _host_ok(self) -> bool:
        name = host_name(self.headers.get("Host") or "")
        if name in self.hosts:
            return True
        if self.any_ip:
            try:
                ipaddress.ip_address(name.split("%", 1)[0])
            except ValueError:
                return False
            return True
        return False

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
        except ValueError as e:  # an integer of thousands of digits: Python's int-digits limit
            return self._error(HTTPStatus.BAD_REQUEST, f"expected a JSON body with reasonable numbers: {e}")
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
    # the listen backlog: connections the kernel holds until the accept loop takes them. At 16, a
    # burst of 200 page loads had a hundred reset; the kernel caps it at net.core.somaxconn anyway
    request_queue_size = 1024


def make_server(
    host: str = "127.0.0.1",
    port: int = 0,
    quiet: bool = True,
    timeout: float = 10.0,
    allowed: Iterable[str] = (),
) -> ThreadingHTTPServer:
    """A bound (not yet serving) explorer server; ``port=0`` picks a free port (``server.server_port``).

    ``timeout`` is the socket timeout of each read, in seconds. ``allowed`` adds Host names the
    server answers to (see :func:`allowed_hosts`; this is not access control).
    """
    handler = type(
        "BoundHandler",
        (Handler,),
        {"quiet": quiet, "timeout": timeout, "hosts": allowed_hosts(host, allowed), "any_ip": host in _WILDCARD},
    )
    server_cls = type("BoundServer", (_Server,), {"address_family": address_family(host)})
    return server_cls((host, port), handler)


def serve_in_thread(
    host: str = "127.0.0.1", port: int = 0, timeout: float = 10.0
) -> tuple[ThreadingHTTPServer, threading.Thread, str]:
    """Start a server on a daemon thread; returns (server, thread, url). Stop with ``server.shutdown()``."""
    srv = make_server(host, port, timeout=timeout)
    t = threading.Thread(target=srv.serve_forever, name="normscope-explorer", daemon=True)
    t.start()
    h, p = srv.server_address[:2]
    return srv, t, f"http://{'[' + h + ']' if ':' in h else h}:{p}/"
