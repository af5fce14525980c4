"""Orisha against nginx (and a Python peer), side by side in one run.

Strategy: build a small site (a ~1 KB and a ~13 KB HTML document and a ~1 MB
image) with Orisha, export Orisha's own variants as files for nginx
(gzip_static + brotli_static), verify both servers send byte-identical bodies,
then drive each with wrk in interleaved A/B rounds: 200 connections,
Accept-Encoding: gzip. With one worker the server is pinned to CPU 0 and wrk to
CPU 1. Each Orisha loop runs twice: its compiled body (setup.py) and, with
ORISHA_PURE=1, its pure-Python one; bench/floor.py (a Python epoll loop that
sends one constant per request) is the floor line. Per run: req/s, p50/p99,
the server's CPU time per request (utime+stime of all its processes, from
/proc, over the timed run) and the load generator's CPU busy fraction (wrk's
rusage / wall time: near 1.0 means wrk, not the server, was the limit). An
open-loop run (h2load at a fixed rate, 80% of nginx's measured maximum,
per-request latencies from its log) compares p99 under the same offered load.
Medians per cell; a Markdown table of ratios and a PNG of ratios to nginx.
``orisha:LOOP:sites`` (``--sites``) is the same build served as the first of two
sites (``--site 127.0.0.1=BUILD --site other.test=BUILD2``, wrk's Host names the
first), beside ``orisha:LOOP`` serving it alone: what a host table costs (issue 21).

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

from orisha.serving.server import load_site  # noqa: E402

DOCS = {"1 KB html": "/doc-1k.html", "13 KB html": "/doc-13k.html", "1 MB jpg": "/file-1m.jpg"}
# The floor (bench/floor.py) sends its constant with one send: small documents only.
FLOOR_DOCS = ("1 KB html", "13 KB html")


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

    def cpu(self) -> float:
        """Seconds of CPU (user + system) used so far by every process of this server
        (its session: the supervisor or master and all its workers, threads included)."""
        ticks = 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # exited while listing
                continue
            if int(fields[3]) == self.p.pid:  # field 6, session id (fields[0] is field 3)
                ticks += int(fields[11]) + int(fields[12])
        return ticks / os.sysconf("SC_CLK_TCK")


def fetch(port: int, path: str, encoding: str = "gzip") -> bytes:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Accept-Encoding": encoding})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200, f"{port}{path}: {r.status}"
        return r.read()


def wrk(port: int, path: str, seconds: float, cpus: str | None, conns: int = 200,
        server: Proc | None = None) -> dict:
    cmd = ["wrk", "-t1" if cpus else "-t2", f"-c{conns}", f"-d{seconds:g}s", "--latency",
           "-H", "Accept-Encoding: gzip", f"http://127.0.0.1:{port}{path}"]
    if cpus:
        cmd = ["taskset", "-c", cpus, *cmd]
    before = server.cpu() if server else 0.0
    start = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = p.stdout.read()
    _, _, usage = os.wait4(p.pid, 0)
    wall = time.monotonic() - start
    server_cpu = (server.cpu() - before) if server else 0.0
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    total = int(re.search(r"(\d+) requests in", out).group(1))

    def ms(label):
        m = re.search(rf"\s{label}%\s+([\d.]+)(us|ms|s)\b", out)
        v = float(m.group(1))
        return v / 1000 if m.group(2) == "us" else v * 1000 if m.group(2) == "s" else v

    errors = re.search(r"Non-2xx or 3xx responses: (\d+)|Socket errors: (.*)", out)
    return {"rps": rps, "p50": ms("50"), "p99": ms("99"), "errors": errors.group(0) if errors else "",
            # server CPU per request (µs) and the load generator's busy fraction
            "cpu_us": server_cpu / max(total, 1) * 1e6,
            "wrk_busy": (usage.ru_utime + usage.ru_stime) / wall}


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
    ap.add_argument("--loops", default="epoll,io-uring",
                    help="Orisha loops; each runs compiled and pure (ORISHA_PURE=1)")
    ap.add_argument("--peers", default="floor", help="also: aiohttp (comma-separated; '' for none)")
    ap.add_argument("--workers", default="1", help="worker counts to run, e.g. 1,2")
    ap.add_argument("--open-loop", action="store_true", help="also the h2load fixed-rate run")
    ap.add_argument("--sites", default="epoll",
                    help="loops whose compiled body also serves the build as one of two sites "
                         "(comma-separated; '' for none)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"))
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
    other = os.path.join(tmp, "other")  # the second site of orisha:LOOP:sites
    os.makedirs(os.path.join(tmp, "other-site"))
    open(os.path.join(tmp, "other-site", "index.html"), "w").write("<h1>other</h1>\n")
    subprocess.run([sys.executable, "-m", "orisha.cli", "build", os.path.join(tmp, "other-site"),
                    "-o", other], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    os.makedirs(root)
    export_for_nginx(build, root)
    os.makedirs(args.out, exist_ok=True)
    results: dict = {}

    floor_body = os.path.join(tmp, "floor-body")

    def start(server: str, workers: int, cpus: str | None) -> Proc:
        port = free_port()
        if server == "floor":
            return Proc(server, [sys.executable, os.path.join(HERE, "floor.py"), str(port), floor_body],
                        port, cpus)
        if server == "nginx":
            d = tempfile.mkdtemp(dir=tmp)
            conf = os.path.join(d, "nginx.conf")
            open(conf, "w").write(NGINX_CONF.format(workers=workers, dir=d, port=port, root=root))
            return Proc(server, ["nginx", "-c", conf, "-e", os.path.join(d, "error.log")], port, cpus)
        if server == "aiohttp":
            return Proc(server, [sys.executable, os.path.join(HERE, "peer_aiohttp.py"), root, str(port)], port, cpus)
        _, loop, *flags = server.split(":")
        env = {**os.environ, "ORISHA_PURE": "1" if "pure" in flags else ""}
        # wrk's Host (127.0.0.1:PORT) names the first site exactly
        served = (["--site", f"127.0.0.1={build}", "--site", f"other.test={other}"]
                  if "sites" in flags else [build])
        return Proc(server, [sys.executable, "-m", "orisha.cli", "serve", *served, "--port", str(port),
                             "--workers", str(workers), "--loop", loop], port, cpus, env=env)

    peers = [p for p in args.peers.split(",") if p]
    servers = (["nginx"] + [f"orisha:{l}{v}" for l in loops for v in ("", ":pure")]
               + [f"orisha:{l}:sites" for l in args.sites.split(",") if l]
               + [p for p in peers if p != "floor"])
    for workers in [int(w) for w in args.workers.split(",")]:
        if "floor" in peers and workers == 1:  # one process: the floor is a single-worker line
            servers_now = servers + ["floor"]
        else:
            servers_now = servers
        cpus_server, cpus_load = ("0", "1") if workers == 1 else (None, None)
        procs = {}
        try:
            procs = {s: start(s, workers, cpus_server) for s in servers_now if s != "floor"}
            for label, path in DOCS.items():
                ref = fetch(procs["orisha:" + loops[0]].port, path)
                for s, p in procs.items():
                    assert fetch(p.port, path) == ref, f"{s} sends different bytes for {path}"
                    assert fetch(p.port, path, "br") == fetch(procs["nginx"].port, path, "br")
            for label, path in DOCS.items():
                if "floor" in servers_now and label in FLOOR_DOCS:  # the floor sends this doc's bytes
                    open(floor_body, "wb").write(fetch(procs["nginx"].port, path))
                    procs["floor"] = start("floor", 1, cpus_server)
                cell = [s for s in servers_now if s in procs]
                for rnd in range(args.rounds):
                    order = cell[:] if rnd % 2 == 0 else cell[::-1]  # interleaved A/B
                    for s in order:
                        r = wrk(procs[s].port, path, args.seconds, cpus_load, server=procs[s])
                        results.setdefault(f"{workers}|{label}|{s}", []).append(r)
                        print(f"workers={workers} {label:10} {s:20} {r['rps']:>9,.0f} req/s "
                              f"p50 {r['p50']:.2f} ms p99 {r['p99']:.2f} ms cpu {r['cpu_us']:6.1f} µs/req "
                              f"wrk busy {r['wrk_busy']:.2f} {r['errors']}", flush=True)
                if "floor" in procs:
                    procs.pop("floor").stop()
            if workers == 1 and args.open_loop and shutil.which("h2load"):
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
    servers = servers + ["floor"]
    cells = sorted({k.rsplit("|", 1)[0] for k in results}, key=lambda c: (c.split("|")[0] == "open", c))
    lines = [f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {ncpu} cores shared with other "
             f"work (noisy), {args.rounds} interleaved rounds of {args.seconds:g} s, wrk -c200, "
             "Accept-Encoding: gzip; medians. One worker: server on CPU 0, wrk on CPU 1. "
             "CPU µs/req = utime+stime of all the server's processes over the run / requests. "
             "Ratios are to nginx (CPU: lower is better). `:pure` = ORISHA_PURE=1; `:sites` = "
             "the build as the first of two --site sites; floor = bench/floor.py.", "",
             "| workers | document | server | req/s | p50 ms | p99 ms | CPU µs/req | wrk busy "
             "| req/s ratio | CPU ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for cell in cells:
        w, doc = cell.split("|")
        base = results.get(f"{cell}|nginx")
        for s in servers:
            rs = results.get(f"{cell}|{s}")
            if not rs:
                continue
            rps, p50, p99 = med(rs, "rps"), med(rs, "p50"), med(rs, "p99")
            cpu = f"{med(rs, 'cpu_us'):.1f}" if "cpu_us" in rs[0] else ""
            busy = f"{med(rs, 'wrk_busy'):.2f}" if "wrk_busy" in rs[0] else ""
            ratio = f"{rps / med(base, 'rps'):.2f}×" if base and s != "nginx" else ""
            cpur = (f"{med(rs, 'cpu_us') / med(base, 'cpu_us'):.2f}×"
                    if base and s != "nginx" and cpu and med(base, "cpu_us") else "")
            lines.append(f"| {w} | {doc} | {s} | {rps:,.0f} | {p50:.2f} | {p99:.2f} | {cpu} | {busy} "
                         f"| {ratio} | {cpur} |")
    lines += _sites_vs_one(results, servers, cells)
    table = "\n".join(lines)
    print("\n" + table)
    os.makedirs(args.out, exist_ok=True)
    open(os.path.join(args.out, "results.md"), "w").write(table + "\n")
    json.dump(results, open(os.path.join(args.out, "results.json"), "w"), indent=1)
    plot(results, servers, cells, args.out)


def _sites_vs_one(results: dict, servers: list[str], cells: list[str]) -> list[str]:
    """Each ``orisha:LOOP:sites`` against ``orisha:LOOP`` (one build, no host table)."""
    pairs = [(s, s.removesuffix(":sites")) for s in servers if s.endswith(":sites")]
    rows = [f"| {cell.replace('|', ' | ')} | {s} | {med(a, 'rps') / med(b, 'rps'):.3f}× "
            f"| {med(a, 'cpu_us') / med(b, 'cpu_us'):.3f}× |"
            for cell in cells for s, one in pairs
            if (a := results.get(f"{cell}|{s}")) and (b := results.get(f"{cell}|{one}"))
            and "cpu_us" in a[0] and med(b, "cpu_us")]
    if not rows:
        return []
    return ["", "Two sites (`--site`) against the same build served alone, same loop:",
            "", "| workers | document | server | req/s ratio | CPU/req ratio |",
            "|---|---|---|---|---|", *rows]


def plot(results: dict, servers: list[str], cells: list[str], out: str) -> None:
    """Two panels, req/s and CPU per request, each as a ratio to nginx (the 1.0 line)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    closed = [c for c in cells if not c.startswith("open") and f"{c}|nginx" in results]
    others = [s for s in servers if s != "nginx" and any(f"{c}|{s}" in results for c in closed)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    width = 0.8 / max(len(others), 1)
    for ax, key, title in ((axes[0], "rps", "requests/s ÷ nginx (higher is better)"),
                           (axes[1], "cpu_us", "server CPU per request ÷ nginx (lower is better)")):
        for i, s in enumerate(others):
            ys = [med(results[f"{c}|{s}"], key) / med(results[f"{c}|nginx"], key)
                  if f"{c}|{s}" in results else 0 for c in closed]
            ax.bar([x + i * width for x in range(len(closed))], ys, width, label=s)
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_xticks([x + width * (len(others) - 1) / 2 for x in range(len(closed))])
        ax.set_xticklabels([c.replace("|", " worker(s)\n") for c in closed], fontsize=8)
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle("Orisha vs nginx, same machine, same bytes (medians of interleaved rounds)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "results.png"), dpi=110)
    print(f"wrote {out}/results.md, results.json, results.png")


if __name__ == "__main__":
    main()
