"""HTTP/3 per request: Orisha against Caddy and ngtcp2's example server, and Orisha's own h2.

Strategy: bench/bench.py's site (a ~1 KB and a ~13 KB HTML document) is built with
Orisha and exported as files for Caddy (``file_server``, HTTP/3 on by default) and for
ngtcp2's example server (Debian ``ngtcp2-server``: ``gtlsserver -d ROOT``, a C floor for
QUIC on this machine); one certificate from tests/tlsutil.py for all. Each server runs one
worker pinned to CPU 0. The load is C (the aioquic client of earlier versions of this
script saturated its core first): ``--clients`` processes of ngtcp2's client (Debian
``ngtcp2-client``: ``gtlsclient -n N``, one QUIC connection of N requests each), pinned to
CPU 1; Orisha's h2 over TLS on the same port gets h2load with as many connections and
``H2_SCALE`` times the requests (the /proc clock ticks every 10 ms). Before a server is
timed, its answer is fetched and compared with the build's identity bytes (the clients
send no Accept-Encoding). Per server and document: requests per second, the server's CPU
time per request (utime+stime of its whole session from
/proc over the run), and how busy the clients kept their core (their CPU over the wall
time: near 1.0, the client was the limit). Medians over interleaved rounds; then the
ratios. Bounded in count (``--requests`` per client) and time (``TIMEOUT`` per run).

    .venv/bin/python bench/h3.py [--requests 2000] [--clients 2] [--rounds 3] [--loop epoll]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
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
# orisha: HTTP/3 on ngtcp2 (compiled_h3); ngtcp2: its own example server; orisha-h2: the
# same site over HTTP/2, the floor of what a request can cost Orisha
SERVERS = ("orisha", "caddy", "ngtcp2", "orisha-h2")
TIMEOUT = 120  # seconds one load run may take at most
H2_SCALE = 10  # h2 gets this many times the requests: ~5 µs each is a 10 ms clock tick per 2,000
CADDYFILE = """{{
\tadmin off
\tauto_https off
}}
https://127.0.0.1:{port} {{
\ttls {cert} {key}
\troot * {root}
\tfile_server
}}
"""


class Server(B.Proc):
    """B.Proc, made ready by a fetch over its own protocol (gtlsserver has no TCP port)."""

    def __init__(self, name: str, cmd: list[str], port: int, ready, env=None) -> None:
        self.name, self.port = name, port
        self.p = subprocess.Popen(["taskset", "-c", "0", *cmd], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, env=env, start_new_session=True)
        deadline = time.monotonic() + 15
        while True:
            try:
                ready()
                return
            except (RuntimeError, subprocess.SubprocessError):
                if time.monotonic() > deadline or self.p.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"{name} did not start") from None
                time.sleep(0.2)


def fetch_h3(port: int, path: str, tmp: str) -> bytes:
    """One GET over HTTP/3 with ngtcp2's client: the body it downloaded."""
    out = tempfile.mkdtemp(dir=tmp)
    subprocess.run(["gtlsclient", "-q", "--exit-on-all-streams-close", "--timeout=5s",
                    "--download", out, "127.0.0.1", str(port), f"https://127.0.0.1:{port}{path}"],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=15, check=True)
    name = os.path.join(out, os.path.basename(path))
    if not os.path.exists(name):
        raise RuntimeError(f"{port}{path}: nothing downloaded")
    with open(name, "rb") as f:
        return f.read()


def fetch_h2(port: int, path: str, tmp: str) -> bytes:
    """One GET over h2 (TLS, ALPN) with curl: the body, checked to have come over HTTP/2."""
    r = subprocess.run(["curl", "-sk", "--http2", "-w", "\n%{http_version} %{http_code}",
                        f"https://127.0.0.1:{port}{path}"], capture_output=True, timeout=15)
    body, _, tail = r.stdout.rpartition(b"\n")
    if r.returncode or tail != b"2 200":
        raise RuntimeError(f"{port}{path}: curl {r.returncode} {tail!r}")
    return body


def start(server: str, tmp: str, build: str, root: str, pki, loop: str) -> Server:
    port = B.free_port()
    fetch = fetch_h2 if server == "orisha-h2" else fetch_h3
    ready = lambda: fetch(port, DOCS["1 KB"], tmp)  # noqa: E731
    if server == "caddy":
        conf = os.path.join(tempfile.mkdtemp(dir=tmp), "Caddyfile")
        with open(conf, "w") as f:
            f.write(CADDYFILE.format(port=port, root=root, cert=pki.chain, key=pki.key))
        return Server(server, ["caddy", "run", "--config", conf, "--adapter", "caddyfile"], port,
                      ready, env={**os.environ, "HOME": tmp, "XDG_DATA_HOME": tmp,
                                  "XDG_CONFIG_HOME": tmp})
    if server == "ngtcp2":
        return Server(server, ["gtlsserver", "-q", "-d", root, "127.0.0.1", str(port), pki.key,
                               pki.chain], port, ready)
    return Server(server, [sys.executable, "-m", "orisha.cli", "serve", build, "--port", str(port),
                           "--host", "127.0.0.1", "--workers", "1", "--loop", loop,
                           "--tls-cert", pki.chain, "--tls-key", pki.key], port, ready)


