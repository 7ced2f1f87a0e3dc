"""The explorer under hostile use: a burst of 200 simultaneous requests, malformed bodies, IPv6
loopback, and Host-header semantics that do what the documentation says."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from urllib.parse import urlparse

import pytest

from normscope.tools.explorer import main as explore_main
from normscope.tools.explorer.api import ApiError, scope_example
from normscope.tools.explorer.server import address_family, allowed_hosts, host_name, make_server, serve_in_thread


def _strict_json(data: bytes):
    def no_constant(name):  # bare NaN / Infinity is not JSON; browsers' JSON.parse rejects it
        raise AssertionError(f"reply contains bare {name}")

    return json.loads(data, parse_constant=no_constant)


@pytest.fixture(scope="module")
def url():
    srv, thread, url = serve_in_thread("127.0.0.1", 0, timeout=2.0)
    yield url
    srv.shutdown()
    srv.server_close()
    thread.join(5)


def _request(url, method, path, body=None, headers=None, timeout=30):
    u = urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


@pytest.mark.parametrize(
    "body,msg",
    [
        (b'{"seed": ' + b"9" * 4400 + b"}", "JSON body"),  # beyond Python's int-digits limit
        (b'{"layer": [1]}', "`layer`"),
        (b'{"layout": {"a": 1}}', "`layout`"),
        (b'{"layer": null}', "`layer`"),
        (b'{"eps": 1e-300}', "`eps`"),  # passes a float64 check, is 0 in float32
        (b'{"eps": 1e-40}', "`eps`"),  # a float32 subnormal
        (b'{"eps": NaN}', "`eps`"),
        (b'{"eps": 1e999}', "`eps`"),
        (b'{"shape": [3, 6, ' + b"9" * 50 + b"]}", "shape[2]"),
        (b'{"mask": [' + b"1" * 4000 + b", 1, 1]}", "mask[0]"),
    ],
)
def test_malformed_bodies_get_4xx_json_naming_the_problem(url, body, msg):
    status, data = _request(url, "POST", "/api/scope", body, {"Content-Type": "application/json"})
    assert 400 <= status < 500, (status, data[:200])
    reply = _strict_json(data)
    assert msg in reply["error"]


def test_api_rejects_wrong_types_before_lookup():
    for req, name in [({"layer": [1]}, "`layer`"), ({"layout": ["nchw"]}, "`layout`"), ({"eps": 1e-300}, "`eps`")]:
        with pytest.raises(ApiError) as e:
            scope_example(req)
        assert e.value.status == 400 and name in e.value.message


def test_smallest_allowed_eps_gives_finite_strict_json(url):
    body = json.dumps({"layer": "instance", "eps": 1.2e-38, "shape": [1, 1, 1]}).encode()
    status, data = _request(url, "POST", "/api/scope", body, {"Content-Type": "application/json"})
    assert status == 200
    assert _strict_json(data)["output"] == [0.0]


def test_a_burst_of_200_simultaneous_requests_is_answered(url):
    n = 200
    start = threading.Barrier(n)
    results: list[object] = [None] * n
    post = json.dumps({"layer": "group", "groups": 3}).encode()

    def one(i: int) -> None:
        start.wait()
        try:
            if i % 2:
                results[i] = _request(url, "GET", "/api/layers", timeout=60)[0]
            else:
                results[i] = _request(url, "POST", "/api/scope", post, {"Content-Type": "application/json"}, 60)[0]
        except Exception as e:  # a reset or a refused connection is the failure under test
            results[i] = repr(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    elapsed = time.monotonic() - t0
    failed = [r for r in results if r != 200]
    assert not failed, f"{len(failed)} of {n} not answered: {failed[:5]}"
    assert elapsed < 90


# -- addresses ----------------------------------------------------------------------------------------


def test_address_family_follows_the_address():
    assert address_family("::1") == socket.AF_INET6
    assert address_family("::") == socket.AF_INET6
    assert address_family("fe80::1%lo") == socket.AF_INET6
    assert address_family("127.0.0.1") == socket.AF_INET
    assert address_family("0.0.0.0") == socket.AF_INET
    assert address_family("localhost") == socket.AF_INET


def _has_ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_ipv6_loopback_serves_the_page():
    srv, thread, url = serve_in_thread("::1", 0, timeout=2.0)
    try:
        assert url.startswith("http://[::1]:")
        port = srv.server_address[1]
        c = http.client.HTTPConnection("::1", port, timeout=10)
        c.request("GET", "/api/layers")
        r = c.getresponse()
        assert r.status == 200 and "layers" in json.loads(r.read())
        c.close()
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(5)


def test_main_blames_the_host_for_an_address_this_machine_lacks(capsys):
    # 192.0.2.1 is TEST-NET-1: never an address of this machine
    assert explore_main(["--host", "192.0.2.1", "--port", "0", "--no-browser"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--host" in err and "--port" not in err and len(err.splitlines()) == 1


# -- Host header semantics ------------------------------------------------------------------------------


def test_host_name_parsing():
    assert host_name("[::1]:8765") == "::1"
    assert host_name("127.0.0.1:80") == "127.0.0.1"
    assert host_name("Example.ORG.:80") == "example.org"
    assert host_name("localhost") == "localhost"


def test_allowed_hosts_include_the_bound_address_and_extras():
    assert {"127.0.0.1", "localhost", "::1"} <= allowed_hosts("127.0.0.1")
    assert "10.1.2.3" in allowed_hosts("10.1.2.3")
    assert "box.lan" in allowed_hosts("127.0.0.1", ["Box.LAN:8765"])
    assert socket.gethostname().lower() in allowed_hosts("0.0.0.0")
    assert "evil.example" not in allowed_hosts("0.0.0.0")


def _raw_status(port: int, host_header: str) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET /api/layers HTTP/1.1\r\nHost: {host_header}\r\nConnection: close\r\n\r\n".encode())
        first = s.recv(4096).split(b"\r\n", 1)[0]
    return int(first.split()[1])


@pytest.mark.parametrize(
    "bind,allowed,host,status",
    [
        # bound to all interfaces: a browser elsewhere opens http://<IP>:port/ -- that must work
        ("0.0.0.0", (), "192.0.2.7:{port}", 200),
        ("0.0.0.0", (), "[2001:db8::7]:{port}", 200),
        # a DNS-rebinding page arrives under its own name: refused in every mode
        ("0.0.0.0", (), "evil.example:{port}", 403),
        ("127.0.0.1", (), "evil.example:{port}", 403),
        # loopback-only: another address is not this server's
        ("127.0.0.1", (), "192.0.2.7:{port}", 403),
        ("127.0.0.1", (), "localhost:{port}", 200),
        ("127.0.0.1", ("box.lan",), "box.lan:{port}", 200),
    ],
)
def test_host_header_rules(bind, allowed, host, status):
    srv = make_server(bind, 0, allowed=allowed)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        port = srv.server_address[1]
        assert _raw_status(port, host.format(port=port)) == status
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(5)
