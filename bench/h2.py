"""HTTPS, HTTP/2 and cleartext HTTP/1.1: Orisha against H2O and nginx, same certificate, same bytes.

Strategy: bench/bench.py's site (a ~1 KB and a ~13 KB HTML document) is built
with Orisha and exported as files (Orisha's own identity, .gz and .br variants;
bench.export_for_nginx) that H2O (`file.send-compressed: ON`) and nginx
(`gzip_static on`) serve; a test CA and leaf come from the openssl CLI
(tests/tlsutil.py). Every server runs one worker pinned to CPU 0 (nginx
`worker_processes 1`, H2O `num-threads: 1`, Orisha `--workers 1`) with a TLS
port (h2 and http/1.1 by ALPN) and a cleartext port (Orisha: a second
process), and h2load -t1 runs pinned to CPU 1. Before timing, every server
must answer 200 with Orisha's bytes and Content-Encoding (curl, raw bodies,
per protocol and document): a mismatch stops the run. Then, in interleaved
rounds, per server and document:

  h1      cleartext HTTP/1.1: h2load --h1 -c C for --seconds (after 1 s of
          untimed warm-up);
  https   HTTP/1.1 over TLS 1.3 (ALPN http/1.1), the same;
  h2      h2 over TLS 1.3, -c C -m 10;
  handshakes  h2load -c N -n N: every connection makes one full TLS 1.3
          handshake (h2load resumes no session) and one h2 request.

Per run: req/s (connections/s for handshakes), the server's CPU time per
request (utime+stime of every process of its session from /proc: H2O's master
and its neverbleed key process, nginx's master and worker, Orisha's supervisor
and worker) and the client's busy fraction (h2load's rusage / wall time: near
1.0 means h2load's core, not the server, was the limit, and req/s says little;
CPU per request still holds). Medians over the rounds and the ratios
Orisha/H2O and Orisha/nginx are printed as a Markdown table and written to
OUT/h2.md and OUT/h2.json.

    .venv/bin/python bench/h2.py [--seconds 5] [--rounds 5] [--loops epoll,io-uring] [--only https,handshakes] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import bench as B  # noqa: E402  (bench/bench.py: the site, the export, Proc with /proc CPU)
from tlsutil import make_pki  # noqa: E402

DOCS = {"1 KB": "/doc-1k.html", "13 KB": "/doc-13k.html"}
PROTOCOLS = ("h1", "https", "h2")  # cleartext HTTP/1.1, HTTP/1.1 over TLS, h2 over TLS
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
  server {{ listen 127.0.0.1:{port} ssl http2 reuseport; listen 127.0.0.1:{plain} reuseport;
           root {root}; }}
}}
"""
# H2O 2.2.5 (Debian): one event-loop thread; private-key operations run in its neverbleed
# process (same session, so its CPU is counted); it writes no pid file once it runs as nobody.
# No access-log directive: no access log; no OCSP fetcher (a test CA has no responder).
H2O_CONF = """
num-threads: 1
error-log: {dir}/error.log
listen:
  host: 127.0.0.1
  port: {port}
  ssl:
    certificate-file: {cert}
    key-file: {key}
    minimum-version: TLSv1.2
    ocsp-update-interval: 0
listen:
  host: 127.0.0.1
  port: {plain}
http1-request-timeout: 75
http2-idle-timeout: 75
hosts:
  default:
    paths:
      /:
        file.dir: {root}
        file.send-compressed: ON
"""


class Server:
    """One peer: a TLS port and a cleartext port, and the processes that serve them."""

    def __init__(self, name: str, procs: list, tls_port: int, plain_port: int) -> None:
        self.name, self.procs, self.tls_port, self.plain_port = name, procs, tls_port, plain_port

    def cpu(self) -> float:
        return sum(p.cpu() for p in self.procs)

    def url(self, proto: str, path: str) -> str:
        return (f"http://127.0.0.1:{self.plain_port}{path}" if proto == "h1"
                else f"https://127.0.0.1:{self.tls_port}{path}")

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


