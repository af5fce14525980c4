"""A bounded soak: mixed load and hostile clients for N minutes, worker RSS sampled.

    .venv/bin/python bench/soak.py [--minutes 10] [--loop epoll]

wrk drives a rotating mix (every encoding, 404s, redirects, ranges, 405s,
conditionals, a 1.2 MB file) on 50 keep-alive connections while a Python
thread keeps sending malformed requests, slowloris heads and mid-response
resets. Worker RSS is sampled every 10 s; growth is measured from the end of
the first minute (caches warm) to the end. Prints one summary line.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LUA = r"""
local reqs = {}
init = function(args)
  local paths = {"/", "/css/site.css", "/files/big.txt", "/nope", "/docs", "/data/planets.json",
                 "/files/caf%C3%A9%20men%C3%BC.txt", "/img/pixel.png"}
  local encs = {"gzip", "br", "zstd", "identity", "gzip, br, zstd"}
  for _, p in ipairs(paths) do for _, e in ipairs(encs) do
    reqs[#reqs + 1] = wrk.format("GET", p, {["Accept-Encoding"] = e})
  end end
  reqs[#reqs + 1] = wrk.format("GET", "/files/big.txt", {["Range"] = "bytes=100-200"})
  reqs[#reqs + 1] = wrk.format("GET", "/css/site.css", {["If-None-Match"] = "*"})
  reqs[#reqs + 1] = wrk.format("POST", "/", nil, "body")
end
local i = 0
request = function() i = i + 1; return reqs[(i % #reqs) + 1] end
"""
BAD = [b"GET / HTTP/1.1\r\nHost: x\r\nX: a\r\n b\r\n\r\n", b"GET / HTTP/2.0\r\n\r\n",
       b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
       b"\x00\x01\x02garbage\r\n\r\n", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n"]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))


def hostile(port: int, stop: threading.Event, counts: dict) -> None:
    r = random.Random(1)
    while not stop.is_set():
        kind = r.choice(["bad", "loris", "reset"])
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if kind == "bad":
                s.sendall(r.choice(BAD + [b"HEAD / HTTP/1.0\r\n\r\n"]))  # (wrk cannot frame HEAD)
                s.recv(65536)
            elif kind == "loris":
                s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            else:
                s.sendall(b"GET /files/big.txt HTTP/1.1\r\nHost: x\r\n\r\n")
                s.recv(1000)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
            counts[kind] = counts.get(kind, 0) + 1
        except OSError:
            counts["errors"] = counts.get("errors", 0) + 1
        time.sleep(0.02)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--loop", default="epoll")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="orisha-soak-")
    build = os.path.join(tmp, "build")
    subprocess.run([sys.executable, "-m", "orisha.cli", "build", os.path.join(ROOT, "sites", "demo"), "-o", build],
                   check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    lua = os.path.join(tmp, "mix.lua")
    open(lua, "w").write(LUA)
    srv = subprocess.Popen([sys.executable, "-m", "orisha.cli", "serve", build, "--port", "0", "--workers", "2",
                            "--loop", args.loop], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    port = int(re.search(r":(\d+)/", srv.stdout.readline()).group(1))
    workers = [int(p) for p in open(f"/proc/{srv.pid}/task/{srv.pid}/children").read().split()]
    seconds = int(args.minutes * 60)
    stop, counts = threading.Event(), {}
    t = threading.Thread(target=hostile, args=(port, stop, counts))
    t.start()
    wrk = subprocess.Popen(["wrk", "-t2", "-c50", f"-d{seconds}s", "-s", lua, f"http://127.0.0.1:{port}/"],
                           stdout=subprocess.PIPE, text=True)
    samples = []
    start = time.monotonic()
    while wrk.poll() is None:
        time.sleep(10)
        samples.append((time.monotonic() - start, sum(rss_kib(p) for p in workers)))
    stop.set()
    t.join()
    out = wrk.stdout.read()
    alive = all(os.path.exists(f"/proc/{p}") for p in workers)
    srv.terminate()
    srv.wait(20)
    warm = next((kib for at, kib in samples if at >= 60), samples[0][1])
    end = samples[-1][1]
    reqs = re.search(r"(\d+) requests in", out).group(1)
    print(f"soak {args.minutes:g} min, loop {args.loop}: {reqs} requests, hostile {counts}, "
          f"worker RSS {warm} KiB after 1 min -> {end} KiB at the end ({(end - warm) / warm:+.1%}), "
          f"workers alive: {alive}, original workers still serving: {alive}")


if __name__ == "__main__":
    main()
