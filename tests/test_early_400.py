"""Early 400: bytes that cannot begin a request line are refused at once, on every target.

A request line starts with a method, and a method is a token (RFC 9110 §9.1,
§5.6.2). When the first byte after any leading empty lines is not a token
character (a TLS ClientHello, NUL, binary junk), or the method shows a
non-token byte before its space, no line end can make the request valid:
the server answers 400 and closes without waiting for a line end or the head
timeout (nginx does the same).

The client never sends a complete head and never half-closes, so only the
bytes can make the server answer. The read timeout is generous but shorter than
the servers' head timeout, so a server that waits for it fails here; and the
suite's servers run with ``--head-timeout 2``, whose 408 fails the status check.
"""

from __future__ import annotations

import socket

import pytest

# A TLS 1.2 ClientHello record as a browser opens an https:// URL on a plain port
# (record type 0x16 handshake, version 3.1).
CLIENT_HELLO = bytes.fromhex(
    "16030100c4010000c00303" + "5a" * 32 + "00" + "0020" + "c02bc02fc02cc030cca9cca8c013c014"
    "009c009d002f0035000a" + "0100" + "0077" + "0000001300110000" "0e7777772e6578616d706c652e636f6d"
    + "000b000403000102" + "000a000a0008001d001700180019" + "0023" "0000" + "000d0020001e"
    + "0403050306030804080508060401050106010402050206020303" + "00160000" + "00170000")

CASES = {
    "tls-client-hello": CLIENT_HELLO,
    "tls-record-head": b"\x16\x03\x01\x02\x00\x01",
    "nul-first": b"\x00GET / HTTP/1.1",
    "empty-lines-then-binary": b"\r\n\r\n\x80\x81",
    "space-first": b" GET / HTTP/1.1",
    "bad-byte-in-method": b"G(T / HTTP/1.1",
    "control-byte-in-method": b"GE\x01T",
}


def read_until_closed(sock: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # closed with our bytes unread: what arrived is the answer
            return out
        if not chunk:
            return out
        out += chunk


@pytest.mark.parametrize("data", CASES.values(), ids=CASES.keys())
def test_bytes_that_cannot_begin_a_request_get_400_at_once(port, data):
    rest = data.lstrip(b"\r\n")  # empty lines before a request line are ignored (RFC 9112 §2.2)
    assert b"\n\n" not in rest and b"\n\r\n" not in rest  # never a complete head
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        s.sendall(data)
        # socket.timeout here means the server waited: for a line end, or for the head timeout
        out = read_until_closed(s)
    finally:
        s.close()
    assert out.startswith(b"HTTP/1.1 400 Bad Request\r\n"), out[:200]
    assert b"Connection: close\r\n" in out


def test_a_method_still_arriving_is_waited_for(port):
    """Token bytes alone decide nothing: a slow client's "GE" is not refused."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        s.sendall(b"GE")
        s.settimeout(0.5)
        with pytest.raises(socket.timeout):
            s.recv(1)
        s.settimeout(5)
        s.sendall(b"T / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        out = read_until_closed(s)
    finally:
        s.close()
    assert out.startswith(b"HTTP/1.1 200 OK\r\n"), out[:200]