def start(server: str, tmp: str, build: str, root: str, pki) -> Server:
    port, plain = B.free_port(), B.free_port()
    if server in ("nginx", "h2o"):
        d = tempfile.mkdtemp(dir=tmp)
        os.chmod(d, 0o755)
        conf = os.path.join(d, f"{server}.conf")
        with open(conf, "w") as f:
            f.write((NGINX_CONF if server == "nginx" else H2O_CONF).format(
                dir=d, port=port, plain=plain, root=root, cert=pki.chain, key=pki.key))
        cmd = (["nginx", "-c", conf, "-e", os.path.join(d, "error.log")] if server == "nginx"
               else ["h2o", "-c", conf])
        p = B.Proc(server, cmd, port, "0")
        B.wait_port(plain)
        return Server(server, [p], port, plain)
    _, loop = server.split(":")
    base = [sys.executable, "-m", "orisha.cli", "serve", build, "--workers", "1", "--loop", loop]
    tls = B.Proc(server, [*base, "--port", str(port), "--tls-cert", pki.chain, "--tls-key", pki.key],
                 port, "0")
    clear = B.Proc(server, [*base, "--port", str(plain)], plain, "0")
    return Server(server, [tls, clear], port, plain)


def h2load(url: str, args: list[str], timeout: float) -> dict:
    cmd = ["taskset", "-c", "1", "h2load", "-t1", "-H", "accept-encoding: gzip", *args, url]
    start_t = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise RuntimeError(f"h2load ran past {timeout:.0f} s: {' '.join(cmd)}")
    wall = time.monotonic() - start_t
    # the child is reaped by communicate(); its rusage is in RUSAGE_CHILDREN deltas
    m = re.search(r"finished in ([\d.]+)(m?s), ([\d.]+) req/s", out)
    done = re.search(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed",
                     out)
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    if not m or not done or int(done.group(3)) or not codes or sum(map(int, codes.groups()[1:])):
        raise RuntimeError(f"h2load failed ({' '.join(cmd)}): {out[-800:]}")
    secs = float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)
    return {"rps": float(m.group(3)), "done": int(done.group(2)), "secs": secs, "wall": wall}


def measure(s: Server, url: str, args: list[str], warm: list[str] | None, timeout: float) -> dict:
    if warm:  # untimed: h2load's own warm-up would count in the CPU window
        h2load(url, warm, timeout)
    before_client = os.times()
    before = s.cpu()
    r = h2load(url, args, timeout)
    r["cpu_us"] = (s.cpu() - before) / max(r["done"], 1) * 1e6
    after_client = os.times()
    client = (after_client.children_user - before_client.children_user
              + after_client.children_system - before_client.children_system)
    r["client_busy"] = client / r["wall"]
    return r


