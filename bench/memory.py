"""Memory: one copy of the site for all workers (PSS), and bytes per idle connection.

    .venv/bin/python bench/memory.py [--site /usr/share/doc/postgresql-doc-15/html] [--loop epoll]

1. Builds the site, serves it with 2 workers, requests every file in every
   encoding (so every page of the blob has been sent), then sums the PSS of the
   supervisor and the workers (/proc/PID/smaps_rollup) and compares it with the
   size of the build output.
2. Opens 10,000 idle keep-alive connections to one worker (each has made one
   request) and reports the worker's RSS growth per connection.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from orisha.serving.server import load_site  # noqa: E402


def field(pid: int, name: str, path: str = "smaps_rollup") -> int:
    with open(f"/proc/{pid}/{path}") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(name + ":"))


def blob_pss(pid: int) -> int:
    """KiB of PSS in the mappings of site.blob (the rest is the interpreter and the site's objects)."""
    kib, in_blob = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                in_blob = line.rstrip().endswith("site.blob")
            elif in_blob and line.startswith("Pss:"):
                kib += int(line.split()[1])
    return kib


def start(build: str, workers: int, loop: str, *extra: str):
    p = subprocess.Popen([sys.executable, "-m", "orisha.cli", "serve", build, "--port", "0", "--workers",
                          str(workers), "--loop", loop, *extra], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    port = int(re.search(r":(\d+)/", p.stdout.readline()).group(1))
    kids = [int(x) for x in open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()]
    return p, port, kids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--site", default="/usr/share/doc/postgresql-doc-15/html")
    ap.add_argument("--loop", default="epoll")
    ap.add_argument("--idle", type=int, default=10000)
    args = ap.parse_args()
    resource.setrlimit(resource.RLIMIT_NOFILE, (args.idle + 1000, args.idle + 1000))
    tmp = tempfile.mkdtemp(prefix="orisha-mem-")
    build = os.path.join(tmp, "build")
    subprocess.run([sys.executable, "-m", "orisha.cli", "build", args.site, "-o", build], check=True,
                   stdout=subprocess.DEVNULL, cwd=ROOT)
    out_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(build) for f in fs)
    site = load_site(build)
    p, port, kids = start(build, 2, args.loop)
    try:
        for _ in range(8):  # several connections: SO_REUSEPORT spreads them over both workers
            s = socket.create_connection(("127.0.0.1", port))
            f = s.makefile("rb")
            for key, entry in site.routes.items():
                if entry.__class__.__name__ != "Entry":
                    continue
                for v in entry.variants:
                    s.sendall(b"GET " + key.replace(b" ", b"%20") + b" HTTP/1.1\r\nHost: x\r\n"
                              b"Accept-Encoding: " + v.coding + b"\r\n\r\n")
                    length = 0
                    while (line := f.readline()) not in (b"\r\n", b""):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    f.read(length)
            s.close()
        time.sleep(1.5)  # past a once-a-second tick: workers drop their blob mappings (orisha/blob.py)
        pids = [p.pid, *kids]
        pss = sum(field(pid, "Pss") for pid in pids) * 1024
        blob = sum(blob_pss(pid) for pid in pids) * 1024
        print(f"build output {out_bytes / 1e6:.1f} MB; PSS of supervisor + 2 workers after serving every "
              f"variant: {pss / 1e6:.1f} MB = {pss / out_bytes:.2f}x the build output "
              f"(blob mappings {blob / 1e6:.1f} MB, the rest {(pss - blob) / 1e6:.1f} MB)")
    finally:
        p.terminate()
        p.wait(20)

    p, port, kids = start(build, 1, args.loop, "--idle-timeout", "600", "--max-connections", str(args.idle + 100))
    try:
        worker = kids[0]
        before = field(worker, "VmRSS", "status")
        conns = []
        for i in range(args.idle):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /index.html HTTP/1.1\r\nHost: x\r\n\r\n")
            conns.append(s)
        for s in conns:
            s.settimeout(10)
            s.recv(65536)
        time.sleep(1)
        after = field(worker, "VmRSS", "status")
        per = (after - before) * 1024 / args.idle
        print(f"{args.idle} idle keep-alive connections (one request each): worker RSS "
              f"{before} -> {after} KiB = {per:,.0f} bytes per connection (loop {args.loop})")
        for s in conns:
            s.close()
    finally:
        p.terminate()
        p.wait(20)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
