"""Where an Orisha worker's time goes under h2load, per protocol: perf (C level) and py-spy (Python).

Strategy: bench/h2.py's site, export-free (Orisha only), one worker on CPU 0
with the test certificate (or cleartext for h1), h2load -t1 on CPU 1 for
--seconds + 2 s while perf samples the worker's call stacks for --seconds
(shared objects and symbols by self time), then a second h2load run while
py-spy samples its Python stacks (functions by self and inclusive time,
native frames of the compiled modules included). Both tools are optional:
what is not installed is skipped with a line saying so. Not part of the
suite; a diagnostic for the next round of issue 18.

    .venv/bin/python bench/profile_tls.py [--proto h2|https|h1] [--doc /doc-1k.html] [--loop epoll]
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import bench as B  # noqa: E402
from tlsutil import make_pki  # noqa: E402


def worker_pid(supervisor: int) -> int:
    """The supervisor's child, once forked (the port answers before the worker exists)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == supervisor:
                            return int(pid)
                except OSError:
                    continue
        time.sleep(0.05)
    raise RuntimeError("no worker found")


def load(url: str, proto: str, seconds: float) -> subprocess.Popen:
    args = {"h2": ["-c", "100", "-m", "10"], "https": ["--h1", "-c", "100"], "h1": ["--h1", "-c", "100"]}
    return subprocess.Popen(["taskset", "-c", "1", "h2load", "-t1", "-H", "accept-encoding: gzip",
                             *args[proto], "-D", f"{seconds:g}", url],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def perf(pid: int, seconds: float, tmp: str, top: int) -> None:
    data = os.path.join(tmp, "perf.data")
    subprocess.run(["perf", "record", "-q", "-F", "1999", "-g", "-p", str(pid), "-o", data, "--",
                    "sleep", f"{seconds:g}"], capture_output=True, timeout=seconds + 60)
    for sort in ("dso", "dso,symbol"):
        r = subprocess.run(["perf", "report", "-i", data, "--no-children", "--stdio", "-g", "none",
                            "--percent-limit", "0.7", "--sort", sort], capture_output=True,
                           text=True, timeout=300)
        rows = [line for line in r.stdout.splitlines() if line.strip() and not line.startswith("#")]
        print(f"\nperf, self time by {sort}:")
        print("\n".join(rows[:top]))


def pyspy(pid: int, seconds: float, tmp: str, top: int) -> None:
    out = os.path.join(tmp, "pyspy.txt")
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    r = subprocess.run([spy, "record", "-p", str(pid), "-d", f"{seconds:g}", "-r", "500", "--native",
                        "-f", "raw", "-o", out], capture_output=True, text=True, timeout=seconds + 60)
    if r.returncode or not os.path.exists(out):
        print(f"py-spy failed: {r.stderr.strip()[-300:]}")
        return
    own, incl, lines = collections.Counter(), collections.Counter(), collections.Counter()
    total = 0
    for line in open(out):
        stack, _, n = line.rstrip().rpartition(" ")
        n = int(n)
        frames = [f.rsplit(" (", 1)[0] + " " + f.rsplit("/", 1)[-1].split(":")[0].rstrip(")")
                  for f in stack.split(";") if f]
        total += n
        if frames:
            own[frames[-1]] += n
            leaf = stack.split(";")[-1]
            lines[leaf.rsplit(" (", 1)[0] + " " + leaf.rsplit("/", 1)[-1].rstrip(")")] += n
        for f in set(frames):
            incl[f] += n
    print(f"\npy-spy, {total} samples; self time:")
    for f, n in own.most_common(top):
        print(f"  {100 * n / total:5.1f}%  {f}")
    print("self time by line:")
    for f, n in lines.most_common(top):
        print(f"  {100 * n / total:5.1f}%  {f}")
    print("inclusive:")
    for f, n in incl.most_common(top):
        print(f"  {100 * n / total:5.1f}%  {f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--proto", default="h2", choices=("h2", "https", "h1"))
    ap.add_argument("--doc", default="/doc-1k.html")
    ap.add_argument("--loop", default="epoll")
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="orisha-profile-")
    site, build = os.path.join(tmp, "site"), os.path.join(tmp, "build")
    B.make_site(site)
    subprocess.run([sys.executable, "-m", "orisha.cli", "build", site, "-o", build], check=True,
                   capture_output=True, cwd=ROOT)
    port = B.free_port()
    cmd = [sys.executable, "-m", "orisha.cli", "serve", build, "--port", str(port), "--workers", "1",
           "--loop", args.loop]
    if args.proto != "h1":
        pki = make_pki(os.path.join(tmp, "pki"))
        cmd += ["--tls-cert", pki.chain, "--tls-key", pki.key]
    server = B.Proc("orisha", cmd, port, "0")
    scheme = "http" if args.proto == "h1" else "https"
    url = f"{scheme}://127.0.0.1:{port}{args.doc}"
    try:
        pid = worker_pid(server.p.pid)
        for name, tool in (("perf", perf), ("py-spy", pyspy)):
            if name == "py-spy" and not (shutil.which("py-spy") or os.path.exists(
                    os.path.join(os.path.dirname(sys.executable), "py-spy"))):
                print("py-spy not installed: skipped (pip install py-spy)")
                continue
            if name == "perf" and not shutil.which("perf"):
                print("perf not installed: skipped")
                continue
            h = load(url, args.proto, args.seconds + 2)
            try:
                tool(pid, args.seconds, tmp, args.top)
            finally:
                out, _ = h.communicate(timeout=args.seconds + 60)
            print("h2load: " + next((line for line in out.splitlines() if "req/s" in line), out[-300:]))
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
