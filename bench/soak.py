"""A bounded soak: mixed load, hostile clients and reload storms for N minutes, RSS sampled.

    .venv/bin/python bench/soak.py [--minutes 10] [--loop epoll] [--storms 12]

wrk drives a rotating mix (every encoding, 404s, redirects, ranges, 405s,
conditionals, a 1.2 MB file) on 50 keep-alive connections while a Python
thread keeps sending malformed requests, slowloris heads and mid-response
resets. Reload storms: every ``--storm-every`` seconds a burst of SIGHUPs
(``--burst``, 20 ms apart) hits the supervisor, at most ``--storms`` times and
never in the last 20 s (so the end sample is of a settled server). A probe
thread asks ``/readyz`` on the admin port every 0.5 s. RSS (supervisor, and per
worker) is sampled every 10 s; growth is measured from the end of the first
minute (caches warm) to the end, on samples taken when no generation was
draining. Everything stays on loopback. Prints a summary.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
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


def storms(pid: int, args, stop: threading.Event, sent: list[int]) -> None:
    """Bursts of SIGHUP at the supervisor, bounded in count and in time."""
    end = time.monotonic() + args.minutes * 60 - 20
    while len(sent) < args.storms and not stop.wait(args.storm_every):
        if time.monotonic() > end:
            return
        for _ in range(args.burst):
            os.kill(pid, signal.SIGHUP)
            time.sleep(0.02)
        sent.append(args.burst)


def probe(admin: int, stop: threading.Event, counts: dict) -> None:
    """GET /readyz every 0.5 s: 200s, other statuses, failures to answer."""
    while not stop.wait(0.5):
        try:
            with socket.create_connection(("127.0.0.1", admin), timeout=2) as s:
                s.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
                status = s.recv(64).split(b" ")[1].decode()
        except (OSError, IndexError):
            status = "no answer"
        counts[status] = counts.get(status, 0) + 1


def metric(admin: int, name: str) -> int:
    with socket.create_connection(("127.0.0.1", admin), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return sum(int(line.split()[-1]) for line in data.decode().splitlines()
               if line.startswith(f"orisha_{name}"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--loop", default="epoll")
    ap.add_argument("--storms", type=int, default=12, help="Reload storms at most (0: none).")
    ap.add_argument("--storm-every", type=float, default=10, help="Seconds between storms.")
    ap.add_argument("--burst", type=int, default=5, help="SIGHUPs per storm.")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="orisha-soak-")
    build = os.path.join(tmp, "build")
    subprocess.run([sys.executable, "-m", "orisha.cli", "build", os.path.join(ROOT, "sites", "demo"), "-o", build],
                   check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    lua = os.path.join(tmp, "mix.lua")
    open(lua, "w").write(LUA)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        admin = s.getsockname()[1]
    err = open(os.path.join(tmp, "stderr"), "w+")
    srv = subprocess.Popen([sys.executable, "-m", "orisha.cli", "serve", build, "--port", "0", "--workers", "2",
                            "--loop", args.loop, "--admin-port", str(admin)],
                           stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
    port = int(re.search(r":(\d+)/", srv.stdout.readline()).group(1))
    seconds = int(args.minutes * 60)
    stop, counts, probes, sent = threading.Event(), {}, {}, []
    threads = [threading.Thread(target=hostile, args=(port, stop, counts)),
               threading.Thread(target=probe, args=(admin, stop, probes)),
               threading.Thread(target=storms, args=(srv.pid, args, stop, sent))]
    for t in threads:
        t.start()
    wrk = subprocess.Popen(["wrk", "-t2", "-c50", f"-d{seconds}s", "-s", lua, f"http://127.0.0.1:{port}/"],
                           stdout=subprocess.PIPE, text=True)
    samples = sample_until(wrk, srv.pid)
    stop.set()
    for t in threads:
        t.join()
    out = wrk.stdout.read()
    alive = srv.poll() is None
    reloads = metric(admin, "reloads_total") if alive else -1
    srv.terminate()
    code = srv.wait(60)
    time.sleep(1)
    left = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).find(build) >= 0]
    err.seek(0)
    log = err.read()
    report(args, out, counts, probes, sent, reloads, samples, alive, code, left, log)


def sample_until(wrk: subprocess.Popen, pid: int) -> list[tuple[float, int, list[int]]]:
    """Every 10 s until wrk exits: (time, supervisor RSS, RSS of each worker) in KiB."""
    samples = []
    start = time.monotonic()
    while wrk.poll() is None:
        time.sleep(10)
        kids = []
        for p in open(f"/proc/{pid}/task/{pid}/children").read().split():
            try:
                kids.append(rss_kib(int(p)))
            except (OSError, StopIteration):  # exited meanwhile
                pass
        samples.append((time.monotonic() - start, rss_kib(pid), kids))
    return samples


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def report(args, out, counts, probes, sent, reloads, samples, alive, code, left, log) -> None:
    settled = [(at, sup, kids) for at, sup, kids in samples if len(kids) == 2] or samples
    warm = next((x for x in settled if x[0] >= 60), settled[0])
    end = settled[-1]
    per = [sum(k) // max(1, len(k)) for _, _, k in (warm, end)]
    reqs = re.search(r"(\d+) requests in", out).group(1)
    errors = re.search(r"Socket errors: (.*)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    print(f"soak {args.minutes:g} min, loop {args.loop}: {reqs} requests "
          f"(socket errors: {errors.group(1) if errors else 'none'}; "
          f"non-2xx/3xx: {non2xx.group(1) if non2xx else 0}, the mix has 404s and 405s), "
          f"hostile {counts}")
    print(f"reload storms: {len(sent)} x {args.burst} SIGHUP = {sum(sent)} signals, {reloads} reloads, "
          f"{log.count('reload deferred')} deferred, {log.count('Traceback')} tracebacks; "
          f"/readyz answers {probes}; max processes under the supervisor "
          f"{max((len(k) for _, _, k in samples), default=0)}")
    print(f"supervisor RSS {warm[1]} KiB after 1 min -> {end[1]} KiB at the end "
          f"({(end[1] - warm[1]) / warm[1]:+.1%}); per worker {per[0]} -> {per[1]} KiB "
          f"({(per[1] - per[0]) / max(1, per[0]):+.1%}); supervisor alive: {alive}, "
          f"exit {code} on SIGTERM, processes left: {len(left)}")


if __name__ == "__main__":
    main()
