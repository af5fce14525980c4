"""Hostile HTTP/2 and TLS peers: each gets the RFC's answer and never grows memory unbounded.

In memory first (the exact GOAWAY/RST code for each attack, and bounded output
when the peer never reads), then over real sockets on every hosted loop, over
TLS (ALPN h2) and h2c: the server answers with GOAWAY and closes.
"""

from __future__ import annotations

import socket
import struct
import time

import pytest
from h2util import (GOAWAY, HEADERS, PREFACE, RST_STREAM, frame, goaway_code, read_frames,
                    settings)
from hpack import Encoder
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st
from tlsutil import (_stop_servers, client_context, h2c_port, hosted, pki, tls_connect,  # noqa: F401
                     tls_port, tls_server)

from orisha.core.connection import App
from orisha.core.policy import Limits
from orisha.protocols import h2 as H2
from orisha.protocols.front import Plain
from orisha.serving.server import load_site

NOW = 1_700_000_000.0
PROTOCOL_ERROR, FLOW_CONTROL_ERROR, STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, \
    COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 1, 3, 5, 6, 7, 9, 11
END_STREAM, END_HEADERS = 0x1, 0x4


@pytest.fixture(scope="module")
def site(builds):
    return load_site(builds["notfound"])


def block(path: str = "/", extra=(), enc: Encoder | None = None) -> bytes:
    return (enc or Encoder()).encode([(":method", "GET"), (":path", path), (":scheme", "http"),
                                      (":authority", "x"), *extra])


def get(sid: int, path: str = "/", enc: Encoder | None = None) -> bytes:
    return frame(HEADERS, END_STREAM | END_HEADERS, sid, block(path, enc=enc))


def rapid_reset(n: int = 3000) -> bytes:
    enc = Encoder()
    return b"".join(get(2 * i + 1, enc=enc) + frame(RST_STREAM, 0, 2 * i + 1, struct.pack(">I", 8))
                    for i in range(n))


def continuation_flood(size: int = 16) -> bytes:
    b = block()
    return frame(HEADERS, END_STREAM, 1, b) + b"".join(frame(9, 0, 1, b"\0" * size if size else b"")
                                                       for _ in range(2000))


def hpack_bomb() -> bytes:
    # one 4000-byte value inserted into the dynamic table (literal with incremental indexing),
    # then referenced by index 62 thousands of times: a few KB that decode to many MB
    big = b"\x40\x01a" + b"\x7f\xbd\x1d" + b"b" * 3900  # name "a", value length 127+61+29*128
    b = block() + big + b"\xbe" * 4000
    return frame(HEADERS, END_STREAM | END_HEADERS, 1, b[:16384])


ATTACKS = {
    "rapid-reset": (rapid_reset, ENHANCE_YOUR_CALM),
    "continuation-flood": (continuation_flood, ENHANCE_YOUR_CALM),
    "empty-continuation-flood": (lambda: continuation_flood(0), ENHANCE_YOUR_CALM),
    "hpack-bomb": (hpack_bomb, COMPRESSION_ERROR),
    "settings-flood": (lambda: settings(enable_push=0) * 3000, ENHANCE_YOUR_CALM),
    "ping-flood": (lambda: frame(6, 0, 0, b"12345678") * 3000, ENHANCE_YOUR_CALM),
    "priority-flood": (lambda: b"".join(frame(2, 0, 2 * i + 1, b"\0\0\0\0\x10")
                                        for i in range(3000)), ENHANCE_YOUR_CALM),
    "even-stream-id": (lambda: get(2), PROTOCOL_ERROR),
    "stream-id-goes-down": (lambda: get(5) + get(3), PROTOCOL_ERROR),
    "data-on-idle-stream": (lambda: frame(0, 0, 7, b"x"), PROTOCOL_ERROR),
    "rst-on-idle-stream": (lambda: frame(RST_STREAM, 0, 9, b"\0\0\0\0"), PROTOCOL_ERROR),
    "window-overflow": (lambda: frame(8, 0, 0, struct.pack(">I", 0x7FFFFFFF)), FLOW_CONTROL_ERROR),
    "zero-window-increment": (lambda: frame(8, 0, 0, b"\0\0\0\0"), PROTOCOL_ERROR),
    "frame-too-large": (lambda: frame(0, 0, 1, b"x" * 20000), FRAME_SIZE_ERROR),
    "ping-wrong-size": (lambda: frame(6, 0, 0, b"123"), FRAME_SIZE_ERROR),
    "push-promise": (lambda: frame(5, END_HEADERS, 1, b"\0\0\0\2"), PROTOCOL_ERROR),
    "headers-interleaved": (lambda: frame(HEADERS, END_STREAM, 1, block()) + get(3), PROTOCOL_ERROR),
    "bad-padding": (lambda: frame(HEADERS, END_HEADERS | 0x8, 1, b"\x50" + block()), PROTOCOL_ERROR),
    "bad-initial-window": (lambda: settings(initial_window_size=1 << 31), FLOW_CONTROL_ERROR),
    "bad-max-frame": (lambda: settings(max_frame_size=100), PROTOCOL_ERROR),
}


