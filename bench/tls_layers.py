"""The TLS layers side by side in one process: server CPU per HTTPS/1.1 request, no sockets.

Strategy: the demo site is built once; one connection per layer (``tls.PureTls``:
ssl.SSLObject; ``tls.Tls``: compiled_tls where built) is driven by a client
``ssl.SSLObject`` over memory BIOs through a TLS 1.3 handshake, then N keep-alive
requests of one path. Only the server's calls (receive, outgoing, sent) are timed,
with the thread's CPU clock, so the client's work and other processes on a shared
machine do not count; cleartext (``front.Plain``) is the floor: the core's own
work. Rounds interleave the layers; the minimum and the median per layer are
printed (the minimum is the least disturbed). A diagnostic beside bench/h2.py
(which measures whole servers against H2O and nginx), not a result of its own.

    .venv/bin/python bench/tls_layers.py [--requests 20000] [--rounds 5] [--path /css/site.css]
"""

from __future__ import annotations

import argparse
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from tlsutil import make_pki  # noqa: E402

from orisha.core.connection import App  # noqa: E402
from orisha.protocols import tls  # noqa: E402
from orisha.protocols.front import Plain  # noqa: E402
from orisha.serving.server import load_site  # noqa: E402


def _drain(conn, clock: list) -> bytes:
    t = time.thread_time()
    out = b"".join(bytes(b) for b in conn.outgoing)
    conn.sent(len(out), 1.0)
    clock[0] += time.thread_time() - t
    return out


def over_tls(site, layer, pki, request: bytes, n: int) -> float:
    """µs of server CPU per request on one kept-alive TLS 1.3 connection."""
    app = App(site, protocols=layer(tls.by_names([(("localhost",),
                                                   tls.context(pki.chain, pki.key))])))
    client_ctx = ssl.create_default_context(cafile=pki.ca)
    client_ctx.set_alpn_protocols(["http/1.1"])
    cin, cout = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_ctx.wrap_bio(cin, cout, server_hostname="localhost")
    conn = app.connect(1.0, "-")
    clock = [0.0]

    def pump() -> None:
        data = cout.read()
        if data:
            t = time.thread_time()
            conn.receive(data, 1.0)
            clock[0] += time.thread_time() - t
        cin.write(_drain(conn, clock))

    for _ in range(10):
        try:
            client.do_handshake()
            break
        except ssl.SSLWantReadError:
            pump()
    pump()  # the tickets
    clock[0] = 0.0
    for _ in range(n):
        client.write(request)
        pump()
        while True:
            try:
                client.read(1 << 20)
            except ssl.SSLWantReadError:
                break
    conn.close()
    return clock[0] / n * 1e6


def cleartext(site, request: bytes, n: int) -> float:
    conn = App(site, protocols=Plain()).connect(1.0, "-")
    clock = [0.0]
    for _ in range(n):
        t = time.thread_time()
        conn.receive(request, 1.0)
        clock[0] += time.thread_time() - t
        _drain(conn, clock)
    conn.close()
    return clock[0] / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--path", default="/css/site.css")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="orisha-tls-layers-") as d:
        out = os.path.join(d, "site")
        subprocess.run([sys.executable, "-m", "orisha.cli", "build", os.path.join(ROOT, "sites", "demo"),
                        "-o", out], check=True, capture_output=True, timeout=600)
        site, pki = load_site(out), make_pki(os.path.join(d, "pki"))
        request = (f"GET {args.path} HTTP/1.1\r\nHost: localhost\r\n"
                   "Accept-Encoding: gzip\r\n\r\n").encode()
        runs: dict[str, list[float]] = {"cleartext": [], "pure": [], tls.LAYER + " (tls.Tls)": []}
        for _ in range(args.rounds):
            runs["cleartext"].append(cleartext(site, request, args.requests))
            runs["pure"].append(over_tls(site, tls.PureTls, pki, request, args.requests))
            runs[tls.LAYER + " (tls.Tls)"].append(over_tls(site, tls.Tls, pki, request,
                                                           args.requests))
    print(f"server CPU µs per request, {args.path}, {args.requests} requests x {args.rounds} rounds")
    for name, values in runs.items():
        print(f"  {name:22} min {min(values):6.2f}  median {statistics.median(values):6.2f}")


if __name__ == "__main__":
    main()
