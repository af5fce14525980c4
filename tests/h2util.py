"""HTTP/2 clients for the tests: the ``h2`` library over a real socket, and a raw frame reader.

``H2Client`` speaks h2 (over TLS after ALPN, or h2c with prior knowledge) and
fetches many requests as concurrent streams on one connection. ``read_frames``
splits raw server bytes into (type, flags, stream, payload) so hostile tests
can check the exact GOAWAY or RST_STREAM the server answered.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

import h2.config
import h2.connection
import h2.events
import h2.settings

GOAWAY, RST_STREAM, SETTINGS, HEADERS, DATA = 7, 3, 4, 1, 0
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@dataclass
class H2Response:
    status: int
    headers: dict[str, str]
    body: bytes
    reset: int | None = None  # the RST_STREAM error code, if the stream was reset

    def h(self, name: str) -> str | None:
        return self.headers.get(name)


class H2Client:
    def __init__(self, sock: socket.socket, settings: dict | None = None) -> None:
        self.sock = sock
        self.c = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=True, header_encoding=None, validate_inbound_headers=False))
        codes = {getattr(h2.settings.SettingCodes, k.upper()): v for k, v in (settings or {}).items()}
        self.c.local_settings = h2.settings.Settings(client=True, initial_values=codes)
        self.c.initiate_connection()
        self.sock.sendall(self.c.data_to_send())
        self.goaway: int | None = None

    def fetch(self, requests: list[tuple[str, str, dict]], authority: str = "localhost",
              scheme: str = "https", read_window: bool = True) -> list[H2Response]:
        """Send every request (method, path, headers) as its own stream at once; wait for all."""
        order, got = [], {}
        for method, path, headers in requests:
            sid = self.c.get_next_available_stream_id()
            hs = [(":method", method), (":path", path), (":scheme", scheme),
                  (":authority", authority)] + list(headers.items())
            self.c.send_headers(sid, hs, end_stream=True)
            order.append(sid)
            got[sid] = H2Response(0, {}, b"")
        self.sock.sendall(self.c.data_to_send())
        open_ = set(order)
        while open_:
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError(f"closed with {len(open_)} streams open (GOAWAY {self.goaway})")
            for e in self.c.receive_data(data):
                r = got.get(getattr(e, "stream_id", 0))
                if isinstance(e, h2.events.ResponseReceived):
                    hs = {k.decode(): v.decode("latin-1") for k, v in e.headers}
                    r.status = int(hs.pop(":status"))
                    r.headers = hs
                elif isinstance(e, h2.events.DataReceived):
                    r.body += e.data
                    if read_window:
                        self.c.acknowledge_received_data(e.flow_controlled_length, e.stream_id)
                elif isinstance(e, h2.events.StreamEnded):
                    open_.discard(e.stream_id)
                elif isinstance(e, h2.events.StreamReset):
                    r.reset = e.error_code
                    open_.discard(e.stream_id)
                elif isinstance(e, h2.events.ConnectionTerminated):
                    self.goaway = e.error_code
            out = self.c.data_to_send()
            if out:
                self.sock.sendall(out)
        return [got[sid] for sid in order]

    def get(self, path: str = "/", method: str = "GET", **headers) -> H2Response:
        return self.fetch([(method, path, {k.replace("_", "-"): v for k, v in headers.items()})])[0]

    def close(self) -> None:
        self.sock.close()


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((ftype, flags)) + struct.pack(">I", sid) + payload


def settings(**values) -> bytes:
    ids = {"header_table_size": 1, "enable_push": 2, "max_concurrent_streams": 3,
           "initial_window_size": 4, "max_frame_size": 5, "max_header_list_size": 6}
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", ids[k], v) for k, v in values.items()))


def read_frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out = []
    while len(data) >= 9:
        n = int.from_bytes(data[:3], "big")
        if len(data) < 9 + n:
            break
        out.append((data[3], data[4], int.from_bytes(data[5:9], "big") & 0x7FFFFFFF, data[9:9 + n]))
        data = data[9 + n:]
    return out


def goaway_code(data: bytes) -> int | None:
    """The error code of the last GOAWAY in ``data``, or None."""
    codes = [int.from_bytes(p[4:8], "big") for t, _, _, p in read_frames(data) if t == GOAWAY]
    return codes[-1] if codes else None
