"""HTTPS and HTTP/2: Orisha against nginx (`listen ... ssl http2`), same certificate, same bytes.

Strategy: bench/bench.py's site (a ~1 KB and a ~13 KB HTML document) is built
with Orisha and exported as files for nginx (gzip_static), a test CA and leaf
are made with the openssl CLI (tests/tlsutil.py), and both servers run one
worker pinned to CPU 0 while h2load runs pinned to CPU 1. Bodies are checked
byte-identical over https first. Then, in interleaved rounds, per server:

  h2 1 KB / 13 KB   h2load -c 10 -m 10 for --seconds (after a warm-up): req/s
                    and the server's CPU time per request (utime+stime of every
                    process of its session, from /proc, over the timed run);
  https/1.1 1 KB    the same with h2load --h1 (ALPN http/1.1, 10 connections);
  handshakes/s      h2load -c N -n N: every connection makes one TLS 1.3 full
                    handshake and one request; connections per second and
                    server CPU per connection.

Medians over the rounds and the ratio Orisha/nginx are printed as a table.

    .venv/bin/python bench/h2.py [--seconds 5] [--rounds 3] [--loop epoll]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import bench as B  # noqa: E402  (bench/bench.py: the site, nginx export, Proc with /proc CPU)
from tlsutil import make_pki  # noqa: E402

DOCS = {"1 KB": "/doc-1k.html", "13 KB": "/doc-13k.html"}
NGINX_CONF = """
worker_processes 1;
daemon off;
error_log {dir}/error.log warn;
pid {dir}/nginx.pid;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  sendfile on; tcp_nopush on; tcp_nodelay on;
  keepalive_requests 10000000; keepalive_timeout 75s;
  open_file_cache max=1000 inactive=60s; open_file_cache_valid 600s;
  gzip_static on;
  types {{ text/html html; image/jpeg jpg; }}
  ssl_certificate {cert}; ssl_certificate_key {key};
  ssl_protocols TLSv1.2 TLSv1.3; ssl_session_tickets on;
  http2_max_requests 10000000;
  server {{ listen 127.0.0.1:{port} ssl http2 reuseport; root {root}; }}
}}
"""


def h2load(port: int, path: str, args: list[str]) -> dict:
    cmd = ["taskset", "-c", "1", "h2load", "-H", "accept-encoding: gzip", *args,
           f"https://127.0.0.1:{port}{path}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    m = re.search(r"finished in ([\d.]+)(m?s), ([\d.]+) req/s", out)
    done = re.search(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed",
                     out)
    if not m or not done or int(done.group(3)):
        raise RuntimeError(f"h2load failed: {out[-800:]}")
    secs = float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)
    return {"rps": float(m.group(3)), "done": int(done.group(2)), "secs": secs}


def curl_body(port: int, path: str, ca: str) -> bytes:
    return subprocess.run(["curl", "-sS", "--http2", "--cacert", ca, "-H", "accept-encoding: gzip",
                           f"https://localhost:{port}{path}"], capture_output=True, check=True,
                          timeout=30).stdout


def start(server: str, tmp: str, build: str, root: str, pki, loop: str) -> "B.Proc":
    port = B.free_port()
    if server == "nginx":
        d = tempfile.mkdtemp(dir=tmp)
        conf = os.path.join(d, "nginx.conf")
        with open(conf, "w") as f:
            f.write(NGINX_CONF.format(dir=d, port=port, root=root, cert=pki.chain, key=pki.key))
        return B.Proc(server, ["nginx", "-c", conf, "-e", os.path.join(d, "error.log")], port, "0")
    return B.Proc(server, [sys.executable, "-m", "orisha.cli", "serve", build, "--port", str(port),
                           "--workers", "1", "--loop", loop, "--tls-cert", pki.chain,
                           "--tls-key", pki.key], port, "0")


def measure(p: "B.Proc", path: str, args: list[str]) -> dict:
    if "-D" in args:  # warm up untimed: h2load's own warm-up would count in the CPU window
        h2load(p.port, path, ["-c", "10", "-m", "10", "-D", "1"])
    before = p.cpu()
    r = h2load(p.port, path, args)
    r["cpu_us"] = (p.cpu() - before) / max(r["done"], 1) * 1e6
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loop", default="epoll")
    ap.add_argument("--handshakes", type=int, default=400, help="connections per handshake run")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="orisha-bench-h2-")
    os.chmod(tmp, 0o755)  # nginx workers run as www-data
    site, build, root = (os.path.join(tmp, d) for d in ("site", "build", "nginx-root"))
    B.make_site(site)
    subprocess.run([sys.executable, "-m", "orisha.cli", "build", site, "-o", build], check=True,
                   capture_output=True, cwd=ROOT)
    os.makedirs(root)
    B.export_for_nginx(build, root)
    pki = make_pki(os.path.join(tmp, "pki"))
    os.chmod(pki.key, 0o644)
    servers = ["nginx", f"orisha:{args.loop}"]
    procs = {s: start(s, tmp, build, root, pki, args.loop) for s in servers}
    results: dict[str, list[dict]] = {}
    try:
        for path in DOCS.values():
            a, b = (curl_body(procs[s].port, path, pki.ca) for s in servers)
            assert a == b, f"{path}: the servers send different bytes"
        timed = ["-c", "10", "-m", "10", "-D", f"{args.seconds:g}"]
        hs = ["-c", str(args.handshakes), "-n", str(args.handshakes), "-m", "1"]
        for rnd in range(args.rounds):
            for s in servers if rnd % 2 == 0 else servers[::-1]:  # interleaved A/B
                for name, path in DOCS.items():
                    results.setdefault(f"h2 {name}|{s}", []).append(measure(procs[s], path, timed))
                results.setdefault(f"https/1.1 1 KB|{s}", []).append(  # the same over HTTP/1.1
                    measure(procs[s], DOCS["1 KB"], ["--h1", "-c", "10", *timed[4:]]))
                results.setdefault(f"handshakes|{s}", []).append(measure(procs[s], DOCS["1 KB"], hs))
    finally:
        for p in procs.values():
            p.stop()
    report(results, servers, args)


def report(results: dict, servers: list[str], args) -> None:
    med = lambda cell, k: statistics.median(r[k] for r in results[cell])  # noqa: E731
    print(f"\nOne worker each on CPU 0, h2load on CPU 1; medians of {args.rounds} rounds; "
          f"TLS 1.3, ALPN h2, Accept-Encoding: gzip.\n")
    print("| run | server | req/s (or conn/s) | server CPU µs per request | ratio to nginx (req/s) |")
    print("|---|---|---:|---:|---:|")
    for run in [f"h2 {n}" for n in DOCS] + ["https/1.1 1 KB", "handshakes"]:
        base = med(f"{run}|nginx", "rps") if run != "handshakes" else \
            args.handshakes / med(f"{run}|nginx", "secs")
        for s in servers:
            cell = f"{run}|{s}"
            rate = med(cell, "rps") if run != "handshakes" else args.handshakes / med(cell, "secs")
            print(f"| {run} | {s} | {rate:,.0f} | {med(cell, 'cpu_us'):,.1f} | {rate / base:.2f} |")


if __name__ == "__main__":
    main()
