"""The explorer: an interactive local web page showing which elements share one mean and variance.

``normscope explore`` starts a small stdlib HTTP server on 127.0.0.1 and opens a page where you pick
a layer (BatchNorm, LayerNorm, InstanceNorm, GroupNorm, RMSNorm, LayerNorm2d), a layout (the
N x C x H·W cube or (B, S, D) tokens), a shape, groups, a padding mask and eps; hovering an element
highlights every element of its scope and shows the worked numbers -- mean, variance, normalized
output -- computed by the real library (:mod:`normscope.tools.explorer.api`) and checked against torch.

Everything ships inside the package (no CDN, works offline). Example::

    $ normscope explore --port 8765 --no-browser
    $ python -m normscope.tools.explorer
"""

from __future__ import annotations

import argparse
import errno
import sys
import threading
import webbrowser
from collections.abc import Sequence

from .api import ApiError, scope_example
from .server import make_server, serve_in_thread

__all__ = ["main", "make_server", "serve_in_thread", "scope_example", "ApiError"]


def main(argv: Sequence[str] | None = None) -> int:
    """``normscope explore [--port P] [--host 127.0.0.1] [--allow-host NAME] [--no-browser]``: serve until Ctrl-C."""
    p = argparse.ArgumentParser(prog="normscope explore", description="Interactive scope explorer (local web page).")
    p.add_argument("--port", type=int, default=8765, help="port to listen on (0 = any free port; default 8765)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind: 127.0.0.1 or ::1 (default 127.0.0.1: this machine only), or e.g. 0.0.0.0 to open "
        "the page from other machines by IP address. Not access control: anyone who can reach the port can use it",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also answer requests whose Host header is NAME (e.g. a DNS name of this machine); repeatable",
    )
    p.add_argument("--no-browser", action="store_true", help="do not open a browser window")
    p.add_argument("--verbose", action="store_true", help="log every request")
    args = p.parse_args(argv)
    if not 0 <= args.port <= 65535:
        print(f"normscope explore: error: expected --port in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    try:
        srv = make_server(args.host, args.port, quiet=not args.verbose, allowed=args.allow_host)
    except OSError as e:
        if e.errno in (errno.EADDRINUSE, errno.EACCES):
            hint, arg = "try another --port, or --port 0 for any free one", "--port"
        else:  # not a port problem: an address this machine does not have, or a name that does not resolve
            hint, arg = "expected an address of this machine such as 127.0.0.1, ::1 or 0.0.0.0", "--host"
        print(
            f"normscope explore: error: argument {arg}: cannot listen on {args.host} port {args.port}: "
            f"{e.strerror or e} ({hint})",
            file=sys.stderr,
        )
        return 2
    host, port = srv.server_address[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/"
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"warning: listening on {args.host}: other machines that can reach port {port} can use this page "
            f"(open it there at http://<this machine's IP address>:{port}/ or a name given with --allow-host); "
            f"there is no access control",
            file=sys.stderr,
        )
    print(f"normscope explorer at {url}  (Ctrl-C to stop)", flush=True)
    if not args.no_browser:
        threading.Timer(0.3, webbrowser.open, args=(url,)).start()
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    return 0
