"""A tiny raw HTTP/1.1 client for the tests: bytes on a real socket, responses parsed strictly.

The suite talks to servers through real sockets so the same tests run against
every loop body, the container and the unikernel.
"""

from __future__ import annotations

import re
import socket
import time
from dataclasses import dataclass, field

STATUS = re.compile(rb"HTTP/1\.1 (\d{3}) [^\r\n]*")


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes
    raw_head: bytes = b""
    fields: list[tuple[str, str]] = field(default_factory=list)

    def h(self, name: str) -> str | None:
        return self.headers.get(name.lower())


class Closed(ConnectionError):
    pass


class Conn:
    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> None:
        data = self.sock.recv(1 << 20)
        if not data:
            raise Closed()
        self.buf += data

    def read(self, head_only: bool = False) -> Response:
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        m = STATUS.fullmatch(lines[0])
        assert m, f"bad status line {lines[0]!r}"
        headers: dict[str, str] = {}
        fields = []
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            assert sep and name == name.strip() and name, f"bad header line {line!r}"
            k, v = name.decode().lower(), value.strip().decode("latin-1")
            assert k not in headers or k in ("vary",), f"duplicate header {k}"
            headers[k] = v
            fields.append((k, v))
        status = int(m.group(1))
        length = 0
        if not head_only and status not in (204, 304) and status >= 200:
            assert "content-length" in headers, f"no Content-Length in {head!r}"
            length = int(headers["content-length"])
        while len(self.buf) < length:
            self._fill()
        body, self.buf = self.buf[:length], self.buf[length:]
        return Response(status, headers, body, head, fields)

    def request(self, path: str = "/", method: str = "GET", headers: dict | None = None,
                version: str = "HTTP/1.1") -> Response:
        hs = {"Host": "test"}
        hs.update(headers or {})
        self.send(f"{method} {path} {version}\r\n".encode("utf-8")
                  + b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in hs.items()) + b"\r\n")
        return self.read(head_only=method == "HEAD")

    def closed(self, timeout: float = 5.0) -> bool:
        """True when the server closes (EOF or RST) within ``timeout`` with no more bytes."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False
        return data == b"" and self.buf == b""

    def close(self) -> None:
        self.sock.close()


def exchange(port: int, data: bytes | list[bytes], timeout: float = 10.0) -> bytes:
    """Send raw bytes (or several writes), half-close, and read everything until the
    server closes. The server may answer and close before all is sent: that is fine."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        try:
            for chunk in [data] if isinstance(data, bytes) else data:
                s.sendall(chunk)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # EPIPE/ECONNRESET/ENOTCONN: the server already answered and closed
            pass
        out = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(1 << 20)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        return out
    finally:
        s.close()


def read_to_close(sock, resets: type[BaseException] | tuple = ()) -> bytes:
    """Everything ``sock`` receives until the peer closes; ``resets``: exceptions that
    also end the read (a reset after the server's close), with what came before."""
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except resets:
        pass
    return out


def split_responses(data: bytes) -> list[tuple[int, dict, bytes]]:
    """Parse a byte stream of responses to non-HEAD requests."""
    out = []
    while data:
        head, sep, data = data.partition(b"\r\n\r\n")
        assert sep, f"truncated head {head[:200]!r}"
        lines = head.split(b"\r\n")
        m = STATUS.fullmatch(lines[0])
        assert m, f"bad status line {lines[0]!r}"
        hs = {}
        for line in lines[1:]:
            k, _, v = line.partition(b":")
            hs[k.decode().lower()] = v.strip().decode("latin-1")
        status = int(m.group(1))
        n = int(hs.get("content-length", 0)) if status != 304 else 0
        body, data = data[:n], data[n:]
        assert len(body) == n, "truncated body"
        out.append((status, hs, body))
    return out
