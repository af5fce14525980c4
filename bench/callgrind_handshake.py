"""Instructions per full TLS 1.3 handshake + one h2 request, Orisha's worker against nginx's.

Strategy: bench/h2.py's site, export and test certificate; each server runs
under ``valgrind --tool=callgrind`` with one worker (Orisha ``--workers 1``, the
worker forked from the supervisor and counted alone; nginx ``master_process
off``, so its one process is the worker) and h2load makes N connections, each
one full handshake (h2load resumes no session) and one h2 GET of the 1 KB
document. Each server is run twice, with --small and --large connections;
the difference of the worker's instruction counts divided by the difference
of the connection counts is the cost of one connection, start-up, warm-up and
exit cancelled out (compare servers at the same --small and --large: malloc's
cost grows with the number of connections open at once). The per-object split
(libpython, libssl, libcrypto, libc, the compiled modules) is the same
difference by ELF object, read from the profile's own cost lines (``by_object``).
Instruction counts do not depend on the machine's load (the lead shares the two
cores), unlike /proc CPU time; ``--keep DIR`` keeps the profiles for
``callgrind_annotate``. A diagnostic for issue 18, not part of the suite.

    .venv/bin/python bench/callgrind_handshake.py [--small 20] [--large 220]
        [--servers orisha:epoll,orisha:io-uring,nginx] [--keep DIR]
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import bench as B  # noqa: E402
import h2 as H2  # noqa: E402  (bench/h2.py)

# bench/h2.py's nginx (the same site, certificate and TLS settings) as one process: the
# worker is the process callgrind counts.
NGINX_CONF = H2.NGINX_CONF.replace("worker_processes 1;", "master_process off;")


def run(server: str, n: int, tmp: str, build: str, root: str, pki) -> dict[str, int]:
    """Instructions of the worker by ELF object, after ``n`` handshake connections."""
    out = tempfile.mkdtemp(dir=tmp, prefix=f"{server.replace(':', '-')}-{n}-")
    port = B.free_port()
    vg = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.%p"]
    if server == "nginx":
        conf = os.path.join(out, "nginx.conf")
        with open(conf, "w") as f:
            f.write(NGINX_CONF.format(dir=out, port=port, plain=B.free_port(), root=root,
                                      cert=pki.chain, key=pki.key))
        cmd = [*vg, "nginx", "-c", conf, "-e", os.path.join(out, "error.log")]
    else:
        cmd = [*vg, sys.executable, "-m", "orisha.cli", "serve", build, "--workers", "1",
               "--loop", server.split(":")[1], "--port", str(port),
               "--tls-cert", pki.chain, "--tls-key", pki.key]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, cwd=ROOT)
    try:
        B.wait_port(port, timeout=180)
        time.sleep(2)
        if n:
            r = subprocess.run(["h2load", "-t1", "-H", "accept-encoding: gzip", "-c", str(n),
                                "-n", str(n), "-m", "1", f"https://127.0.0.1:{port}/doc-1k.html"],
                               capture_output=True, text=True, timeout=600)
            if f"{n} succeeded" not in r.stdout:
                raise RuntimeError(f"{server}: h2load: {r.stdout[-600:]}")
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    # Orisha's worker: the busiest process but the supervisor (io_uring's probe is another)
    files = [f for f in glob.glob(f"{out}/cg.*") if server == "nginx" or not f.endswith(f".{p.pid}")]
    if not files:
        raise RuntimeError(f"{server}: no worker profile in {out}")
    return max((by_object(f) for f in files), key=lambda c: c["TOTAL"])


def by_object(path: str) -> dict[str, int]:
    """Self instructions by ELF object (and TOTAL) from a callgrind profile: its cost lines
    under each ``ob=``, a call's inclusive line (after ``calls=``) skipped. Read here, not
    through callgrind_annotate, which merges unnamed functions at the same offset of two
    objects (libcrypto's and a Rust extension's)."""
    names: dict[str, str] = {}
    objs: collections.Counter = collections.Counter()
    ob, skip = "?", False
    with open(path) as f:
        for line in f:
            if skip:
                skip = False
            elif line[0] in "0123456789+-*":
                fields = line.split()
                if len(fields) > 1:
                    objs[ob] += int(fields[1])
            elif line.startswith("ob="):
                m = re.match(r"ob=(\(\d+\))?\s*(.*)", line.rstrip("\n"))
                if m.group(2):
                    names[m.group(1) or m.group(2)] = os.path.basename(m.group(2))
                ob = names.get(m.group(1) or m.group(2), m.group(2))
            elif line.startswith("calls="):
                skip = True
            elif line.startswith(("cob=",)):
                m = re.match(r"cob=(\(\d+\))?\s*(.*)", line.rstrip("\n"))
                if m.group(2):
                    names[m.group(1) or m.group(2)] = os.path.basename(m.group(2))
    objs["TOTAL"] = sum(objs.values())
    return dict(objs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", type=int, default=20)
    ap.add_argument("--large", type=int, default=220)
    ap.add_argument("--servers", default="orisha:epoll,orisha:io-uring,nginx")
    ap.add_argument("--keep", help="keep the profiles in this folder")
    args = ap.parse_args()
    tmp = args.keep or tempfile.mkdtemp(prefix="orisha-cg-")
    os.makedirs(tmp, exist_ok=True)
    build, root, pki = H2.prepare(tmp)
    d = args.large - args.small
    try:
        for server in args.servers.split(","):
            lo = run(server, args.small, tmp, build, root, pki)
            hi = run(server, args.large, tmp, build, root, pki)
            per = {k: (hi.get(k, 0) - lo.get(k, 0)) / d for k in set(lo) | set(hi)}
            print(f"{server}: {per['TOTAL'] / 1e6:.3f}M instructions per connection", flush=True)
            for k, v in sorted(per.items(), key=lambda kv: -kv[1]):
                if k != "TOTAL" and abs(v) >= 2000:
                    print(f"    {v / 1e3:9.1f}k  {k}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
