"""Orisha against nginx (and a Python peer), side by side in one run.

Strategy: build a small site (a ~1 KB and a ~13 KB HTML document and a ~1 MB
image) with Orisha, export Orisha's own variants as files for nginx
(gzip_static + brotli_static), verify both servers send byte-identical bodies,
then drive each with wrk in interleaved A/B rounds: 200 connections,
Accept-Encoding: gzip. With one worker the server is pinned to CPU 0 and wrk to
CPU 1. An open-loop run (h2load at a fixed rate, 80% of nginx's measured
maximum, per-request latencies from its log) compares p99 under the same
offered load. Medians per cell; a Markdown table of ratios and a PNG plot.

    ./dev bench            # or: .venv/bin/python bench/bench.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from orisha.server import load_site  # noqa: E402

DOCS = {"1 KB html": "/doc-1k.html", "13 KB html": "/doc-13k.html", "1 MB jpg": "/file-1m.jpg"}


def make_site(path: str) -> None:
    r = random.Random(42)
    words = ("static site server compile response header precompute negotiation cache etag "
             "worker request loop kernel socket buffer").split()

    def html(size: int) -> bytes:
        body = []
        n = 0
        while n < size - 200:
            p = "<p>" + " ".join(r.choice(words) for _ in range(r.randint(8, 20))) + ".</p>\n"
            body.append(p)
            n += len(p)
        return (f"<!doctype html>\n<html><head><meta charset=utf-8><title>bench</title></head>"
                f"<body>\n{''.join(body)}</body></html>\n").encode()

    os.makedirs(path)
    open(os.path.join(path, "doc-1k.html"), "wb").write(html(1024))
    open(os.path.join(path, "doc-13k.html"), "wb").write(html(13 * 1024))
    open(os.path.join(path, "file-1m.jpg"), "wb").write(bytes(r.getrandbits(8) for _ in range(1 << 20)))


def export_for_nginx(build: str, root: str) -> None:
    """Write Orisha's own variants as files: identity, .gz and .br siblings."""
    site = load_site(build)
    suffix = {b"identity": "", b"gzip": ".gz", b"br": ".br"}
    for key, entry in site.routes.items():
        if not key.endswith((b".html", b".jpg")) or entry.__class__.__name__ != "Entry":
            continue
        for v in entry.variants:
            if v.coding in suffix:
                dest = os.path.join(root, key.decode().lstrip("/") + suffix[v.coding])
                with open(dest, "wb") as f:
                    f.write(bytes(v.body))


