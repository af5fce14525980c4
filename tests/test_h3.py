"""HTTP/3 over QUIC on every hosted loop: the same answers as HTTP/1.1, the build's QPACK
bytes on the wire, Alt-Svc, --no-http3, random datagrams.

Servers run ``orisha serve --tls-cert --tls-key`` (HTTP/3 on by default on the same port
number over UDP); the client is aioquic's own (``aioquic.asyncio.client.connect`` and
``H3Connection``) over real loopback UDP, with the test CA of tests/tlsutil.py. Test ids
carry the loop name.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import subprocess
import time

import pytest
from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TEST_LIMITS
from httpraw import Conn
from tlsutil import _stop_servers, client_context, pki, serve, tls_connect  # noqa: F401

HOSTED = ["epoll", "io-uring", "kqueue", "asyncio", "epoll-pure", "io-uring-pure"]
_servers: dict = {}


class _Recorder(H3Connection):
    """aioquic's H3Connection, keeping every raw field section it decodes."""

    def __init__(self, quic) -> None:
        super().__init__(quic)
        self.sections: dict[int, list[bytes]] = {}

    def _decode_headers(self, stream_id, frame_data):
        if frame_data is not None:
            self.sections.setdefault(stream_id, []).append(bytes(frame_data))
        return super()._decode_headers(stream_id, frame_data)


class _Client(QuicConnectionProtocol):
    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.h3 = _Recorder(self._quic)
        self.waiting: dict[int, asyncio.Future] = {}
        self.got: dict[int, list] = {}
        self.closed = asyncio.get_running_loop().create_future()

    def quic_event_received(self, event) -> None:
        if isinstance(event, ConnectionTerminated) and not self.closed.done():
            self.closed.set_result(event)
        for e in self.h3.handle_event(event):
            r = self.got.get(e.stream_id)
            if r is None:
                continue
            if isinstance(e, HeadersReceived):
                r[0].extend(e.headers)
            elif isinstance(e, DataReceived):
                r[1] += e.data
            if getattr(e, "stream_ended", False) and not self.waiting[e.stream_id].done():
                self.waiting[e.stream_id].set_result(None)

    async def request(self, path: str, method: str = "GET", headers=()) -> tuple:
        """(status, {name: value}, body, raw field section) of one request."""
        sid = self._quic.get_next_available_stream_id()
        self.got[sid] = [[], bytearray()]
        self.waiting[sid] = asyncio.get_running_loop().create_future()
        self.h3.send_headers(sid, [(b":method", method.encode()), (b":scheme", b"https"),
                                   (b":authority", b"localhost"), (b":path", path.encode()),
                                   *[(k.lower().encode(), v.encode()) for k, v in headers]],
                             end_stream=True)
        self.transmit()
        await asyncio.wait_for(self.waiting[sid], 20)
        fields, body = self.got.pop(sid)
        d = {}
        for k, v in fields:
            d[k.decode()] = v.decode()
        return int(d.pop(":status")), d, bytes(body), self.h3.sections[sid][0]


def h3_get(port: int, ca: str, requests: list) -> list:
    """Every (path, method, headers) of ``requests`` on one connection, concurrently."""
    async def run():
        config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name="localhost")
        config.load_verify_locations(ca)
        async with connect("127.0.0.1", port, configuration=config, create_protocol=_Client,
                           wait_connected=True) as client:
            return await asyncio.gather(*(client.request(*r) for r in requests))
    return asyncio.run(asyncio.wait_for(run(), 60))


@pytest.fixture(scope="module", params=HOSTED)
def hosted(request):
    return request.param


def h3_server(builds, loop: str, pki, *extra: str):
    key = (loop, extra)
    if key not in _servers:
        env = {**os.environ, "ORISHA_PURE": "1"} if loop.endswith("-pure") else None
        _servers[key] = serve(builds["notfound"], "--loop", loop, "--workers", "2", *TEST_LIMITS,
                              "--tls-cert", pki.chain, "--tls-key", pki.key, *extra, env=env)
    return _servers[key]


@pytest.fixture(scope="module", autouse=True)
def _stop_h3_servers():
    yield
    for s in _servers.values():
        s.stop()
    _servers.clear()


def test_smoke(builds, hosted, pki):
    s = h3_server(builds, hosted, pki)
    (status, fields, body, _), = h3_get(s.port, pki.ca, [("/", "GET", ())])
    assert status == 200 and body.startswith(b"<!doctype") or body, (status, fields)
