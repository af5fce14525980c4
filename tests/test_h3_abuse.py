"""HTTP/3 stream and flow-control abuse (issue 22, item 4): each case ends with the error
RFC 9000 / RFC 9114 names, read from the abusive client's own ConnectionTerminated (the
server's CONNECTION_CLOSE on the wire), the worker's memory bounded (VmRSS from /proc
before and after a bounded flood) and the worker answering a well-behaved client after.

The abusive client is aioquic's ``QuicConnection`` driven over a real loopback UDP socket by
``_Raw``: after the handshake it writes stream bytes itself (HTTP/3 frames made by hand),
and where a case needs what a conforming client cannot send — a stream past MAX_STREAMS, a
byte past the flow-control window — it lifts its own view of the server's limits first, so
the frames go out as an attacker's would.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from aioquic.buffer import encode_uint_var
from aioquic.h3.connection import H3_ALPN, ErrorCode, FrameType, StreamType
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated, HandshakeCompleted, StreamReset
from aioquic.quic.packet import QuicErrorCode

from conftest import TEST_LIMITS
from orisha.protocols.fields import FRAME_HEADS, H3_MAX_STREAMS
from test_h3 import _children, h3_get
from tlsutil import pki, serve  # noqa: F401  (pki: a fixture)

_servers: list = []


@pytest.fixture(scope="module")
def server(builds, pki):
    """One single-worker server for the module (its one worker's RSS is the one measured)."""
    s = serve(builds["notfound"], "--loop", "epoll", "--workers", "1", *TEST_LIMITS,
              "--tls-cert", pki.chain, "--tls-key", pki.key)
    try:
        yield s
    finally:
        s.stop()


def _worker(s) -> int:
    kids = _children(s.proc.pid)
    assert len(kids) == 1, kids
    return int(kids[0])


def _rss(pid: int) -> int:
    """The worker's resident set, bytes (VmRSS of /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _frame(kind: int, payload: bytes) -> bytes:
    return encode_uint_var(kind) + encode_uint_var(len(payload)) + payload


_GET = None  # a request's HEADERS frame, made once by aioquic's own encoder (_headers_frame)


def _headers_frame() -> bytes:
    """HEADERS of GET / (literals only, no dynamic table: pylsqpack with capacity 0)."""
    global _GET
    if _GET is None:
        import pylsqpack
        _, section = pylsqpack.Encoder().encode(0, [
            (b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"localhost"),
            (b":path", b"/")])
        _GET = _frame(FrameType.HEADERS, section)
    return _GET


class _Raw:
    """An HTTP/3 client that writes its streams' bytes itself, over a real UDP socket."""

    def __init__(self, port: int, ca: str, settings: bool = True) -> None:
        config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN,
                                   server_name="localhost", idle_timeout=30)
        config.load_verify_locations(ca)
        self.quic = QuicConnection(configuration=config)
        self.addr = ("127.0.0.1", port)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.connect(self.addr)
        self.closed: ConnectionTerminated | None = None
        self.data: dict[int, bytearray] = {}  # stream → bytes the server sent on it
        self.ended: set[int] = set()
        self.resets: dict[int, int] = {}  # stream → the error code the server reset it with
        self.quic.connect(self.addr, time.time())
        self.run(lambda: self.handshaken, 10)
        if settings:  # the control stream with an empty SETTINGS (RFC 9114 §6.2.1)
            self.uni(StreamType.CONTROL, _frame(FrameType.SETTINGS, b""))

    handshaken = False

    def close(self) -> None:
        self.sock.close()

    def uni(self, kind: int, data: bytes = b"") -> int:
        sid = self.quic.get_next_available_stream_id(is_unidirectional=True)
        self.quic.send_stream_data(sid, encode_uint_var(kind) + data)
        return sid

    def flush(self) -> None:
        for data, _ in self.quic.datagrams_to_send(time.time()):
            try:
                self.sock.send(data)
            except BlockingIOError:  # loopback buffer full: lost, QUIC retransmits
                pass

    def run(self, done, seconds: float) -> None:
        """Move datagrams both ways until ``done()`` or the connection ended (or fail)."""
        deadline = time.monotonic() + seconds
        while True:
            self.flush()
            self._events()
            if done() or self.closed is not None:
                return
            if time.monotonic() > deadline:
                raise AssertionError("timed out")
            t = self.quic.get_timer()
            wait = 0.05 if t is None else max(0.0, min(0.05, t - time.time()))
            self.sock.settimeout(wait)
            try:
                while True:
                    d = self.sock.recv(65536)
                    self.quic.receive_datagram(d, self.addr, time.time())
                    self.sock.settimeout(0)
            except (TimeoutError, BlockingIOError):  # nothing (more) to read this turn
                pass
            except ConnectionRefusedError:  # the server's port is gone
                raise AssertionError("the server's UDP port refused") from None
            t = self.quic.get_timer()
            if t is not None and time.time() >= t:
                self.quic.handle_timer(time.time())

    def _events(self) -> None:
        e = self.quic.next_event()
        while e is not None:
            if isinstance(e, HandshakeCompleted):
                self.handshaken = True
            elif isinstance(e, ConnectionTerminated):
                self.closed = e
            elif isinstance(e, StreamReset):
                self.resets[e.stream_id] = e.error_code
            elif hasattr(e, "data") and hasattr(e, "stream_id"):
                self.data.setdefault(e.stream_id, bytearray()).extend(e.data)
                if e.end_stream:
                    self.ended.add(e.stream_id)
            e = self.quic.next_event()

    def until_closed(self, seconds: float = 10) -> ConnectionTerminated:
        deadline = time.monotonic() + seconds
        while self.closed is None and time.monotonic() < deadline:
            self.run(lambda: self.closed is not None, seconds)
        assert self.closed is not None, "the server did not close the connection"
        return self.closed