def drive(site, data: bytes, limits: Limits | None = None, read: bool = True):
    app = App(site, limits, protocols=Plain())
    conn = app.connect(NOW, "-")
    conn.receive(PREFACE + settings(), NOW)
    out = b""
    view = data
    while view and not conn.should_close:
        chunk, view = view[:65536], view[65536:]  # what a loop body reads at once
        conn.receive(chunk, NOW)
        while read and conn.outgoing:
            got = b"".join(bytes(b) for b in conn.outgoing)
            conn.sent(len(got), NOW)
            out += got
        if conn.shut_write:
            break
    return out, conn


@pytest.mark.parametrize("name", ATTACKS)
def test_each_attack_gets_the_rfcs_answer(site, name):
    make, code = ATTACKS[name]
    out, conn = drive(site, make())
    assert goaway_code(out) == code
    assert conn.shut_write or conn.should_close  # the connection ends once GOAWAY is out


def test_a_peer_that_never_reads_cannot_grow_the_output(site):
    app = App(site, protocols=Plain())
    conn = app.connect(NOW, "-")
    conn.receive(PREFACE + settings() + frame(6, 0, 0, b"12345678") * 300 + get(1, "/files/big.txt")
                 + b"".join(get(2 * i + 3) for i in range(2000)), NOW)
    assert not conn.wants_read  # backpressure: nothing more is read until output drains
    assert len(conn.outgoing) <= H2._OUT_FRAMES + 8
    assert sum(len(b) for b in conn.outgoing) < 2 * H2._OUT_HIGH


def test_zero_window_stall_and_refused_streams(site):
    limits = Limits(send_timeout=5)
    app = App(site, limits, protocols=Plain())
    conn = app.connect(NOW, "-")
    enc = Encoder()
    conn.receive(PREFACE + settings(initial_window_size=0)
                 + b"".join(get(2 * i + 1, "/files/big.txt", enc) for i in range(150)), NOW)
    out = b"".join(bytes(b) for b in conn.outgoing)
    conn.sent(len(out), NOW)
    resets = [(s, int.from_bytes(p, "big")) for t, _, s, p in read_frames(out) if t == RST_STREAM]
    assert len(resets) == 50 and {c for _, c in resets} == {REFUSED_STREAM}  # §5.1.2
    assert len(conn.proto.streams) == 100
    conn.tick(NOW + 3)
    assert not conn.outgoing
    conn.tick(NOW + 6)  # nothing moved for the send timeout: ENHANCE_YOUR_CALM, then close
    assert goaway_code(b"".join(bytes(b) for b in conn.outgoing)) == ENHANCE_YOUR_CALM
    assert not conn.proto.streams


def test_an_oversized_header_list_gets_431_and_the_connection_lives(site):
    enc = Encoder()
    big = frame(HEADERS, END_STREAM | END_HEADERS, 1,
                block(extra=[("x-big", "v" * 9000)], enc=enc))
    out, conn = drive(site, big + get(3, enc=enc))
    heads = [f for f in read_frames(out) if f[0] == HEADERS]
    from hpack import Decoder
    d = Decoder()
    statuses = [dict(d.decode(h[3]))[":status"] for h in heads]
    # "/" has early hints (issue 23): its 200 comes after a 103
    assert statuses == ["431", "103", "200"] and goaway_code(out) is None