def answer(url: str, proto: str, ca: str, tmp: str) -> tuple[int, str, bytes]:
    """Status, Content-Encoding and raw body of one GET, as curl sees them."""
    head, body = os.path.join(tmp, "head"), os.path.join(tmp, "body")
    flag = {"h1": "--http1.1", "https": "--http1.1", "h2": "--http2"}[proto]
    url = url.replace("https://127.0.0.1", "https://localhost")  # the leaf is for localhost
    r = subprocess.run(["curl", "-sS", flag, "--cacert", ca, "-H", "accept-encoding: gzip",
                        "-D", head, "-o", body, "-w", "%{http_code} %{http_version}", url],
                       capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise SystemExit(f"curl {url}: {r.stderr.strip()}")
    code, version = r.stdout.split()
    want = {"h1": "1.1", "https": "1.1", "h2": "2"}[proto]
    if version != want:
        raise SystemExit(f"{url}: answered over HTTP/{version}, not HTTP/{want}")
    enc = re.findall(r"(?im)^content-encoding:\s*(\S+)", open(head).read())
    with open(body, "rb") as f:
        return int(code), enc[-1] if enc else "", f.read()


def verify(servers: dict[str, Server], ca: str, tmp: str) -> None:
    """Every server answers 200 with the reference Orisha's bytes and Content-Encoding."""
    ref_name = next(n for n in servers if n.startswith("orisha"))
    for proto in PROTOCOLS:
        for path in DOCS.values():
            ref = answer(servers[ref_name].url(proto, path), proto, ca, tmp)
            if ref[0] != 200 or ref[1] != "gzip":
                raise SystemExit(f"{ref_name} {proto} {path}: {ref[0]}, content-encoding {ref[1]!r}")
            for name, s in servers.items():
                got = answer(s.url(proto, path), proto, ca, tmp)
                if got[:2] != ref[:2] or got[2] != ref[2]:
                    raise SystemExit(
                        f"{name} {proto} {path}: status {got[0]}, content-encoding {got[1]!r}, "
                        f"{len(got[2])} bytes; {ref_name} sends 200, {ref[1]!r}, {len(ref[2])} bytes"
                        + ("" if got[2] == ref[2] else " (the bodies differ)"))
    print(f"verified: every server sends {ref_name}'s bytes and Content-Encoding "
          f"({', '.join(PROTOCOLS)} x {', '.join(DOCS)})", flush=True)


def prepare(tmp: str):
    """The site built into ``tmp``, exported for the peers, and the test certificate, all
    readable by nginx's workers (www-data) and H2O (nobody): (build, root, pki)."""
    os.chmod(tmp, 0o755)
    site, build, root = (os.path.join(tmp, d) for d in ("site", "build", "root"))
    B.make_site(site)
    subprocess.run([sys.executable, "-m", "orisha.cli", "build", site, "-o", build], check=True,
                   capture_output=True, cwd=ROOT)
    os.makedirs(root)
    os.chmod(root, 0o755)
    B.export_for_nginx(build, root)  # Orisha's own variants, as files, for both peers
    pki = make_pki(os.path.join(tmp, "pki"))
    os.chmod(os.path.dirname(pki.key), 0o755)
    os.chmod(pki.key, 0o644)
    return build, root, pki


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--loops", default="epoll", help="Orisha loops (compiled if built), comma-separated")
    ap.add_argument("--peers", default="h2o,nginx")
    ap.add_argument("--conns", type=int, default=100, help="connections per timed run")
    ap.add_argument("--handshakes", type=int, default=2000,
                    help="connections per handshake run (CPU is counted in 10 ms ticks)")
    ap.add_argument("--quick", action="store_true", help="1 round of 2 s (a smoke run, not a result)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"))
    ap.add_argument("--only", default="h1,https,h2,handshakes",
                    help="the runs to time, comma-separated (a diagnostic: the README's table "
                         "is all four)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    if args.quick:
        args.rounds, args.seconds, args.handshakes = 1, 2, 100
    tmp = tempfile.mkdtemp(prefix="orisha-bench-h2-")
    build, root, pki = prepare(tmp)
    names = [f"orisha:{loop}" for loop in args.loops.split(",")] + \
        [p for p in args.peers.split(",") if p]
    servers: dict[str, Server] = {}
    results: dict[str, list[dict]] = {}
    failures: dict[str, list[str]] = {}
    limit = args.seconds + 30  # every h2load run is bounded in time as well as count
    c = str(args.conns)
    runs = {"h1": ["--h1", "-c", c, "-D", f"{args.seconds:g}"],
            "https": ["--h1", "-c", c, "-D", f"{args.seconds:g}"],
            "h2": ["-c", c, "-m", "10", "-D", f"{args.seconds:g}"]}
    warm = {k: [*v[:-1], "1"] for k, v in runs.items()}
    hs = ["-c", str(args.handshakes), "-n", str(args.handshakes), "-m", "1"]
    try:
        for n in names:
            servers[n] = start(n, tmp, build, root, pki)
        verify(servers, pki.ca, tmp)
        for rnd in range(args.rounds):
            for n in names if rnd % 2 == 0 else names[::-1]:  # interleaved A/B
                s = servers[n]
                cells = [(f"{proto} {doc}", s.url(proto, path), runs[proto], warm[proto])
                         for proto in PROTOCOLS for doc, path in DOCS.items() if proto in only]
                if "handshakes" in only:
                    cells.append(("handshakes", s.url("h2", DOCS["1 KB"]), hs, None))
                for run, url, timed, warm_up in cells:
                    try:
                        r = measure(s, url, timed, warm_up, limit)
                    except RuntimeError as e:  # a stalled or failing run is reported, not timed
                        print(f"round {rnd + 1} {run:12} {n:14} FAILED: {e}", flush=True)
                        failures.setdefault(f"{run}|{n}", []).append(str(e).split(" (")[0].split(":")[0])
                        continue
                    if run == "handshakes":
                        r["rps"] = args.handshakes / r["secs"]
                    results.setdefault(f"{run}|{n}", []).append(r)
                    log(rnd, run, n, r)
    finally:
        for s in servers.values():
            s.stop()
    report(results, failures, names, args)


def log(rnd: int, run: str, name: str, r: dict) -> None:
    print(f"round {rnd + 1} {run:12} {name:14} {r['rps']:>9,.0f}/s {r['cpu_us']:7.1f} µs/req "
          f"client busy {r['client_busy']:.2f}", flush=True)


def report(results: dict, failures: dict, names: list[str], args) -> None:
    med = lambda cell, k: statistics.median(r[k] for r in results[cell])  # noqa: E731
    peers = [n for n in names if not n.startswith("orisha")]
    lines = [f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: one worker each on CPU 0, "
             f"h2load -t1 on CPU 1, {args.conns} connections (h2: 10 streams each), "
             f"Accept-Encoding: gzip, TLS 1.3; medians of {args.rounds} interleaved rounds of "
             f"{args.seconds:g} s; handshakes: {args.handshakes} connections, one full handshake "
             "and one h2 request each. CPU µs/req = utime+stime of every server process / "
             "requests (or connections). Client busy = h2load's CPU / wall (near 1.0: the client's "
             "core was the limit). Ratios: Orisha's CPU per request / the peer's (lower is "
             "better) and req/s ÷ the peer's.", "",
             "| run | server | req/s | CPU µs/req | client busy | "
             + " | ".join(f"CPU ÷ {p} | req/s ÷ {p}" for p in peers) + " |",
             "|---|---|---:|---:|---:|" + "---:|---:|" * len(peers)]
    runs = [f"{p} {d}" for p in PROTOCOLS for d in DOCS] + ["handshakes"]
    for run in (r for r in runs if r.split()[0] in args.only.split(",")):
        for n in names:
            cell = f"{run}|{n}"
            failed = f" ({len(failures[cell])} of {args.rounds} runs failed: " \
                f"{'; '.join(sorted(set(failures[cell])))})" if cell in failures else ""
            if cell not in results:
                lines.append(f"| {run} | {n}{failed} | – | – | – |" + " | ".join([""] * 2 * len(peers))
                             + " |")
                continue
            ratios = []
            for p in peers:
                base = f"{run}|{p}"
                if n.startswith("orisha") and base in results and cell in results:
                    ratios += [f"{med(cell, 'cpu_us') / med(base, 'cpu_us'):.2f}×",
                               f"{med(cell, 'rps') / med(base, 'rps'):.2f}×"]
                else:
                    ratios += ["", ""]
            lines.append(f"| {run} | {n}{failed} | {med(cell, 'rps'):,.0f} | {med(cell, 'cpu_us'):,.1f} | "
                         f"{med(cell, 'client_busy'):.2f} | " + " | ".join(ratios) + " |")
    table = "\n".join(lines)
    print("\n" + table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "h2.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "h2.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}/h2.md, h2.json")


if __name__ == "__main__":
    main()
