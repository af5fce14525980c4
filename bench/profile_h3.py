"""Where an Orisha worker's time goes under h3 load: py-spy's Python stacks, by function.

Strategy: bench/h3.py's site, server (one worker on CPU 0) and load (ngtcp2's client,
``--clients`` processes of ``--requests`` on CPU 1), while py-spy samples the worker
for ``--seconds``
(``pip install 'orisha[profile]'``); prints the server CPU per request of that run,
then the functions by self time and Orisha's own by inclusive time. Not part of the
suite; a diagnostic for the h3 bench goal of issue 22 (the figures of a shared machine
move by a third from run to run: compare shares, not microseconds).

    .venv/bin/python bench/profile_h3.py [--doc /doc-13k.html] [--seconds 8] [--requests 1000]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import bench as B  # noqa: E402
import h3 as H  # noqa: E402
from profile_tls import worker_pid  # noqa: E402


def shares(raw: str) -> tuple[int, collections.Counter, collections.Counter]:
    """(samples, self samples per function, inclusive samples per function) of a py-spy
    ``raw`` (collapsed stacks) file; line numbers dropped."""
    own, incl, total = collections.Counter(), collections.Counter(), 0
    with open(raw) as f:
        for line in f:
            stack, n = line.rsplit(" ", 1)
            frames = [re.sub(r":\d+\)", ")", fr) for fr in stack.split(";")]
            total += int(n)
            own[frames[-1]] += int(n)
            for fr in set(frames):
                incl[fr] += int(n)
    return total, own, incl


def main() -> None:
    from tlsutil import make_pki
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc", default="/doc-1k.html")
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--requests", type=int, default=1000, help="per client process")
    args = ap.parse_args()
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        sys.exit("py-spy is not installed: pip install 'orisha[profile]'")
    tmp = tempfile.mkdtemp(prefix="orisha-h3-profile-")
    site, build = os.path.join(tmp, "site"), os.path.join(tmp, "build")
    B.make_site(site)
    subprocess.run([sys.executable, "-m", "orisha.cli", "build", site, "-o", build], check=True,
                   capture_output=True)
    pki = make_pki(os.path.join(tmp, "pki"))
    p = H.start("orisha", tmp, build, "", pki, "epoll")
    raw = os.path.join(tmp, "spy.txt")
    try:
        time.sleep(1.0)
        H.load("orisha", p.port, args.doc, 100, 1)  # warm-up
        rec = subprocess.Popen([spy, "record", "-p", str(worker_pid(p.p.pid)), "-d",
                                str(int(args.seconds)), "-r", "200", "-f", "raw", "-o", raw,
                                "--nonblocking"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        before = p.cpu()
        r = H.load("orisha", p.port, args.doc, args.requests, args.clients)
        cpu_us = (p.cpu() - before) / max(r["done"], 1) * 1e6
        rec.wait(args.seconds + 30)
    finally:
        p.stop()
    print(f"{args.doc}: {r['rps']:,.0f} req/s, {cpu_us:.0f} µs server CPU per request "
          f"(load average {os.getloadavg()[0]:.1f})")
    total, own, incl = shares(raw)
    print(f"\npy-spy, {total} samples; self time:")
    for fr, n in own.most_common(30):
        print(f"{100 * n / total:5.1f}%  {fr[:110]}")
    print("\nOrisha's own, inclusive:")
    for fr, n in incl.most_common():
        if "orisha/" in fr and not re.search(r"cli\.py|supervisor\.py|server\.py", fr):
            print(f"{100 * n / total:5.1f}%  {fr[:110]}")


if __name__ == "__main__":
    main()