def _answers(s, pki) -> None:
    """A well-behaved client on a fresh connection still gets its page."""
    assert h3_get(s.port, pki.ca, [("/", "GET", ())])[0][0] == 200


def test_a_stream_past_max_streams_is_stream_limit_error(server, pki):
    """RFC 9000 §4.6: a client that opens more bidirectional streams than the server's
    MAX_STREAMS allowed (fields.H3_MAX_STREAMS) gets STREAM_LIMIT_ERROR."""
    c = _Raw(server.port, pki.ca)
    try:
        allowed = c.quic._remote_max_streams_bidi
        assert allowed == H3_MAX_STREAMS == 100
        c.quic._remote_max_streams_bidi = 1 << 20  # ignore the server's limit
        sid = 4 * allowed  # the (allowed + 1)th client stream
        c.quic.send_stream_data(sid, _headers_frame(), True)
        closed = c.until_closed()
        assert closed.error_code == QuicErrorCode.STREAM_LIMIT_ERROR, closed
    finally:
        c.close()
    _answers(server, pki)


def _past_window(c: _Raw, sid: int, offset: int) -> None:
    """One byte at ``offset`` of stream ``sid``, whatever window the server gave."""
    q = c.quic
    q._remote_max_data = 1 << 40
    stream = q._get_or_create_stream_for_send(sid)
    stream.max_stream_data_remote = 1 << 40
    sender = stream.sender
    sender._buffer_start = sender._buffer_stop = offset  # as if the bytes before were acked
    sender.write(b"x")


def test_stream_data_past_the_window_is_flow_control_error(server, pki):
    """RFC 9000 §4.1: a byte past the stream's flow-control window is FLOW_CONTROL_ERROR."""
    c = _Raw(server.port, pki.ca)
    try:
        sid = c.quic.get_next_available_stream_id()
        window = c.quic._remote_max_stream_data_bidi_remote
        _past_window(c, sid, window)
        closed = c.until_closed()
        assert closed.error_code == QuicErrorCode.FLOW_CONTROL_ERROR, closed
    finally:
        c.close()
    _answers(server, pki)