def _reap(procs: list) -> float:
    """Wait for every client; their CPU seconds (os.wait4's rusage). A failed one raises."""
    cpu, deadline = 0.0, time.monotonic() + TIMEOUT
    for p in procs:
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                p.returncode = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                for q in procs:
                    if q.poll() is None:
                        q.send_signal(signal.SIGKILL)
                raise RuntimeError(f"the load did not finish within {TIMEOUT} s")
            time.sleep(0.01)
        if p.returncode:
            raise RuntimeError(f"{p.args}: exit status {p.returncode}")
        cpu += ru.ru_utime + ru.ru_stime
    return cpu


def load(server: str, port: int, path: str, requests: int, clients: int) -> dict:
    """``clients`` C clients on CPU 1 at once, ``requests`` each: done, req/s, client core."""
    url = f"https://127.0.0.1:{port}{path}"
    if server == "orisha-h2":
        requests *= H2_SCALE
        cmds = [["h2load", "-n", str(requests * clients), "-c", str(clients), "-m", "100", url]]
    else:
        cmds = [["gtlsclient", "-q", "--exit-on-all-streams-close", "--timeout=30s",
                 "-n", str(requests), "127.0.0.1", str(port), url]] * clients
    start = time.monotonic()
    procs = [subprocess.Popen(["taskset", "-c", "1", *c], stdout=subprocess.PIPE if
                              server == "orisha-h2" else subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for c in cmds]
    client_cpu = _reap(procs)
    wall = time.monotonic() - start
    done = requests * clients
    if server == "orisha-h2":
        out = procs[0].stdout.read().decode()
        m = re.search(r"requests: \d+ total, \d+ started, \d+ done, (\d+) succeeded", out)
        done = int(m.group(1)) if m else 0
    for p in procs:
        if p.stdout:
            p.stdout.close()
    return {"done": done, "rps": done / wall, "client": client_cpu / wall}


def measure(servers, args, tmp, build, root, pki, want) -> dict:
    results: dict = {(s, d): [] for s in servers for d in DOCS}
    for _ in range(args.rounds):
        for s in servers:
            p = start(s, tmp, build, root, pki, args.loop)
            try:
                fetch = fetch_h2 if s == "orisha-h2" else fetch_h3
                for d, path in DOCS.items():
                    got = fetch(p.port, path, tmp)
                    assert got == want[d], f"{s} {path}: {len(got)} bytes, not the build's"
                    load(s, p.port, path, min(200, args.requests), 1)  # warm-up, untimed
                    before = p.cpu()
                    r = load(s, p.port, path, args.requests, args.clients)
                    r["cpu_us"] = (p.cpu() - before) / max(r["done"], 1) * 1e6
                    results[(s, d)].append(r)
            finally:
                p.stop()
    return results


def report(results: dict, servers, args) -> None:
    med = {k: {f: statistics.median(r[f] for r in rs) for f in ("rps", "cpu_us", "client")}
           for k, rs in results.items()}
    print(f"\n{args.clients} clients × {args.requests:,} requests, {args.rounds} round(s), "
          f"load average {os.getloadavg()[0]:.1f}; server on CPU 0, clients on CPU 1\n")
    print("| doc | server | req/s | server CPU µs per request | client core busy |")
    print("|---|---|---:|---:|---:|")
    for d in DOCS:
        for s in servers:
            m = med[(s, d)]
            print(f"| {d} | {s} | {m['rps']:,.0f} | {m['cpu_us']:,.1f} | {m['client']:.2f} |")
    print("\n| doc | Orisha h3 / Caddy | / ngtcp2 | / Orisha h2 |")
    print("|---|---:|---:|---:|")
    for d in DOCS:
        if ("orisha", d) not in med:
            continue
        o = med[("orisha", d)]["cpu_us"]
        cells = [f"{o / med[(s, d)]['cpu_us']:.2f}x" if med.get((s, d), {}).get("cpu_us")
                 else "-" for s in ("caddy", "ngtcp2", "orisha-h2")]
        print(f"| {d} | " + " | ".join(cells) + " |")


def main() -> None:
    from tlsutil import make_pki
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000, help="per client process")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loop", default="epoll")
    ap.add_argument("--servers", default=",".join(SERVERS))
    args = ap.parse_args()
    servers = [s for s in args.servers.split(",") if s]
    tmp = tempfile.mkdtemp(prefix="orisha-h3-bench-")
    site, build, root = (os.path.join(tmp, n) for n in ("site", "build", "root"))
    B.make_site(site)
    subprocess.run([sys.executable, "-m", "orisha.cli", "build", site, "-o", build], check=True,
                   capture_output=True, cwd=ROOT)
    os.makedirs(root)
    B.export_for_nginx(build, root)
    want = {}
    for d, path in DOCS.items():
        with open(os.path.join(site, path.lstrip("/")), "rb") as f:
            want[d] = f.read()
    pki = make_pki(os.path.join(tmp, "pki"))
    report(measure(servers, args, tmp, build, root, pki, want), servers, args)


if __name__ == "__main__":
    main()
