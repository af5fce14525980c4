"""Memory per idle connection over HTTP/2 (TLS) and HTTP/3 (QUIC on ngtcp2), one worker.

    .venv/bin/python bench/idle.py [--idle 8000] [--loop epoll]

Serves the demo site with TLS (1 worker, --idle-timeout 600) and opens ``--idle``
connections of each protocol to it in turn, each making one request (GET /) and then left
idle; reports the worker's RSS growth per connection (/proc/PID/status, after a first
connection of that protocol: the tables it loads once are not counted). HTTP/2: TLS
sockets (ALPN h2) through the ``h2`` library. HTTP/3: aioquic's QUIC connections, all
over one UDP socket (the server tells connections apart by their IDs, not the client's
address), in rounds of ``ROUND`` handshakes. bench/memory.py measures HTTP/1.1's.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import select
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# bench/h2.py is not the h2 library: this folder off the path, the tests' helpers on it
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, os.path.join(ROOT, "tests"))

ROUND = 200      # HTTP/3 handshakes in flight at once
TIMEOUT = 120.0  # seconds a round of HTTP/3 handshakes may take at most


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def start(build: str, loop: str, pki, idle: int):
    p = subprocess.Popen([sys.executable, "-m", "orisha.cli", "serve", build, "--port", "0",
                          "--host", "127.0.0.1", "--workers", "1", "--loop", loop,
                          "--idle-timeout", "600", "--max-connections", str(2 * idle + 100),
                          "--tls-cert", pki.chain, "--tls-key", pki.key],
                         stdout=subprocess.PIPE, text=True, cwd=ROOT)
    line = p.stdout.readline()
    port = int(re.search(r":(\d+)/", line).group(1))
    kids = [int(x) for x in open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()]
    return p, port, kids[0], line


def h2_connection(port: int, ctx: ssl.SSLContext) -> ssl.SSLSocket:
    """One TLS connection that made one h2 request and got its whole answer, left open."""
    import h2.connection
    import h2.events
    s = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=30),
                        server_hostname="localhost")
    assert s.selected_alpn_protocol() == "h2"
    c = h2.connection.H2Connection()
    c.initiate_connection()
    c.send_headers(1, [(":method", "GET"), (":scheme", "https"), (":authority", "localhost"),
                       (":path", "/")], end_stream=True)
    s.sendall(c.data_to_send())
    while True:
        data = s.recv(65536)
        assert data, "closed"
        events = c.receive_data(data)
        s.sendall(c.data_to_send())
        if any(isinstance(e, h2.events.StreamEnded) for e in events):
            return s


def h2_idle(port: int, n: int, pki) -> list:
    ctx = ssl.create_default_context(cafile=pki.ca)
    ctx.set_alpn_protocols(["h2"])
    return [h2_connection(port, ctx) for _ in range(n)]


def h3_idle(port: int, n: int, pki) -> list:
    """``n`` QUIC connections over one UDP socket, each with one h3 request answered."""
    from aioquic.h3.connection import H3_ALPN, H3Connection
    from aioquic.h3.events import DataReceived, HeadersReceived
    from aioquic.quic.configuration import QuicConfiguration
    from aioquic.quic.connection import QuicConnection
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind(("127.0.0.1", 0))
    addr = ("127.0.0.1", port)
    by_cid: dict[bytes, list] = {}
    done = []
    while len(done) < n:
        pending = []
        for _ in range(min(ROUND, n - len(done))):
            config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN,
                                       server_name="localhost", idle_timeout=600)
            config.load_verify_locations(pki.ca)
            q = QuicConnection(configuration=config)
            q.connect(addr, time.time())
            entry = [q, H3Connection(q), False]
            by_cid[q.host_cid] = entry
            pending.append(entry)
        deadline = time.monotonic() + TIMEOUT
        while not all(e[2] for e in pending):
            assert time.monotonic() < deadline, "a round of handshakes took too long"
            now = time.time()
            for q, h3, _ in pending:
                for data, to in q.datagrams_to_send(now):
                    sock.sendto(data, to)
                t = q.get_timer()
                if t is not None and t <= now:
                    q.handle_timer(now)
            if not select.select([sock], [], [], 0.01)[0]:
                continue
            while True:
                try:
                    data, _ = sock.recvfrom(65536, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                cid = data[6:6 + data[5]] if data[0] & 0x80 else data[1:9]
                entry = by_cid.get(cid)
                if entry is None:
                    continue
                q, h3, _ = entry
                q.receive_datagram(data, addr, time.time())
                event = q.next_event()
                while event is not None:
                    if event.__class__.__name__ == "HandshakeCompleted":
                        sid = q.get_next_available_stream_id()
                        h3.send_headers(sid, [(b":method", b"GET"), (b":scheme", b"https"),
                                              (b":authority", b"localhost"), (b":path", b"/")],
                                        end_stream=True)
                    for e in h3.handle_event(event):
                        if isinstance(e, (HeadersReceived, DataReceived)) and e.stream_ended:
                            entry[2] = True
                    event = q.next_event()
                for out, to in q.datagrams_to_send(time.time()):  # its ACKs, whichever round
                    sock.sendto(out, to)
        for q, _, _ in pending:  # the last ACKs out: nothing left for either side to send
            for data, to in q.datagrams_to_send(time.time()):
                sock.sendto(data, to)
        done += pending
    return [sock, done]


def measure(name: str, opener, port: int, worker: int, n: int, pki) -> None:
    first = opener(port, 1, pki)  # the tables a protocol loads once
    time.sleep(1.5)  # past the worker's once-a-second tick
    before = rss_kib(worker)
    t = time.monotonic()
    conns = opener(port, n, pki)
    took = time.monotonic() - t
    time.sleep(1.5)
    after = rss_kib(worker)
    print(f"| {name} | {n:,} | {before:,} → {after:,} KiB | "
          f"{(after - before) * 1024 / n:,.0f} bytes | {took:.0f} s to open |", flush=True)
    del first, conns


def main() -> None:
    from tlsutil import make_pki
    ap = argparse.ArgumentParser()
    ap.add_argument("--idle", type=int, default=8000)
    ap.add_argument("--loop", default="epoll")
    args = ap.parse_args()
    resource.setrlimit(resource.RLIMIT_NOFILE, (args.idle + 1000, args.idle + 1000))
    tmp = tempfile.mkdtemp(prefix="orisha-idle-")
    try:
        pki = make_pki(tmp)
        build = os.path.join(tmp, "build")
        subprocess.run([sys.executable, "-m", "orisha.cli", "build",
                        os.path.join(ROOT, "sites", "demo"), "-o", build], check=True,
                       stdout=subprocess.DEVNULL, cwd=ROOT)
        print(f"one worker, loop {args.loop}; RSS growth per idle connection that made one "
              "request (GET /)\n\n| protocol | connections | worker RSS | per connection | |\n"
              "|---|---:|---:|---:|---|")
        for name, opener in (("HTTP/2 (TLS)", h2_idle), ("HTTP/3 (QUIC, ngtcp2)", h3_idle)):
            p, port, worker, _ = start(build, args.loop, pki, args.idle)
            try:
                measure(name, opener, port, worker, args.idle, pki)
            finally:
                p.terminate()
                p.wait(30)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