def _edge(c: _Raw, sid: int) -> int:
    """One byte at the last offset the server allows on ``sid`` now (its stream window and
    what is left of the connection's), the bytes before it never sent: the offset."""
    q = c.quic
    stream = q._get_or_create_stream_for_send(sid)
    sender = stream.sender
    room = q._remote_max_data - q._remote_max_data_used  # the client counts gaps as used
    offset = min(stream.max_stream_data_remote, sender.highest_offset + room) - 1
    if offset < sender._buffer_stop:
        return -1
    sender._buffer_start = sender._buffer_stop = offset  # as if the bytes before were acked
    sender.write(b"x")
    return offset


def test_bytes_at_each_window_edge_do_not_grow_the_windows(server, pki):
    """A client that sends one byte at the edge of each window the server grants, leaving
    the rest a gap, must not make it grant more: aioquic doubled a stream's window whenever
    the highest offset seen passed half of it, gaps included (and allocated each gap for
    reassembly), and the connection's likewise, so one datagram per stream made a worker
    allocate a megabyte. The stream window is credit over what was delivered in order; the
    byte past it is FLOW_CONTROL_ERROR, and the worker's memory stays put."""
    worker = _worker(server)
    before = _rss(worker)
    c = _Raw(server.port, pki.ca)
    try:
        sids = []
        for _ in range(28):  # 28 MiB of gaps with aioquic's windows (within the idle timeout)
            sid = c.quic.get_next_available_stream_id()
            sids.append(sid)
            _edge(c, sid)
            _edge(c, sid)  # once more, past a window the first might have grown
            _settle(c, 0.05)
        assert c.closed is None, c.closed
        windows = {c.quic._streams[sid].max_stream_data_remote for sid in sids}
        assert max(windows) <= 64 * 1024, windows
        grown = _rss(worker) - before
        _past_window(c, sids[0], c.quic._streams[sids[0]].max_stream_data_remote)
        closed = c.until_closed()
        assert closed.error_code == QuicErrorCode.FLOW_CONTROL_ERROR, closed
    finally:
        c.close()
    assert grown < 16 << 20, grown
    _answers(server, pki)


def _settle(c: _Raw, seconds: float) -> None:
    """Exchange datagrams for ``seconds`` (or until the connection ends)."""
    end = time.monotonic() + seconds
    c.run(lambda: time.monotonic() > end, seconds + 5)


def _started(c: _Raw, sid: int, declared: int, sent: int) -> None:
    """A HEADERS frame of ``declared`` bytes on ``sid`` of which ``sent`` are sent."""
    c.quic.send_stream_data(sid, encode_uint_var(FrameType.HEADERS) + encode_uint_var(declared)
                            + b"\0" * sent)


@pytest.fixture(scope="module")
def patient(builds, pki):
    """A single-worker server with the default time limits: the test below spends longer
    than TEST_LIMITS' 2 s head timeout on a loaded machine (each client's handshake and
    settling), which would end its streams by time, not by the bounds it is about."""
    s = serve(builds["notfound"], "--loop", "epoll", "--workers", "1",
              "--tls-cert", pki.chain, "--tls-key", pki.key)
    try:
        yield s
    finally:
        s.stop()


def test_many_streams_whose_headers_never_finish_are_bounded(patient, pki):
    """Four connections each open 100 request streams and send most of a HEADERS frame on
    each, never the rest: what the worker holds is bounded by the streams it allows and
    the frame size it accepts, and it answers a new client meanwhile."""
    server = patient
    worker = _worker(server)
    before = _rss(worker)
    clients = [_Raw(server.port, pki.ca) for _ in range(4)]
    try:
        for c in clients:
            for _ in range(100):
                _started(c, c.quic.get_next_available_stream_id(), 8000, 7000)
            _settle(c, 0.2)
        for _ in range(2):  # until every stream's bytes are delivered (windows renewed)
            for c in clients:
                _settle(c, 0.2)
        assert all(c.closed is None for c in clients), [c.closed for c in clients]
        _answers(server, pki)
        grown = _rss(worker) - before
    finally:
        for c in clients:
            c.close()
    assert grown < 24 << 20, grown


