"""Which protocol a cleartext byte stream speaks: HTTP/1.1 or HTTP/2 (h2c).

Strategy: RFC 9113 §3.3 lets a client that knows the server speaks HTTP/2
start with the 24-byte connection preface. A connection starts as
``Sniffing``: its first bytes either begin the preface (it becomes ``H2Front``,
whose contract calls go to an ``H2Connection``) or do not (it becomes
``Http1``, the core's ``Connection`` unchanged). The three classes share one
layout, so the switch is an assignment to ``__class__`` on the object the loop
body already holds: the loop never learns, and a plain HTTP/1.1 connection
pays nothing after its first read — a delegating wrapper would cost a Python
call per contract access on every request (measured in a core-only loop of
receive/outgoing/sent: 2.4 µs per request switched, 5.4 µs wrapped).

The same classes sit inside TLS (``orisha/protocols/tls.py``), where ALPN
decides instead of the first bytes (RFC 9113 §3.2).
"""

from __future__ import annotations

from ..core.connection import Connection
from .h2 import PREFACE, H2Connection

_PRI_LINE = PREFACE.index(b"\r\n") + 2  # "PRI * HTTP/2.0\r\n"


class _Front(Connection):
    """A ``Connection`` with one more slot, ``proto``: the HTTP/2 connection once switched."""
    __slots__ = ("proto",)

    def refuse(self, now: float) -> None:
        """Over the connection limit: HTTP/1.1 503 and close (as ``App.connect`` does)."""
        self.__class__ = Http1
        self._error(503, now)


class Http1(_Front):
    """HTTP/1.1: the core's ``Connection`` as it is."""
    __slots__ = ()


class Sniffing(_Front):
    """The first read decides: the h2 preface, or HTTP/1.1."""
    __slots__ = ()

    def receive(self, data: bytes, now: float) -> None:
        buf = self.buf + data if self.buf else data
        n = min(len(buf), len(PREFACE))
        if data and buf[:n] == PREFACE[:n]:
            if n < len(PREFACE):
                self.buf = buf  # a prefix of the preface: wait for the rest
            else:
                to_h2(self, now, buf[n:], preface=False)
            return
        if data and buf[:_PRI_LINE] == PREFACE[:_PRI_LINE]:
            # The preface's first line came whole: an HTTP/2 client, whose broken preface is
            # a connection error (RFC 9113 §3.4: GOAWAY PROTOCOL_ERROR), not an HTTP/1.1 505.
            to_h2(self, now, buf)
            return
        self.__class__ = Http1
        self.buf = b""
        if buf:
            Connection.receive(self, buf, now)
        if not data:
            Connection.receive(self, b"", now)


class H2Front(_Front):
    """The loop-body contract, passed to ``self.proto`` (an ``H2Connection``)."""
    __slots__ = ()

    outgoing = property(lambda self: self.proto.out)
    wants_read = property(lambda self: self.proto.wants_read)
    should_close = property(lambda self: self.proto.should_close)
    shut_write = property(lambda self: self.proto.shut_write)

    def receive(self, data: bytes, now: float) -> None:
        self.proto.receive(data, now)

    def sent(self, n: int, now: float) -> None:
        self.proto.sent(n, now)

    def tick(self, now: float) -> None:
        self.proto.tick(now)

    def shutdown(self, now: float) -> None:
        self.proto.shutdown(now)

    def close(self) -> None:
        self.proto.close()
        Connection.close(self)


def to_h2(conn: _Front, now: float, data: bytes = b"", preface: bool = True,
          refuse: bool = False) -> None:
    """Switch ``conn`` to HTTP/2 and feed it ``data``; ``preface``: still expected."""
    conn.__class__ = H2Front
    conn.buf = b""
    conn.proto = H2Connection(conn.app, now, conn.peer, preface=preface, refuse=refuse)
    if data:
        conn.proto.receive(data, now)


class Plain:
    """The cleartext port: HTTP/1.1, and HTTP/2 with prior knowledge."""

    name = "http"
    # The class its HTTP/1.1 connections become (Sniffing's choice): the core's Connection,
    # overriding none of the contract, so the compiled loops call it at C level
    # (orisha/loops/seam.pxd).
    h1_type = Http1

    def connect(self, app, now: float, peer: str, refuse: bool) -> Connection:
        conn = Sniffing(app, now, peer)
        if refuse:
            conn.refuse(now)
        return conn
