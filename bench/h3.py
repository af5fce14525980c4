"""HTTP/3: Orisha against Caddy (HTTP/3 on by default), same certificate, same bytes.

Strategy: bench/bench.py's site (a ~1 KB and a ~13 KB HTML document) is built
with Orisha and exported as files (with .gz beside them) for Caddy's
``file_server { precompressed gzip }``; a test CA and leaf come from
tests/tlsutil.py. Each server runs one worker pinned to CPU 0. Debian's h2load
has no HTTP/3, so the load generator is aioquic's client: ``--clients``
processes pinned to CPU 1, each one QUIC connection keeping ``--streams``
requests in flight for ``--seconds`` (bounded in time and in count). Per server
and document: requests per second, and the server's CPU time per request
(utime+stime of its processes from /proc over the timed run). Medians over
interleaved rounds. The client is Python and is usually the limit: the CPU per
request is the figure to compare.

    .venv/bin/python bench/h3.py [--seconds 5] [--rounds 3] [--loop epoll]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import bench as B  # noqa: E402  (the site, the export, Proc with /proc CPU)

DOCS = {"1 KB": "/doc-1k.html", "13 KB": "/doc-13k.html"}
CADDYFILE = """{{
\tadmin off
\tauto_https off
}}
https://127.0.0.1:{port} {{
\ttls {cert} {key}
\troot * {root}
\tfile_server {{
\t\tprecompressed gzip
\t}}
}}
"""
MAX_REQUESTS = 200_000  # per client process: the bound in count beside --seconds


def client(port: int, path: str, seconds: float, streams: int, ca: str) -> dict:
    """One QUIC connection keeping ``streams`` GETs in flight until ``seconds`` have passed."""
    from aioquic.asyncio.client import connect
    from aioquic.asyncio.protocol import QuicConnectionProtocol
    from aioquic.h3.connection import H3_ALPN, H3Connection
    from aioquic.h3.events import DataReceived, HeadersReceived
    from aioquic.quic.configuration import QuicConfiguration

    class Load(QuicConnectionProtocol):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.h3 = H3Connection(self._quic)
            self.done = 0
            self.bytes = 0
            self.stop_at = 0.0
            self.finished = asyncio.get_running_loop().create_future()
            self.inflight = 0

        def send_one(self):
            sid = self._quic.get_next_available_stream_id()
            self.h3.send_headers(sid, [(b":method", b"GET"), (b":scheme", b"https"),
                                       (b":authority", b"127.0.0.1"), (b":path", path.encode()),
                                       (b"accept-encoding", b"gzip")], end_stream=True)
            self.inflight += 1

        def quic_event_received(self, event):
            for e in self.h3.handle_event(event):
                if isinstance(e, DataReceived):
                    self.bytes += len(e.data)
                if isinstance(e, (HeadersReceived, DataReceived)) and e.stream_ended:
                    self.done += 1
                    self.inflight -= 1
                    if time.time() < self.stop_at and self.done < MAX_REQUESTS:
                        self.send_one()
                    elif not self.inflight and not self.finished.done():
                        self.finished.set_result(None)
            self.transmit()

    async def run():
        config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name="localhost")
        config.load_verify_locations(ca)
        async with connect("127.0.0.1", port, configuration=config, create_protocol=Load,
                           wait_connected=True) as c:
            start = time.time()
            c.stop_at = start + seconds
            for _ in range(streams):
                c.send_one()
            c.transmit()
            await asyncio.wait_for(c.finished, seconds + 30)
            return {"done": c.done, "bytes": c.bytes, "wall": time.time() - start}
    return asyncio.run(run())


def load(port: int, path: str, seconds: float, clients: int, streams: int, ca: str) -> dict:
    """``clients`` client processes on CPU 1 at once; their summed counts."""
    code = (f"import sys, json; sys.path.insert(0, {HERE!r}); import h3; "
            f"print(json.dumps(h3.client({port}, {path!r}, {seconds}, {streams}, {ca!r})))")
    procs = [subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", code],
                              stdout=subprocess.PIPE, text=True) for _ in range(clients)]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=seconds + 60)
        outs.append(json.loads(out))
    wall = max(o["wall"] for o in outs)
    return {"done": sum(o["done"] for o in outs), "rps": sum(o["done"] for o in outs) / wall}


def start(server: str, tmp: str, build: str, root: str, pki, loop: str) -> "B.Proc":
    port = B.free_port()
    if server == "caddy":
        conf = os.path.join(tempfile.mkdtemp(dir=tmp), "Caddyfile")
        with open(conf, "w") as f:
            f.write(CADDYFILE.format(port=port, root=root, cert=pki.chain, key=pki.key))
        return B.Proc(server, ["caddy", "run", "--config", conf, "--adapter", "caddyfile"], port,
                      "0", env={**os.environ, "HOME": tmp, "XDG_DATA_HOME": tmp,
                                "XDG_CONFIG_HOME": tmp})
    return B.Proc(server, [sys.executable, "-m", "orisha.cli", "serve", build, "--port", str(port),
                           "--workers", "1", "--loop", loop, "--tls-cert", pki.chain,
                           "--tls-key", pki.key], port, "0")


def main() -> None:
    from tlsutil import make_pki
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--streams", type=int, default=20)
    ap.add_argument("--loop", default="epoll")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="orisha-h3-bench-")
    site, build, root = (os.path.join(tmp, n) for n in ("site", "build", "root"))
    B.make_site(site)
    subprocess.run([sys.executable, "-m", "orisha.cli", "build", site, "-o", build], check=True,
                   capture_output=True, cwd=ROOT)
    os.makedirs(root)
    B.export_for_nginx(build, root)
    pki = make_pki(os.path.join(tmp, "pki"))
    servers = ["caddy", "orisha"]
    results: dict = {(s, d): [] for s in servers for d in DOCS}
    for _ in range(args.rounds):
        for s in servers:
            p = start(s, tmp, build, root, pki, args.loop)
            try:
                time.sleep(1.0)  # the UDP socket follows the TCP port Proc waited for
                for d, path in DOCS.items():
                    load(p.port, path, 1, 1, args.streams, pki.ca)  # warm-up, untimed
                    before = p.cpu()
                    r = load(p.port, path, args.seconds, args.clients, args.streams, pki.ca)
                    r["cpu_us"] = (p.cpu() - before) / max(r["done"], 1) * 1e6
                    results[(s, d)].append(r)
            finally:
                p.stop()
    print("| run | server | req/s | server CPU µs per request |\n|---|---|---:|---:|")
    for d in DOCS:
        for s in servers:
            rs = results[(s, d)]
            print(f"| h3 {d} | {s} | {statistics.median(r['rps'] for r in rs):,.0f} | "
                  f"{statistics.median(r['cpu_us'] for r in rs):.1f} |")


if __name__ == "__main__":
    main()