def test_a_headers_frame_over_the_frame_limit_is_excessive_load(server, pki):
    """A HEADERS frame declaring a gigabyte, its bytes streamed: aioquic would buffer all
    of them waiting for the end; past FRAME_HEADS heads it is H3_EXCESSIVE_LOAD."""
    worker = _worker(server)
    before = _rss(worker)
    c = _Raw(server.port, pki.ca)
    try:
        sid = c.quic.get_next_available_stream_id()
        _started(c, sid, 1 << 30, 0)
        for _ in range(40):  # 40 × 16 KiB: over FRAME_HEADS × the 8 KiB head limit
            if c.closed is not None:
                break
            c.quic.send_stream_data(sid, b"\0" * 16384)
            _settle(c, 0.05)
        closed = c.until_closed()
        assert closed.error_code == ErrorCode.H3_EXCESSIVE_LOAD, closed
        sent = c.quic._streams[sid].sender.highest_offset if sid in c.quic._streams else 0
        assert sent <= (FRAME_HEADS + 1) * 8192 + 16384, sent
    finally:
        c.close()
    assert _rss(worker) - before < 16 << 20
    _answers(server, pki)


def test_a_settings_frame_over_the_frame_limit_is_excessive_load(server, pki):
    """The control stream's SETTINGS is parsed whole too: a second client control stream
    is not needed — the first one's SETTINGS declaring a gigabyte, its bytes streamed."""
    c = _Raw(server.port, pki.ca, settings=False)
    try:
        sid = c.uni(StreamType.CONTROL, encode_uint_var(FrameType.SETTINGS)
                    + encode_uint_var(1 << 30))
        for _ in range(40):
            if c.closed is not None:
                break
            c.quic.send_stream_data(sid, b"\0" * 16384)
            _settle(c, 0.05)
        closed = c.until_closed()
        assert closed.error_code == ErrorCode.H3_EXCESSIVE_LOAD, closed
    finally:
        c.close()
    _answers(server, pki)


