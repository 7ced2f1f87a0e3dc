"""The explorer's JSON API and its server: worked numbers are right, bad input gets a 4xx with a message.
TestHostile: bursts, malformed bodies, IPv6 loopback and Host-header rules."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from urllib.parse import urlparse

import pytest
import torch

from normscope.tools.explorer import main as explore_main
from normscope.tools.explorer.api import LIMITS, ApiError, example_input, scope_example
from normscope.tools.explorer.server import address_family, allowed_hosts, host_name, make_server, serve_in_thread
from normscope.tools.viz import layer_names

REQUESTS = [
    *[{"layer": n, "layout": "nchw"} for n in layer_names("nchw")],
    *[{"layer": n, "layout": "bsd"} for n in layer_names("bsd")],
    *[{"layer": n, "layout": "bsd", "mask": [5, 2], "groups": 3, "seed": 3} for n in layer_names("bsd")],
    {"layer": "group", "layout": "nchw", "shape": [2, 6, 2, 3], "groups": 3, "mask": [6, 4], "eps": 0.1},
    {"layer": "instance", "layout": "nchw", "shape": [1, 1, 1]},
]


@pytest.mark.parametrize(
    "req", REQUESTS, ids=lambda r: f"{r['layer']}-{r['layout']}-{'mask' if r.get('mask') else 'nomask'}"
)
def test_worked_numbers_are_the_definition(req):
    r = scope_example(req)
    shape = tuple(r["shape"])
    x = example_input(shape, r["seed"]).double().flatten()
    assert torch.allclose(torch.tensor(r["values"], dtype=torch.float64), x, atol=1e-6)
    ids = torch.tensor(r["scope_ids"])
    y = torch.tensor(r["output"], dtype=torch.float64)
    centered = req["layer"] not in ("rms", "qknorm")  # the uncentered (mean-square) scopes
    for k in ids[ids >= 0].unique().tolist():
        v = x[ids == k]
        mu = v.mean() if centered else torch.zeros((), dtype=torch.float64)
        var = (v - mu).square().mean()
        assert r["count"][k] == v.numel()
        assert r["mean"][k] == pytest.approx(float(mu), abs=1e-5)
        assert r["var"][k] == pytest.approx(float(var), abs=1e-5, rel=1e-5)
        assert torch.allclose(y[ids == k], (v - mu) / torch.sqrt(var + r["eps"]), atol=1e-4)
    assert r["check"]["max_abs_diff"] < 1e-5
    assert r["n_scopes"] == len(r["colors"])
    if req.get("mask"):
        assert "float64" in r["check"]["against"] and (ids == -1).any()
    elif r["values"] and len(r["values"]) > 1:
        assert r["check"]["against"].startswith("torch.nn.functional")


BAD = [
    ([1, 2], 400, "JSON object"),
    ({"layer": "nope"}, 400, "`layer`"),
    ({"layout": "nhwc"}, 400, "`layout`"),
    ({"layer": "layer2d", "layout": "bsd"}, 400, "not defined in layout"),
    ({"shape": [3, 6]}, 400, "`shape`"),
    ({"shape": "3,6,4"}, 400, "`shape`"),
    ({"shape": [3, 0, 4]}, 400, "shape[1]"),
    ({"shape": [3, 6, 4.5]}, 400, "shape[2]"),
    ({"shape": [64, 64, 64]}, 413, "at most 4096 elements"),
    ({"groups": 4}, 400, "divisible by groups=4"),
    ({"groups": 0}, 400, "`groups`"),
    ({"groups": True}, 400, "`groups`"),
    ({"eps": -1}, 400, "`eps`"),
    ({"eps": "1e-5"}, 400, "`eps`"),
    ({"seed": -3}, 400, "`seed`"),
    ({"mask": [1, 2]}, 400, "3 valid lengths"),
    ({"mask": [1, 2, 9]}, 400, "mask[2]"),
    ({"extra": 1}, 400, "unknown field"),
]


@pytest.mark.parametrize("req,status,msg", BAD, ids=[str(b[0])[:30] for b in BAD])
def test_bad_requests_are_refused_with_a_message(req, status, msg):
    with pytest.raises(ApiError) as e:
        scope_example(req)
    assert e.value.status == status and msg in e.value.message


# -- over HTTP --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def url():
    srv, thread, url = serve_in_thread("127.0.0.1", 0, timeout=1.0)
    yield url
    srv.shutdown()
    srv.server_close()
    thread.join(5)


def _conn(url):
    u = urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=10)


def _post(url, body: bytes, headers=None):
    c = _conn(url)
    c.request("POST", "/api/scope", body=body, headers={"Content-Type": "application/json", **(headers or {})})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def test_pages_and_api_over_http(url):
    c = _conn(url)
    for path, ctype, needle in [
        ("/", "text/html", b"app.js"),
        ("/static/app.js", "text/javascript", b"/api/scope"),
        ("/static/style.css", "text/css", b".cell"),
    ]:
        c.request("GET", path)
        r = c.getresponse()
        body = r.read()
        assert r.status == 200 and r.getheader("Content-Type").startswith(ctype) and needle in body
        assert "default-src 'self'" in r.getheader("Content-Security-Policy")
    for path in ("/static/../api.py", "/static/api.py", "/nope"):
        c.request("GET", path)
        r = c.getresponse()
        assert r.status == 404 and "error" in json.loads(r.read())
    c.request("GET", "/api/layers")
    r = c.getresponse()
    info = json.loads(r.read())
    assert {lay["name"] for lay in info["layers"]} == set(layer_names())
    c.close()
    status, data = _post(url, json.dumps({"layer": "group", "groups": 3}).encode())
    assert status == 200
    out = json.loads(data)
    ref = torch.nn.functional.group_norm(example_input((3, 6, 4), 0), 3, eps=1e-5)
    assert torch.allclose(torch.tensor(out["output"]), ref.flatten(), atol=1e-5)


def test_bad_input_over_http_is_4xx_json(url):
    for body, status, msg in [
        (b"{not json", 400, "JSON"),
        (b"\xff\xfe", 400, "JSON"),
        (json.dumps({"groups": 4}).encode(), 400, "divisible"),
        (json.dumps({"shape": [64, 64, 2]}).encode(), 413, "4096"),
        (b"[" * 15000, 400, "nested too deeply"),
    ]:
        s, data = _post(url, body)
        assert s == status and msg in json.loads(data)["error"]


def test_oversized_body_is_413(url):
    s, data = _post(url, b" " * (LIMITS["max_body_bytes"] + 1))
    assert s == 413 and "exceeds the limit" in json.loads(data)["error"]


def _raw(url, payload: bytes, wait: float = 5.0) -> bytes:
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=wait) as s:
        s.sendall(payload)
        chunks = []
        while True:
            try:
                b = s.recv(65536)
            except TimeoutError:
                break
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)


def test_missing_length_foreign_host_and_slow_client(url):
    port = urlparse(url).port
    r = _raw(url, f"POST /api/scope HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    assert r.startswith(b"HTTP/1.0 411") or r.startswith(b"HTTP/1.1 411")
    r = _raw(url, b"GET /api/layers HTTP/1.1\r\nHost: evil.example:80\r\n\r\n")
    assert b" 403 " in r.split(b"\r\n")[0] and b"Host" in r
    # a client that promises a body and stalls is answered 408 after the socket timeout (1 s here),
    # and does not block other clients meanwhile
    t0 = time.monotonic()
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=5) as slow:
        slow.sendall(f"POST /api/scope HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 100\r\n\r\n{{".encode())
        c = _conn(url)
        c.request("GET", "/api/layers")
        assert c.getresponse().status == 200
        c.close()
        answer = slow.recv(65536)
    assert b" 408 " in answer.split(b"\r\n")[0]
    assert time.monotonic() - t0 < 4


def test_main_reports_a_busy_port(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert explore_main(["--port", str(port), "--no-browser"]) == 2
    assert "cannot listen" in capsys.readouterr().err
    assert explore_main(["--port", "70000", "--no-browser"]) == 2


def test_page_needs_no_network():
    """Everything the page loads comes from this server: no CDN, no absolute URL."""
    import re
    from importlib import resources

    static = resources.files("normscope.tools.explorer").joinpath("static")
    for name in ("index.html", "app.js", "style.css"):
        text = static.joinpath(name).read_text()
        urls = set(re.findall(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}[^\s\"')]*", text))
        assert urls <= {"http://www.w3.org/2000/svg"}, (name, urls)


@pytest.mark.parametrize("layer", ["layer", "rms"])
def test_layer_and_rms_on_nchw_of_rank_4_normalize_all_but_the_batch_axis(layer):
    """(N, C, H, W): one scope per sample over (C, H, W), as torch's F.layer_norm(x, x.shape[1:]) -- the page
    showed one scope per (sample, channel) and a difference of 1.35 to torch."""
    r = scope_example({"layer": layer, "layout": "nchw", "shape": [2, 4, 2, 2]})
    assert r["n_scopes"] == 2 and r["count"] == [16, 16]
    assert r["check"]["against"].startswith("torch.nn.functional") and r["check"]["max_abs_diff"] < 1e-5


def _strict_json(data: bytes):
    def no_constant(name):  # bare NaN / Infinity is not JSON; browsers' JSON.parse rejects it
        raise AssertionError(f"reply contains bare {name}")

    return json.loads(data, parse_constant=no_constant)


def _request(url, method, path, body=None, headers=None, timeout=30):
    u = urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def _has_ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def _raw_status(port: int, host_header: str) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET /api/layers HTTP/1.1\r\nHost: {host_header}\r\nConnection: close\r\n\r\n".encode())
        first = s.recv(4096).split(b"\r\n", 1)[0]
    return int(first.split()[1])


class TestHostile:
    """The explorer under hostile use: a burst of 200 simultaneous requests, malformed bodies, IPv6
    loopback, and Host-header semantics that do what the documentation says."""

    @pytest.fixture(scope="class")
    def url(self):
        # a longer request timeout than the module's server: the burst test queues 200 requests
        srv, thread, url = serve_in_thread("127.0.0.1", 0, timeout=2.0)
        yield url
        srv.shutdown()
        srv.server_close()
        thread.join(5)

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
    def test_malformed_bodies_get_4xx_json_naming_the_problem(self, url, body, msg):
        status, data = _request(url, "POST", "/api/scope", body, {"Content-Type": "application/json"})
        assert 400 <= status < 500, (status, data[:200])
        reply = _strict_json(data)
        assert msg in reply["error"]

    def test_api_rejects_wrong_types_before_lookup(self):
        for req, name in [({"layer": [1]}, "`layer`"), ({"layout": ["nchw"]}, "`layout`"), ({"eps": 1e-300}, "`eps`")]:
            with pytest.raises(ApiError) as e:
                scope_example(req)
            assert e.value.status == 400 and name in e.value.message

    def test_smallest_allowed_eps_gives_finite_strict_json(self, url):
        body = json.dumps({"layer": "instance", "eps": 1.2e-38, "shape": [1, 1, 1]}).encode()
        status, data = _request(url, "POST", "/api/scope", body, {"Content-Type": "application/json"})
        assert status == 200
        assert _strict_json(data)["output"] == [0.0]

    def test_a_burst_of_200_simultaneous_requests_is_answered(self, url):
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


    def test_address_family_follows_the_address(self):
        assert address_family("::1") == socket.AF_INET6
        assert address_family("::") == socket.AF_INET6
        assert address_family("fe80::1%lo") == socket.AF_INET6
        assert address_family("127.0.0.1") == socket.AF_INET
        assert address_family("0.0.0.0") == socket.AF_INET
        assert address_family("localhost") == socket.AF_INET

    @pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
    def test_ipv6_loopback_serves_the_page(self):
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

    def test_main_blames_the_host_for_an_address_this_machine_lacks(self, capsys):
        # 192.0.2.1 is TEST-NET-1: never an address of this machine
        assert explore_main(["--host", "192.0.2.1", "--port", "0", "--no-browser"]) == 2
        err = capsys.readouterr().err.strip()
        assert "--host" in err and "--port" not in err and len(err.splitlines()) == 1

    # -- Host header semantics ------------------------------------------------------------------------------


    def test_host_name_parsing(self):
        assert host_name("[::1]:8765") == "::1"
        assert host_name("127.0.0.1:80") == "127.0.0.1"
        assert host_name("Example.ORG.:80") == "example.org"
        assert host_name("localhost") == "localhost"

    def test_allowed_hosts_include_the_bound_address_and_extras(self):
        assert {"127.0.0.1", "localhost", "::1"} <= allowed_hosts("127.0.0.1")
        assert "10.1.2.3" in allowed_hosts("10.1.2.3")
        assert "box.lan" in allowed_hosts("127.0.0.1", ["Box.LAN:8765"])
        assert socket.gethostname().lower() in allowed_hosts("0.0.0.0")
        assert "evil.example" not in allowed_hosts("0.0.0.0")

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
    def test_host_header_rules(self, bind, allowed, host, status):
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
