"""The booted image lingers after its last response, like the Python core.

After the last response on a connection (``Connection: close``, a fatal 4xx) the
Python core shuts its sending side and reads and discards input until the peer's
EOF, at most ``policy.LINGER`` seconds (core/connection.py ``_finish``): closing
with unread input, or with input still on its way, answers with a reset, and a
reset destroys whatever response the client has not read yet. The lwIP glue
(unikernel/src/http.c) does the same; these are the two ways that showed it:
a ``Connection: close`` download followed by 200 KB of pipelined requests read
slowly, and a fatal 400 queued behind a compressed download with more bytes
after it. Each must deliver every byte of every response, then a clean EOF.
"""

from __future__ import annotations

import gzip
import os
import shutil
import socket
import threading
import time

import pytest
from conftest import DEMO, TEST_LIMITS
from unikernel_target import boot

pytestmark = pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                                reason="apt-get install qemu-system-x86")

BIG = "/files/big.txt"
WAIT = 60  # seconds any single wait may take before it counts as a hang


@pytest.fixture(scope="module")
def vm():
    booted = boot(DEMO, [], TEST_LIMITS)
    yield booted
    booted.stop()


def big() -> bytes:
    with open(os.path.join(DEMO, "files", "big.txt"), "rb") as f:
        return f.read()


def responses(data: bytes) -> list[tuple[bytes, bytes]]:
    """(head, body) of each response in ``data``, by Content-Length; a short last
    body is returned as it is (the assertion shows how much arrived)."""
    out = []
    while data:
        end = data.find(b"\r\n\r\n")
        assert end >= 0, data[:200]
        head, rest = data[:end], data[end + 4:]
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                      if line.lower().startswith(b"content-length:"))
        out.append((head, rest[:length]))
        data = rest[length:]
    return out


def read_all(s: socket.socket, pause: float = 0.0) -> tuple[bytes, str]:
    """Everything until EOF, and how the stream ended ("eof" or the error's name)."""
    got = bytearray()
    while True:
        try:
            chunk = s.recv(8192)
        except OSError as e:  # ECONNRESET: the reset this file is about
            return bytes(got), type(e).__name__
        if not chunk:
            return bytes(got), "eof"
        got += chunk
        if pause:
            time.sleep(pause)


def connect(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32768)  # a small window: a slow reader
    s.settimeout(WAIT)
    s.connect(("127.0.0.1", port))
    return s


def send_in_background(s: socket.socket, data: bytes) -> threading.Thread:
    def send() -> None:
        try:
            s.sendall(data)
        except OSError:  # the reset under test; the reader reports it
            pass
    t = threading.Thread(target=send, daemon=True)
    t.start()
    return t


def test_close_download_then_pipelined_requests(vm):
    """A ``Connection: close`` GET of 1.2 MB, then 200 KB of requests it will never
    answer, read slowly: the whole file arrives and the stream ends with EOF."""
    first = (f"GET {BIG} HTTP/1.1\r\nHost: x\r\nAccept-Encoding: identity\r\n"
             "Connection: close\r\n\r\n").encode()
    more = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * (200_000 // 27)
    s = connect(vm.port)
    with s:
        sender = send_in_background(s, first + more)
        got, end = read_all(s, pause=0.002)
        sender.join(WAIT)
    resp = responses(got)
    assert [h.split(b"\r\n", 1)[0] for h, _ in resp] == [b"HTTP/1.1 200 OK"], got[:300]
    assert len(resp[0][1]) == len(big()), f"{len(got)} bytes, then {end}"
    assert resp[0][1] == big()
    assert end == "eof"


def test_fatal_400_behind_a_download_then_more_bytes(vm):
    """A gzip download, a request with ``X : y`` (400, fatal), then 3,000+ bytes:
    the download and the 400 arrive whole, then EOF."""
    data = (f"GET {BIG} HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n"
            "GET / HTTP/1.1\r\nHost: x\r\nX : y\r\n\r\n").encode() + b"z" * 3200
    s = connect(vm.port)
    with s:
        sender = send_in_background(s, data)
        got, end = read_all(s, pause=0.001)
        sender.join(WAIT)
    resp = responses(got)
    statuses = [h.split(b"\r\n", 1)[0] for h, _ in resp]
    assert statuses == [b"HTTP/1.1 200 OK", b"HTTP/1.1 400 Bad Request"], \
        f"{statuses}: {len(got)} bytes, then {end}"
    assert gzip.decompress(resp[0][1]) == big()
    assert end == "eof"