def test_streams_reset_in_a_loop_are_freed(server, pki):
    """A client that opens a request stream, starts its HEADERS and resets it, 600 times on
    one connection: every stream is freed (MAX_STREAMS keeps granting new ones — 32 at a
    time — which it would not if the worker kept them), the worker's memory stays put, and
    the connection then gets an answer on a request it finishes."""
    worker = _worker(server)
    before = _rss(worker)
    c = _Raw(server.port, pki.ca)
    try:
        opened = 0
        deadline = time.monotonic() + 20
        while opened < 600 and time.monotonic() < deadline:
            q = c.quic
            sid = q.get_next_available_stream_id()
            if sid // 4 >= q._remote_max_streams_bidi:  # wait for MAX_STREAMS
                c.run(lambda: sid // 4 < c.quic._remote_max_streams_bidi, 5)
                continue
            _started(c, sid, 100, 10)
            q.reset_stream(sid, ErrorCode.H3_REQUEST_CANCELLED)
            opened += 1
            if opened % 32 == 0:
                _settle(c, 0.02)
        assert opened == 600 and c.closed is None, (opened, c.closed)
        sid = c.quic.get_next_available_stream_id()
        c.run(lambda: sid // 4 < c.quic._remote_max_streams_bidi, 5)
        c.quic.send_stream_data(sid, _headers_frame(), True)
        c.run(lambda: sid in c.ended, 10)
        assert bytes(c.data[sid][:1]) == encode_uint_var(FrameType.HEADERS), c.data.get(sid)
    finally:
        c.close()
    assert _rss(worker) - before < 16 << 20
    _answers(server, pki)


def test_unknown_unidirectional_streams_are_discarded(server, pki):
    """RFC 9114 §6.2: streams of unknown (reserved, §6.2.3) types are read and discarded —
    200 of them with 4 KiB each, more than MAX_STREAMS allows at once, so each must be
    freed — and the connection then answers a request."""
    worker = _worker(server)
    before = _rss(worker)
    c = _Raw(server.port, pki.ca)
    try:
        for i in range(200):
            q = c.quic
            sid = q.get_next_available_stream_id(is_unidirectional=True)
            if sid // 4 >= q._remote_max_streams_uni:
                c.run(lambda: sid // 4 < c.quic._remote_max_streams_uni, 5)
            kind = 0x1F * (i + 1) + 0x21  # reserved stream types: 0x1f * N + 0x21
            q.send_stream_data(sid, encode_uint_var(kind) + os.urandom(4096), True)
            if i % 16 == 0:
                _settle(c, 0.02)
        _settle(c, 0.2)
        assert c.closed is None, c.closed
        sid = c.quic.get_next_available_stream_id()
        c.quic.send_stream_data(sid, _headers_frame(), True)
        c.run(lambda: sid in c.ended, 10)
        assert bytes(c.data[sid][:1]) == encode_uint_var(FrameType.HEADERS)
    finally:
        c.close()
    assert _rss(worker) - before < 16 << 20
    _answers(server, pki)


def test_a_second_control_stream_is_stream_creation_error(server, pki):
    """RFC 9114 §6.2.1: only one control stream; a second is H3_STREAM_CREATION_ERROR."""
    c = _Raw(server.port, pki.ca)
    try:
        c.uni(StreamType.CONTROL, _frame(FrameType.SETTINGS, b""))
        closed = c.until_closed()
        assert closed.error_code == ErrorCode.H3_STREAM_CREATION_ERROR, closed
    finally:
        c.close()
    _answers(server, pki)


def test_data_before_headers_is_frame_unexpected(server, pki):
    """RFC 9114 §4.1: a request stream starts with HEADERS; DATA first is
    H3_FRAME_UNEXPECTED."""
    c = _Raw(server.port, pki.ca)
    try:
        sid = c.quic.get_next_available_stream_id()
        c.quic.send_stream_data(sid, _frame(FrameType.DATA, b"hello") + _headers_frame(), True)
        closed = c.until_closed()
        assert closed.error_code == ErrorCode.H3_FRAME_UNEXPECTED, closed
    finally:
        c.close()
    _answers(server, pki)


def test_a_frame_header_split_between_packets_is_answered(server, pki):
    """A request's HEADERS type in one packet and its length and section in the next (a
    split the network makes): the frame's type is known before its length then, and the
    connection is answered, not closed on an internal error (seen under load)."""
    c = _Raw(server.port, pki.ca)
    try:
        sid = c.quic.get_next_available_stream_id()
        frame = _headers_frame()
        c.quic.send_stream_data(sid, frame[:1])
        _settle(c, 0.3)
        assert c.closed is None, c.closed
        c.quic.send_stream_data(sid, frame[1:], True)
        c.run(lambda: sid in c.ended, 10)
        assert c.closed is None, c.closed
        assert sid in c.ended and c.data[sid], c.data
    finally:
        c.close()


_names = st.one_of(st.sampled_from([b":method", b":scheme", b":authority", b":path", b":protocol",
                                    b":status", b"te", b"content-length", b"connection", b"host",
                                    b"x-a", b"X-a", b"a:b", b"", b"a b", b"\xff"]),
                   st.binary(max_size=6))
_values = st.one_of(st.sampled_from([b"GET", b"trailers", b"TrailerS", b"gzip", b"12", b"-1",
                                     b"1_0", b" x", b"x ", b"\t", b"a\rb", b"", b"x\x00"]),
                    st.binary(max_size=6))


_PSEUDOS = [(b":method", b"GET"), (b":authority", b"localhost"), (b":scheme", b"https"),
            (b":path", b"/")]


@settings(max_examples=300, deadline=None)
@given(st.booleans(), st.lists(st.tuples(_names, _values), max_size=6))
@example(True, [(b"content-length", b" x")])  # not digits, and not a valid value either
@example(True, [(b"content-length", b"1_0"), (b"content-length", b"7")])
def test_the_fast_request_check_judges_as_aioquics(valid_start, fields):
    """``fields.request_fields_error`` (compiled_h3's check of every request) rejects
    exactly the header lists aioquic's own validate_request_headers rejects (most lists
    start as a valid request, so the rest is what decides) — but for a content-length that
    is not digits (RFC 9110 §8.6): aioquic reads it with ``int`` ("1_0" is 10, "+7" is 7,
    "-1" and "0x7" are refused), ours leaves it to the core (a 400). So aioquic judges the
    list with such values as "0". The length the request's DATA is then held to
    (``declared_length`` of its synthetic head) is its content-length when every such
    field is the same digits, else none (-1: the core answers those 400)."""
    headers = (_PSEUDOS if valid_start else []) + fields
    from aioquic.h3.connection import H3Stream, MessageError as AioquicError
    from aioquic.h3.connection import validate_request_headers as aioquics
    from orisha.protocols.fields import declared_length, request_fields_error, synthetic_head
    lengths = {v for k, v in headers if k == b"content-length"}

    def as_digit(k: bytes, v: bytes) -> bytes:  # a valid field value only: " x" stays refused
        fine = v.strip(b" \t") == v and not any(c in v for c in b"\r\n\0")
        return b"0" if k == b"content-length" and not v.isdigit() and fine else v
    as_digits = [(k, as_digit(k, v)) for k, v in headers]
    try:
        aioquics(as_digits, H3Stream(0))
        theirs = "ok"
    except AioquicError:
        theirs = "rejected"
    ours = "rejected" if request_fields_error(headers) is not None else "ok"
    assert theirs == ours, (headers, theirs, ours)
    head = synthetic_head(headers)[0] if ours == "ok" else None
    if head is not None:
        value = next(iter(lengths)) if len(lengths) == 1 else b""
        want = int(value) if value.isdigit() and len(value) <= 18 else -1
        assert declared_length(head) == want, (headers, head)


# Content-Length values that are not RFC 9110 §8.6's digits, and what each gets on HTTP/2 and
# HTTP/3: the core's 400 (as on HTTP/1.1), or a stream error for a malformed request (a field
# value with spaces at its ends, RFC 9114 §4.2; a body that is not its length, §4.1.2).
NOT_DIGITS = [(b"1_0", 400), (b"+7", 400), (b"0x7", 400), (b" 7 ", "reset"), (b"7", "reset")]


def test_a_content_length_that_is_not_digits_is_refused_and_the_connection_goes_on(server, pki):
    """HTTP/3 (test_h2_attacks has HTTP/2's): each value on its own request stream of one
    connection, a GET without a body. A length read with ``int`` would take "1_0" as 10
    and "+7" as 7; a malformed request is reset alone, with H3_MESSAGE_ERROR, and the next
    request on the connection is answered."""
    import pylsqpack
    c = _Raw(server.port, pki.ca)
    try:
        for value, want in NOT_DIGITS + [(None, 200)]:
            fields = [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"localhost"),
                      (b":path", b"/")] + ([(b"content-length", value)] if value else [])
            _, section = pylsqpack.Encoder().encode(0, fields)
            sid = c.quic.get_next_available_stream_id()
            c.quic.send_stream_data(sid, _frame(FrameType.HEADERS, section), True)
            c.run(lambda: sid in c.ended or sid in c.resets, 10)
            assert c.closed is None, (value, c.closed)
            if want == "reset":
                assert c.resets.get(sid) == ErrorCode.H3_MESSAGE_ERROR, (value, c.resets)
            else:
                assert sid not in c.resets and _status(c.data[sid]) == want, (value, c.data[sid])
    finally:
        c.close()


def _status(stream: bytes) -> int:
    """The final :status of a response stream (its first HEADERS frame that is not a 1xx,
    decoded by pylsqpack: a page with early hints has a 103 first)."""
    import pylsqpack
    buf, n = bytes(stream), 0
    while n < len(buf):
        ftype, n = _varint(buf, n)
        length, n = _varint(buf, n)
        if ftype == FrameType.HEADERS:
            _, headers = pylsqpack.Decoder(0, 0).feed_header(0, buf[n:n + length])
            status = int(dict(headers)[b":status"])
            if status >= 200:
                return status
        n += length
    raise AssertionError(f"no final HEADERS in {buf[:40]!r}")


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    size = 1 << (buf[i] >> 6)
    v = buf[i] & 0x3F
    for b in buf[i + 1:i + size]:
        v = (v << 8) | b
    return v, i + size


@pytest.fixture(scope="module")
def timed(builds, pki):
    """A server with short time limits: QUIC keeps a pinging client's connection alive, so
    these are the limits that end one that makes no progress."""
    s = serve(builds["notfound"], "--loop", "epoll", "--workers", "1", "--head-timeout", "1",
              "--idle-timeout", "2", "--send-timeout", "2",
              "--tls-cert", pki.chain, "--tls-key", pki.key)
    try:
        yield s
    finally:
        s.stop()


def _pinging(c: _Raw, seconds: float) -> ConnectionTerminated:
    """PINGs every 0.25 s (QUIC's idle timer never fires) until the server closes."""
    deadline = time.monotonic() + seconds
    while c.closed is None and time.monotonic() < deadline:
        c.quic.send_ping(0)
        _settle(c, 0.25)
    assert c.closed is not None, "the server kept a connection that makes no progress"
    return c.closed


def test_headers_that_never_finish_end_the_connection_at_the_head_timeout(timed, pki):
    """A request stream whose HEADERS never comes whole, its connection kept alive by PINGs:
    at --head-timeout it is H3_EXCESSIVE_LOAD (HTTP/2's ENHANCE_YOUR_CALM, HTTP/1.1's 408)."""
    c = _Raw(timed.port, pki.ca)
    try:
        started = time.monotonic()
        _started(c, c.quic.get_next_available_stream_id(), 4000, 100)
        closed = _pinging(c, 10)
        assert closed.error_code == ErrorCode.H3_EXCESSIVE_LOAD, closed
        assert time.monotonic() - started >= 1
    finally:
        c.close()
    _answers(timed, pki)


def test_a_connection_without_requests_goes_away_at_the_idle_timeout(timed, pki):
    """One request answered, then only PINGs: at --idle-timeout GOAWAY on the control stream
    (RFC 9114 §5.2) and the close with H3_NO_ERROR, as an idle HTTP/1.1 or HTTP/2
    connection is closed."""
    c = _Raw(timed.port, pki.ca)
    try:
        sid = c.quic.get_next_available_stream_id()
        c.quic.send_stream_data(sid, _headers_frame(), True)
        c.run(lambda: sid in c.ended, 10)
        started = time.monotonic()
        closed = _pinging(c, 10)
        assert closed.error_code == ErrorCode.H3_NO_ERROR, closed
        assert time.monotonic() - started >= 1.5
        control = next(bytes(d) for s, d in c.data.items() if s % 4 == 3 and d[:1] == b"\0")
        assert encode_uint_var(FrameType.GOAWAY) + encode_uint_var(1) + encode_uint_var(sid + 4) \
            in control, control
    finally:
        c.close()


def test_a_body_the_client_never_makes_room_for_ends_at_the_send_timeout(timed, pki):
    """The client takes the first 64 KiB of a 1.2 MB body and never raises its window (its
    PINGs keep QUIC alive): at --send-timeout the connection ends, the body not held forever."""
    c = _Raw(timed.port, pki.ca)
    c.quic._write_stream_limits = c.quic._write_connection_limits = lambda *a, **k: None
    try:
        sid = c.quic.get_next_available_stream_id()
        import pylsqpack
        _, section = pylsqpack.Encoder().encode(0, [
            (b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"localhost"),
            (b":path", b"/files/big.txt")])
        c.quic.send_stream_data(sid, _frame(FrameType.HEADERS, section), True)
        closed = _pinging(c, 15)
        assert closed.error_code == ErrorCode.H3_EXCESSIVE_LOAD, closed
        assert sid not in c.ended and len(c.data.get(sid, b"")) < 1200038
    finally:
        c.close()
    _answers(timed, pki)
