"""Scale: a real ~1,000-file, ~64 MB site (Debian's python3.11-doc HTML).

    .venv/bin/python bench/scale.py [--site /usr/share/doc/python3.11/html]

Cold build (empty compression cache), rebuild after changing one file, and
server start (process start → first response). Memory is bench/memory.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(site: str, out: str, env) -> float:
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "orisha.cli", "build", site, "-o", out], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return time.monotonic() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--site", default="/usr/share/doc/python3.11/html")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="orisha-scale-")
    site = os.path.join(tmp, "site")
    shutil.copytree(args.site, site, symlinks=True)
    files = sum(len(fs) for _, _, fs in os.walk(site))
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(site) for f in fs
               if not os.path.islink(os.path.join(d, f)))
    env = {**os.environ, "ORISHA_CACHE": os.path.join(tmp, "cache")}
    out = os.path.join(tmp, "out")
    cold = build(site, out, env)
    target = next(os.path.join(d, f) for d, _, fs in os.walk(site) for f in sorted(fs) if f.endswith(".html"))
    with open(target, "a") as f:
        f.write("<!-- edited -->\n")
    warm = build(site, out, env)
    out_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    starts = []
    for _ in range(5):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        t = time.monotonic()
        p = subprocess.Popen([sys.executable, "-m", "orisha.cli", "serve", out, "--port", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        while True:
            try:
                c = socket.create_connection(("127.0.0.1", port), timeout=1)
                c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                if c.recv(100).startswith(b"HTTP/1.1 "):
                    break
            except OSError:
                time.sleep(0.005)
        starts.append(time.monotonic() - t)
        p.terminate()
        p.wait(20)
    print(f"site {args.site}: {files} files, {size / 1e6:.1f} MB; build output {out_bytes / 1e6:.1f} MB; "
          f"cold build {cold:.1f} s on {os.cpu_count()} cores; rebuild after editing one file {warm:.2f} s "
          f"(process wall time incl. interpreter start); serve start → first response "
          f"median {sorted(starts)[2] * 1000:.0f} ms")
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