NGINX_CONF = """
worker_processes {workers};
daemon off;
error_log {dir}/error.log warn;
pid {dir}/nginx.pid;
load_module /usr/lib/nginx/modules/ngx_http_brotli_static_module.so;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  sendfile on; tcp_nopush on; tcp_nodelay on;
  keepalive_requests 10000000; keepalive_timeout 75s;
  open_file_cache max=1000 inactive=60s; open_file_cache_valid 600s;
  gzip_static on; brotli_static on;
  types {{ text/html html; image/jpeg jpg; }}
  server {{ listen 127.0.0.1:{port} reuseport; root {root}; }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 15) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


class Proc:
    def __init__(self, name: str, cmd: list[str], port: int, cpus: str | None, env=None) -> None:
        self.name, self.port = name, port
        if cpus:
            cmd = ["taskset", "-c", cpus, *cmd]
        self.p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  env=env, start_new_session=True)
        wait_port(port)

    def stop(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGTERM)
            self.p.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.p.pid, signal.SIGKILL)


def fetch(port: int, path: str, encoding: str = "gzip") -> bytes:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Accept-Encoding": encoding})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read()


def wrk(port: int, path: str, seconds: float, cpus: str | None, conns: int = 200) -> dict:
    cmd = ["wrk", "-t1" if cpus else "-t2", f"-c{conns}", f"-d{seconds:g}s", "--latency",
           "-H", "Accept-Encoding: gzip", f"http://127.0.0.1:{port}{path}"]
    if cpus:
        cmd = ["taskset", "-c", cpus, *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))

    def ms(label):
        m = re.search(rf"\s{label}%\s+([\d.]+)(us|ms|s)\b", out)
        v = float(m.group(1))
        return v / 1000 if m.group(2) == "us" else v * 1000 if m.group(2) == "s" else v

    errors = re.search(r"Non-2xx or 3xx responses: (\d+)|Socket errors: (.*)", out)
    return {"rps": rps, "p50": ms("50"), "p99": ms("99"), "errors": errors.group(0) if errors else ""}


def h2load(port: int, path: str, rate: float, seconds: float, cpus: str | None, tmp: str) -> dict:
    """Open loop: 100 clients at rate/100 req/s each; latency percentiles from the per-request log."""
    log = os.path.join(tmp, "h2load.log")
    clients = 100
    cmd = ["h2load", "--h1", "-c", str(clients), "--rps", f"{rate / clients:.1f}", "-D", str(int(seconds)),
           "-H", "Accept-Encoding: gzip", "--log-file", log, f"http://127.0.0.1:{port}{path}"]
    if cpus:
        cmd = ["taskset", "-c", cpus, *cmd]
    subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    lat = sorted(int(line.split("\t")[2]) / 1000 for line in open(log) if line.strip())
    os.unlink(log)
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]
    return {"rps": len(lat) / seconds, "p50": q(0.50), "p99": q(0.99)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="1 round of 3 s (a smoke run, not a result)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--loops", default="epoll,io-uring,asyncio")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.seconds = 1, 3
    loops = args.loops.split(",")
    ncpu = os.cpu_count() or 1
    tmp = tempfile.mkdtemp(prefix="orisha-bench-")
    os.chmod(tmp, 0o755)  # nginx workers run as www-data
    site, build, root = (os.path.join(tmp, d) for d in ("site", "build", "nginx-root"))
    make_site(site)
    subprocess.run([sys.executable, "-m", "orisha.cli", "build", site, "-o", build], check=True,
                   cwd=ROOT, stdout=subprocess.DEVNULL)
    os.makedirs(root)
    export_for_nginx(build, root)
    os.makedirs(args.out, exist_ok=True)
    results: dict = {}

    def start(server: str, workers: int, cpus: str | None) -> Proc:
        port = free_port()
        if server == "nginx":
            d = tempfile.mkdtemp(dir=tmp)
            conf = os.path.join(d, "nginx.conf")
            open(conf, "w").write(NGINX_CONF.format(workers=workers, dir=d, port=port, root=root))
            return Proc(server, ["nginx", "-c", conf, "-e", os.path.join(d, "error.log")], port, cpus)
        if server == "aiohttp":
            return Proc(server, [sys.executable, os.path.join(HERE, "peer_aiohttp.py"), root, str(port)], port, cpus)
        loop = server.split(":")[1]
        return Proc(server, [sys.executable, "-m", "orisha.cli", "serve", build, "--port", str(port),
                             "--workers", str(workers), "--loop", loop], port, cpus)

    servers = ["nginx"] + [f"orisha:{l}" for l in loops] + ["aiohttp"]
    for workers in (1, ncpu):
        cpus_server, cpus_load = ("0", "1") if workers == 1 else (None, None)
        procs = {s: start(s, workers, cpus_server) for s in servers}
        try:
            for label, path in DOCS.items():  # verify bytes before timing anything
                ref = fetch(procs["orisha:" + loops[0]].port, path)
                for s, p in procs.items():
                    assert fetch(p.port, path) == ref, f"{s} sends different bytes for {path}"
                    assert fetch(p.port, path, "br") == fetch(procs["nginx"].port, path, "br")
            for label, path in DOCS.items():
                for rnd in range(args.rounds):
                    order = servers[:] if rnd % 2 == 0 else servers[::-1]  # interleaved A/B
                    for s in order:
                        r = wrk(procs[s].port, path, args.seconds, cpus_load)
                        results.setdefault(f"{workers}|{label}|{s}", []).append(r)
                        print(f"workers={workers} {label:10} {s:16} {r['rps']:>10,.0f} req/s "
                              f"p50 {r['p50']:.2f} ms p99 {r['p99']:.2f} ms {r['errors']}", flush=True)
            if workers == 1 and shutil.which("h2load"):
                path = DOCS["1 KB html"]
                nginx_max = statistics.median(r["rps"] for r in results["1|1 KB html|nginx"])
                rate = 0.8 * nginx_max
                for rnd in range(args.rounds):
                    for s in (servers if rnd % 2 == 0 else servers[::-1]):
                        if s == "aiohttp":
                            continue
                        r = h2load(procs[s].port, path, rate, args.seconds, cpus_load, tmp)
                        results.setdefault(f"open|1 KB html @ {rate:,.0f}/s|{s}", []).append(r)
                        print(f"open loop {rate:,.0f}/s {s:16} served {r['rps']:,.0f}/s p50 {r['p50']:.2f} ms "
                              f"p99 {r['p99']:.2f} ms", flush=True)
        finally:
            for p in procs.values():
                p.stop()
    report(results, servers, args, ncpu)
    shutil.rmtree(tmp, ignore_errors=True)


def med(rs: list[dict], k: str) -> float:
    return statistics.median(r[k] for r in rs)


def report(results: dict, servers: list[str], args, ncpu: int) -> None:
    cells = sorted({k.rsplit("|", 1)[0] for k in results}, key=lambda c: (c.split("|")[0] == "open", c))
    lines = [f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {ncpu} cores, "
             f"{args.rounds} interleaved rounds of {args.seconds:g} s, wrk -c200, Accept-Encoding: gzip; "
             "medians. Ratio = Orisha / nginx.", "",
             "| workers | document | server | req/s | p50 ms | p99 ms | req/s ratio | p99 ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for cell in cells:
        w, doc = cell.split("|")
        base = results.get(f"{cell}|nginx")
        for s in servers:
            rs = results.get(f"{cell}|{s}")
            if not rs:
                continue
            rps, p50, p99 = med(rs, "rps"), med(rs, "p50"), med(rs, "p99")
            ratio = f"{rps / med(base, 'rps'):.2f}×" if base and s != "nginx" else ""
            p99r = f"{p99 / med(base, 'p99'):.2f}×" if base and s != "nginx" else ""
            lines.append(f"| {w} | {doc} | {s} | {rps:,.0f} | {p50:.2f} | {p99:.2f} | {ratio} | {p99r} |")
    table = "\n".join(lines)
    print("\n" + table)
    open(os.path.join(args.out, "results.md"), "w").write(table + "\n")
    json.dump(results, open(os.path.join(args.out, "results.json"), "w"), indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    closed = [c for c in cells if not c.startswith("open")]
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / len(servers)
    for i, s in enumerate(servers):
        ys = [med(results[f"{c}|{s}"], "rps") if f"{c}|{s}" in results else 0 for c in closed]
        ax.bar([x + i * width for x in range(len(closed))], ys, width, label=s)
    ax.set_xticks([x + width * (len(servers) - 1) / 2 for x in range(len(closed))])
    ax.set_xticklabels([c.replace("|", " worker(s)\n") for c in closed], fontsize=8)
    ax.set_ylabel("requests/s (median)")
    ax.set_title("Orisha vs nginx, same machine, same bytes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "results.png"), dpi=110)
    print(f"wrote {args.out}/results.md, results.json, results.png")


if __name__ == "__main__":
    main()