@hsettings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 255), st.integers(0, 12),
                          st.binary(max_size=40)), max_size=30))
def test_any_frames_give_answers_or_a_goaway_never_a_crash(site, frames):
    data = b"".join(frame(t, f, s, p) for t, f, s, p in frames)
    out, conn = drive(site, data)
    for t, _, _, _ in read_frames(out):
        assert t in (0, 1, 3, 4, 6, 7, 8, 9)


# -- over real sockets, every hosted loop, TLS and h2c ----------------------------------------

def hostile(sock: socket.socket, data: bytes, timeout: float = 10) -> bytes:
    """Send preface + data (the server may close early), read until the server closes."""
    return hostile_end(sock, data, timeout)[0]


def hostile_end(sock: socket.socket, data: bytes, timeout: float = 10) -> tuple[bytes, bool]:
    """``hostile``, and whether the server ended the connection (EOF or reset) rather than
    our ``timeout``."""
    sock.settimeout(timeout)
    try:
        sock.sendall(PREFACE + settings() + data)
    except OSError:  # EPIPE/ECONNRESET: it answered and closed before all was sent
        pass
    out = b""
    closed = False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(1 << 20)
        except socket.timeout:
            break
        except OSError:  # a reset, or an SSL socket reset mid-record
            closed = True
            break
        if not chunk:
            closed = True
            break
        out += chunk
    sock.close()
    return out, closed


@pytest.fixture(params=["tls", "h2c"])
def proto(request):
    return request.param


@pytest.mark.parametrize("name", ["rapid-reset", "continuation-flood", "hpack-bomb", "ping-flood",
                                  "stream-id-goes-down", "frame-too-large"])
def test_attacks_over_real_sockets(proto, tls_port, h2c_port, pki, name):
    make, code = ATTACKS[name]
    if proto == "tls":
        sock = tls_connect(tls_port, client_context(pki, ("h2",)))
    else:
        sock = socket.create_connection(("127.0.0.1", h2c_port))
    out, closed = hostile_end(sock, make())
    assert goaway_code(out) == code
    assert closed  # by the server, not by our timeout


def test_a_bad_preface_after_alpn_h2_is_a_protocol_error(tls_port, pki):
    sock = tls_connect(tls_port, client_context(pki, ("h2",)))
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(10)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (ConnectionResetError, OSError):
        pass
    assert goaway_code(out) == PROTOCOL_ERROR


def test_a_content_length_that_is_not_digits_is_refused_and_the_connection_goes_on(tls_port, pki):
    """HTTP/2's side of test_h3_abuse's case of the same name (the same values and answers,
    test_h3_abuse.NOT_DIGITS): each on its own stream of one connection, a GET without a
    body; then a GET without one is answered 200 on the same connection."""
    import h2.config
    import h2.connection
    import h2.events
    from test_h3_abuse import NOT_DIGITS
    sock = tls_connect(tls_port, client_context(pki, ("h2",)))
    sock.settimeout(10)
    c = h2.connection.H2Connection(h2.config.H2Configuration(
        client_side=True, header_encoding=None, validate_outbound_headers=False,
        normalize_outbound_headers=False, validate_inbound_headers=False))
    c.initiate_connection()
    try:
        for value, want in NOT_DIGITS + [(None, 200)]:
            sid = c.get_next_available_stream_id()
            c.send_headers(sid, [(b":method", b"GET"), (b":path", b"/css/site.css"),
                                 (b":scheme", b"https"), (b":authority", b"localhost")]
                           + ([(b"content-length", value)] if value else []), end_stream=True)
            sock.sendall(c.data_to_send())
            got = None
            while got is None:
                data = sock.recv(65536)
                assert data, (value, "the connection was closed")
                for e in c.receive_data(data):
                    if isinstance(e, h2.events.ResponseReceived) and e.stream_id == sid:
                        got = int(dict(e.headers)[b":status"])
                    elif isinstance(e, h2.events.StreamReset) and e.stream_id == sid:
                        got = ("reset", e.error_code)
                    elif isinstance(e, h2.events.ConnectionTerminated):
                        raise AssertionError((value, e))
                sock.sendall(c.data_to_send())
            assert got == (want if want != "reset" else ("reset", PROTOCOL_ERROR)), (value, got)
    finally:
        sock.close()
