#!/usr/bin/env python3
"""Sequential TLS 1.3 handshakes against a booted image: the client's median.

usage: tools/handshakes.py PORT CA [--runs N]

Each run connects (TCP_NODELAY, as curl and browsers), completes a handshake
verified with CA (ALPN http/1.1) and closes. What the handshakes cost the
guest is the kernel's own figure: the stats line `orisha: tls handshakes …
median_us …` it writes at a stop (`orisha boot` on SIGTERM).
"""

from __future__ import annotations

import argparse
import socket
import ssl
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("ca")
    ap.add_argument("--runs", type=int, default=600)
    a = ap.parse_args()
    ctx = ssl.create_default_context(cafile=a.ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.set_alpn_protocols(["http/1.1"])
    took = []
    for _ in range(a.runs):
        start = time.perf_counter()
        with socket.create_connection(("127.0.0.1", a.port), timeout=30) as raw:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with ctx.wrap_socket(raw, server_hostname="localhost"):
                took.append(time.perf_counter() - start)
    print(f"{a.runs} handshakes: client median {statistics.median(took) * 1000:.2f} ms, "
          f"min {min(took) * 1000:.2f} ms")


if __name__ == "__main__":
    main()
