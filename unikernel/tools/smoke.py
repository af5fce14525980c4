#!/usr/bin/env python3
"""End-to-end smoke test: build an image with a random 1 MiB blob, boot it
under QEMU (run.sh; ACCEL/MACHINE env honoured), check HTTP behaviour with
real sockets and curl, then stop QEMU. Prints 'N passed, N failed'.

usage: tools/smoke.py [--size BYTES]
"""
import argparse, os, shutil, signal, socket, subprocess, sys, tempfile, time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def read_response(s, buf):
    """Read one response from socket s (buffer buf); returns (head, body, rest)."""
    while b"\r\n\r\n" not in buf:
        c = s.recv(1 << 16)
        if not c:
            raise EOFError("connection closed in head")
        buf += c
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v)
    chunks = [rest]
    have = len(rest)
    while have < length:
        c = s.recv(1 << 20)
        if not c:
            raise EOFError("connection closed in body")
        chunks.append(c)
        have += len(c)
    data = b"".join(chunks)
    return head.decode("latin-1"), data[:length], data[length:]

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1 << 20)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="orisha-smoke-")
    blob = os.path.join(tmp, "site.bin")
    with open(blob, "wb") as f:
        f.write(os.urandom(a.size))
    body = open(blob, "rb").read()
    image = os.path.join(tmp, "orisha.img")
    subprocess.run([os.path.join(ROOT, "build.sh"), blob, image], check=True,
                   stdout=subprocess.DEVNULL)
    port = free_port()
    log = open(os.path.join(tmp, "serial.log"), "wb")
    qemu = subprocess.Popen([os.path.join(ROOT, "run.sh"), image, str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    results = []

    def check(name, fn):
        try:
            fn()
            results.append((name, None))
            print("PASS", name)
        except Exception as e:  # noqa: BLE001 - report any failure
            results.append((name, e))
            print("FAIL", name, "-", e)

    try:
        deadline = time.time() + 60
        while b"serving" not in open(log.name, "rb").read():
            if time.time() > deadline or qemu.poll() is not None:
                raise SystemExit("guest did not come up; serial log: %s" % log.name)
            time.sleep(0.02)

        def t_curl_keepalive():
            out = subprocess.run(
                ["curl", "-sS", "--max-time", "20", "-o", os.path.join(tmp, "o1"),
                 "-w", "%{http_code} %{num_connects}\\n",
                 "http://127.0.0.1:%d/a" % port, "-o", os.path.join(tmp, "o2"),
                 "http://127.0.0.1:%d/b" % port],
                check=True, capture_output=True, text=True).stdout.split("\n")
            assert out[0].split() == ["200", "1"], out
            assert out[1].split() == ["200", "0"], "second request not reusing: %r" % out
            for n in ("o1", "o2"):
                assert open(os.path.join(tmp, n), "rb").read() == body, "body mismatch"

        def t_pipelined():
            s = socket.create_connection(("127.0.0.1", port), timeout=20)
            req = b"".join(b"GET /%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(5))
            for i in range(0, len(req), 5):  # split heads across segments
                s.sendall(req[i:i + 5])
            buf = b""
            for _ in range(5):
                head, got, buf = read_response(s, buf)
                assert head.startswith("HTTP/1.1 200 OK"), head
                assert got == body
            s.close()

        def t_connection_close():
            s = socket.create_connection(("127.0.0.1", port), timeout=20)
            s.sendall(b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n")
            head, got, rest = read_response(s, b"")
            assert "Connection: close" in head and got == body
            assert s.recv(1) == b"", "server did not close"

        def t_http10():
            s = socket.create_connection(("127.0.0.1", port), timeout=20)
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            head, got, rest = read_response(s, b"")
            assert got == body and s.recv(1) == b""

        def t_date_header():
            s = socket.create_connection(("127.0.0.1", port), timeout=20)
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            head, _, _ = read_response(s, b"")
            date = [l for l in head.split("\r\n") if l.startswith("Date: ")]
            assert date and date[0].endswith(" GMT"), head
            s.close()

        def t_many_connections():
            socks = [socket.create_connection(("127.0.0.1", port), timeout=20) for _ in range(20)]
            for s in socks:
                s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            for s in socks:
                head, got, _ = read_response(s, b"")
                assert got == body
                s.close()

        for name, fn in [("curl keep-alive x2", t_curl_keepalive),
                         ("pipelined x5, split heads", t_pipelined),
                         ("Connection: close", t_connection_close),
                         ("HTTP/1.0 closes", t_http10),
                         ("Date header", t_date_header),
                         ("20 concurrent connections", t_many_connections)]:
            check(name, fn)
        check("guest still alive", lambda: qemu.poll() is None or (_ for _ in ()).throw(
            AssertionError("qemu exited %s" % qemu.returncode)))
    finally:
        os.killpg(qemu.pid, signal.SIGTERM)
        qemu.wait()
    failed = sum(1 for _, e in results if e)
    print("%d passed, %d failed" % (len(results) - failed, failed))
    if b"PANIC" in open(log.name, "rb").read():
        print("serial log shows a PANIC:", log.name)
        return 1
    if failed:
        print("serial log kept in", log.name)
        return 1
    shutil.rmtree(tmp, ignore_errors=True)
    return 0

if __name__ == "__main__":
    sys.exit(main())
