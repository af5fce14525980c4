#!/usr/bin/env python3
"""Measure QEMU start -> first complete HTTP response, wall clock.

usage: tools/boottime.py IMAGE [--runs N] [--port P] [--https CA] (env ACCEL/MACHINE/MEM as run.sh,
CPUS: the vCPUs, as `orisha boot --cpus`)
Each attempt opens a fresh connection with a short timeout, sends a GET and
waits for a full response head; retries until one arrives (max 30 s).
--https CA: the image's TLS port (443), a full TLS handshake verified with CA
in every attempt (an image built with --tls-cert).
QEMU is started directly with orisha boot's command line (boot.qemu_command),
so the figure holds no Python start-up.
"""
import argparse, os, signal, socket, ssl, statistics, subprocess, sys, threading, time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
from orisha.core.policy import Limits  # noqa: E402
from orisha.targets.unikernel.boot import (GUEST_HTTP, GUEST_TLS, cmdline,  # noqa: E402
                                           guest_megabytes, qemu_command, resolve_accel)

TLS = None  # an ssl.SSLContext with --https


def command(image, port):
    """What unikernel/run.sh runs, from the same environment variables."""
    mem = os.environ.get("MEM", "").rstrip("M")
    cpus = int(os.environ.get("CPUS", "1"))
    machine = os.environ.get("MACHINE", "microvm")
    return qemu_command(image, "127.0.0.1", port, resolve_accel(os.environ.get("ACCEL", "auto")),
                        int(mem) if mem else guest_megabytes(image, machine, cpus),
                        " ".join(filter(None, [cmdline(Limits(), cpus), os.environ.get("APPEND", "")])),
                        machine, guest_port=GUEST_TLS if TLS else GUEST_HTTP, cpus=cpus)

def attempt(port, timeout):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        s.settimeout(timeout)
        if TLS:
            # As curl and browsers do: with Nagle the request would wait behind the
            # unacknowledged Finished for the host's delayed ACK (~40 ms measured).
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s = TLS.wrap_socket(s, server_hostname="localhost")
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                return False
            data += chunk
        return data.startswith(b"HTTP/1.1 200")
    finally:
        s.close()

def one(image, port):
    cmd = command(image, port)
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, start_new_session=True)
    marks = {}
    def reader():
        for line in p.stdout:
            now = time.monotonic() - t0
            if "first" not in marks and line.strip():
                marks["first"] = now
            if b"serving" in line and "serving" not in marks:
                marks["serving"] = now
    threading.Thread(target=reader, daemon=True).start()
    try:
        while time.monotonic() - t0 < 60:
            try:
                if attempt(port, 0.05):
                    return time.monotonic() - t0, marks.get("first", 0), marks.get("serving", 0)
            except OSError:
                pass
            time.sleep(0.002)
        raise RuntimeError("no response within 60 s")
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait()

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("image")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--port", type=int, default=0, help="default: a free port")
    ap.add_argument("--https", metavar="CA", help="measure the first HTTPS response (CA: PEM file)")
    a = ap.parse_args()
    if a.https:
        global TLS
        TLS = ssl.create_default_context(cafile=a.https)
    if not a.port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            a.port = s.getsockname()[1]
    res = [one(a.image, a.port) for _ in range(a.runs)]
    def med(i):
        return statistics.median(r[i] * 1000 for r in res)
    ms = sorted(r[0] * 1000 for r in res)
    print("runs=%d first-response median=%.0f ms (min %.0f, max %.0f); "
          "median first serial output %.0f ms, 'serving' line %.0f ms" % (
        len(ms), med(0), ms[0], ms[-1], med(1), med(2)))

if __name__ == "__main__":
    main()
