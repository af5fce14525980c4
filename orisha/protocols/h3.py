"""HTTP/3 (RFC 9114) over QUIC (RFC 9000), in front of the HTTP/1.1 core's decisions.

Strategy: qh3 does QUIC — packets and their protection, loss recovery, congestion
and flow control, streams, connection IDs and the 3x amplification limit before
address validation (RFC 9000 §8.1) in its Rust core, TLS 1.3 in its Python —
sans-I/O: ``receive_datagram``, ``datagrams_to_send``, ``get_timer``,
``handle_timer`` (``quic_qh3.ServerConnection`` works around this release's gaps).
Its ``H3Connection`` parses what clients send (frames, the control and QPACK
streams, request field sections, decoded against the client's dynamic table). What a response is, this module
decides the way ``h2.py`` does, with h2.py's own helper: the request's fields
become the synthetic HTTP/1.1 head, ``App.plan`` (the same ``answer()`` and memo
for every protocol) gives the Plan, and the response goes onto the QUIC stream
as written bytes — a HEADERS frame holding the build's QPACK field section for
that head (``qpack_blocks.py``: no dynamic table, so the same bytes on every
connection) plus one Date literal, then one DATA frame whose payload is the
blob's bytes — with the HEADERS in one write when the body is at most
``_STREAM_AHEAD`` bytes, else fed to the stream as its buffer drains (at most
``_STREAM_AHEAD`` bytes queued per stream, so a large body never sits in memory whole).
``H3Connection.send_headers`` is not used: it would encode every section anew.
A 200 whose Link preloads is preceded on its stream by a 103 Early Hints
(RFC 8297; an interim response, RFC 9114 §4.1), its HEADERS frame made once per
variant when the site is taken (``Sections.early``, with HTTP/2's selection).

``Endpoint`` is the datagram side of the loop seam (``orisha/loops/base.py``):
one per worker, every connection of its UDP socket, demultiplexed by the
destination connection ID as qh3's own asyncio server does. Gather, then
write once: a batch of datagrams is fed to its connections first, then each
connection touched is asked once for what to send, and runs of equal-sized
datagrams to one address become one GSO group. Connections are counted in
``App.open`` with the TCP ones; over ``--max-connections`` a new Initial is
dropped (the client keeps the TCP connection Alt-Svc came from). Under a flood
of Initials — more than ``RETRY_ABOVE`` handshakes in progress — a new client
must first prove its address with a Retry (RFC 9000 §8.1.2): the Retry packet
and its token (``quic_retry.py``: bound to the address, expiring) are stateless, so spoofed Initials cost a datagram, not a
connection. Graceful stop:
GOAWAY on the control stream (§5.2), then CONNECTION_CLOSE with H3_NO_ERROR
once every response is acknowledged.

Reloads (``quic_steer.py``): with a ``Steer`` (``steer_with``, from ``udp.Pump``) every
connection ID this worker issues names its generation and index, and a datagram of an
unknown connection whose ID names another worker goes to ``forward`` instead of being
dropped — so the draining generation, which shares each UDP socket with the new one,
keeps every datagram of its connections until they close; a stopping worker hands the
new clients' Initials to its successor. Nothing here ever answers a datagram of an
unknown connection (no stateless reset): it is dropped and counted (``strays``).

Several sites and certificates, as over TLS/TCP (orisha/protocols/tls.py): the
ClientHello's server name — qh3's server parses it and keeps nothing of it —
is read from the hello itself as it reaches qh3's TLS (``_Quic``), which then
presents the certificate ``tls.by_server_name`` picks (exact before wildcard, the
first certificate for an absent or unknown name); once the handshake is done the
connection answers from ``App.view(sni)``, so a :authority of another site gets
421, and the access log names the site. A configuration may be None (ACME has no
certificate yet): then nothing on the UDP port is answered.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import os
import sys
import traceback
from typing import Callable

import qh3.h3.connection as _h3_module
from qh3._hazmat import encode_uint_var, pull_quic_header
from qh3.h3.connection import H3_ALPN, ErrorCode, FrameType, \
    H3Connection, HeadersState, MessageError, ProtocolError, Setting, encode_frame
from qh3.h3.events import HeadersReceived
from qh3.quic.configuration import QuicConfiguration
from qh3.quic.connection import QuicConnectionError
from qh3.quic.events import ConnectionIdIssued, ConnectionIdRetired, ConnectionTerminated, \
    HandshakeCompleted, StreamDataReceived, StreamReset
from qh3.quic.packet import SMALLEST_MAX_DATAGRAM_SIZE, QuicPacketType, encode_quic_retry, \
    encode_quic_version_negotiation
from qh3.tls import Alert, pull_client_hello
from qh3._hazmat import BufferReadError

from ..blob import FileRegion
from ..core.connection import log_line
from ..core.policy import TOO_EARLY, Stat
from ..errors import ServeError
from .fields import FRAME_HEADS, H3_MAX_STREAMS, H3_WINDOW, RETRY_ABOVE, PerSecond, \
    declared_length, error_plan, refused_early, request_fields_error, synthetic_head
from .qpack_blocks import Sections, date_field
from .quic_qh3 import HANDSHAKE_HOLD, ServerConnection
from .quic_retry import RetryTokens
from .quic_tickets import Tickets
from .tls import by_server_name

_STREAM_AHEAD = 64 * 1024  # body bytes queued in a stream's send buffer (unacknowledged)
_GSO_BYTES = 65000         # a GSO group's payload stays under the 64 KiB UDP limit…
_GSO_SEGMENTS = 64         # …and within the kernel's UDP_MAX_SEGMENTS
# Request streams a client may have open at once (MAX_STREAMS, RFC 9000 §4.6; aioquic's
# default is 128). aioquic walks every open stream twice for each packet it builds (its
# stream limits, then its send queue, in Python), so a packet costs more the more streams
# are open: ngtcp2's client keeps as many requests in flight as it may, and a 13 KB answer
# (ten packets) cost 1,440 µs of worker CPU at 128 streams, 1,055 at 64, 580 at 32 and 455
# at 16 (1 KB: 140 µs at 128, 75 at 32). 32 keeps most of that gain and a page's first 32
# requests in one flight; credit returns as streams end (MAX_STREAMS batched by half).
MAX_STREAMS = H3_MAX_STREAMS
# A stream's receive window: credit past the bytes delivered in order (``_Quic``). Requests
# are a field section (the head limit, 8 KiB by default, bounds a useful one) and, for the
# methods that carry one, a body that is answered without being read: 16 KiB is room for
# either, and with at most ``MAX_STREAMS`` request streams (and aioquic's 128
# unidirectional ones) open it bounds what a connection can make a worker hold for
# reassembly to 2.5 MiB.
WINDOW = H3_WINDOW
# A frame the HTTP/3 layer must hold whole before it can parse it (HEADERS; SETTINGS on the
# control stream) longer than this many times the head limit: H3_EXCESSIVE_LOAD (RFC 9114
# §7.1, "an implementation MAY limit the maximum frame size"). Smaller ones that are over
# the head limit still get their 431 (§4.2.2), as over HTTP/1.1 and HTTP/2.
_WHOLE = (FrameType.HEADERS, FrameType.SETTINGS, FrameType.PUSH_PROMISE)
_SECTIONS = Sections()
_DATE = PerSecond(date_field)  # the one per-second part of a section: its Date


@dataclasses.dataclass
class ServerConfiguration(QuicConfiguration):
    """qh3's configuration (its certificate: the first one's) and, with several
    certificates, ``by_name``: server name → (certificate, chain, private key) or None;
    ``tickets``: the server's session-ticket table (quic_tickets.py), or None."""
    by_name: Callable | None = None
    tickets: object = None
    retry: bool = False  # --quic-retry: every new client proves its address first


def configuration(cert: str, key: str, idle_timeout: float) -> ServerConfiguration:
    """A server's QUIC configuration (one per worker generation: a reload reads the files)."""
    config = ServerConfiguration(is_client=False, alpn_protocols=H3_ALPN,
                                 idle_timeout=idle_timeout, max_stream_data=WINDOW)
    try:
        config.load_cert_chain(cert, key)
    except (OSError, ValueError) as e:  # unreadable, not PEM, or a key that does not match
        raise ServeError(f"{cert}, {key}: cannot load them for QUIC ({e})") from None
    return config


def tickets():
    """The session-ticket table every worker of every generation shares (quic_tickets.py),
    made before the first fork."""
    return Tickets()


def configurations(pairs, idle_timeout: float, tickets=None,
                   retry: bool = False) -> ServerConfiguration | None:
    """One configuration for several certificates, SNI choosing (``tls.by_server_name``);
    ``pairs``: (DNS names, certificate file, key file) in command-line order. None for
    none (ACME before its first certificate: HTTP/3 is not answered yet). ``retry``: a
    Retry for every new client, not only past ``RETRY_ABOVE`` handshakes in progress."""
    loaded = [(names, configuration(cert, key, idle_timeout)) for names, cert, key in pairs]
    if not loaded:
        return None
    first = loaded[0][1]
    first.tickets, first.retry = tickets, retry
    if len(loaded) > 1:
        first.by_name = by_server_name(
            [(names, (c.certificate, c.certificate_chain, c.private_key)) for names, c in loaded])
    return first


class _Quic(ServerConnection):
    """qh3's server connection (``quic_qh3.ServerConnection``: datagrams credited whole),
    plus the server name of the client's hello (``sni``) and the certificate it picks
    (``ServerConfiguration.by_name``); with ``steer``, its first connection ID names the
    worker. The spare IDs qh3's core issues are its own random ones (it has no hook for
    them): a datagram under one of those reaches this worker by its 4-tuple, as every
    datagram does until the client's address changes (see ``Endpoint._elsewhere``)."""

    sni: str | None = None

    def __init__(self, *, steer=None, tickets=None, **kw) -> None:
        if tickets is not None:  # resumption and 0-RTT, on any worker (quic_tickets.py)
            kw["session_ticket_fetcher"] = lambda label: tickets.fetch(label, self.sni)
            kw["session_ticket_handler"] = lambda t: tickets.store(
                dataclasses.replace(t, server_name=self.sni))
        super().__init__(**kw)
        self.steer = steer
        if steer is not None:  # before the core is made (at the first datagram)
            self.host_cid = steer.cid(len(self.host_cid))

    def _create_tls(self, remote_source_cid):
        bridge = super()._create_tls(remote_source_cid)  # before any CRYPTO frame is read
        tls, quic = bridge.tls, self
        handle = tls._server_handle_hello
        by_name = self._configuration.by_name

        def hello(input_buf, *bufs) -> None:
            del tls._server_handle_hello  # once: the class's method again, and no cycle
            start = input_buf.tell()
            try:
                quic.sni = name = pull_client_hello(input_buf).server_name
            except (BufferReadError, Alert):  # malformed: qh3's own parse will say so
                name = None
            input_buf.seek(start)
            chosen = by_name(name) if name and by_name is not None else None
            if chosen is not None:
                tls.certificate, tls.certificate_chain, tls.certificate_private_key = chosen
            handle(input_buf, *bufs)
        tls._server_handle_hello = hello
        return bridge

    def send_room(self, sid: int) -> int | None:
        """Bytes a stream may still have queued before ``_STREAM_AHEAD``, or None for a
        stream that can no longer send (reset by the peer's STOP_SENDING, or gone)."""
        core = self._core
        if not core.can_send_stream(sid):
            return None
        return _STREAM_AHEAD - core.get_send_buffer_size(sid)

    @property
    def closing(self) -> bool:
        return self._close_event is not None

    def drained(self, now: float) -> bool:
        """Every stream's data sent and acknowledged (what a GOAWAY waits for). Data the
        core has declared lost counts as neither buffered nor in flight until it is sent
        again, which may wait for the pacer: so what the core would send now is built
        first (``ServerConnection.built``; it goes out with the next
        ``datagrams_to_send``), and a paced send still due means not drained. Without
        that a connection whose last retransmission was due looked drained and was
        closed with the client a packet short (a reload's old generation:
        test_a_goaway_under_loss_closes_only_once_every_response_is_delivered)."""
        core = self._core
        if core is None:
            return True
        if core.state == "connected":
            self.built(now)
        timer = core.get_timer()
        return (core.get_send_buffer_size(None) == 0 and core.bytes_in_flight == 0
                and (timer is None or timer[0] != "pacing"))


class _H3(H3Connection):
    """qh3's HTTP/3 layer without its H3_DATAGRAM setting: qh3 announces it whatever the
    transport parameters say, and a client (aioquic's) refuses the connection when the
    server's ``max_datagram_frame_size`` is absent (RFC 9297 §2.1.1). Nothing here speaks
    HTTP datagrams. And a malformed request is a stream error, not qh3's connection error
    (``handle_event``)."""

    def __init__(self, quic) -> None:
        super().__init__(quic)
        self.malformed: set[int] = set()  # request streams reset as malformed, still open

    def _get_local_settings(self) -> dict[int, int]:
        settings = super()._get_local_settings()
        settings.pop(Setting.H3_DATAGRAM, None)
        return settings

    def handle_event(self, event) -> list:
        """qh3's, except that a malformed request (``MessageError``: its fields, or a body
        that is not its content-length) is what RFC 9114 §4.1.2 says it is, a stream error
        of type H3_MESSAGE_ERROR: the stream is reset and stopped, what more comes on it
        is dropped, and the client's other requests go on (HTTP/2's RST_STREAM). qh3
        closed the whole connection for it."""
        cls = event.__class__
        if cls is StreamDataReceived and event.stream_id % 4 == 0 and not self._is_done:
            sid, bad = event.stream_id, self.malformed
            if sid in bad:
                if event.end_stream:
                    bad.discard(sid)
                return []
            try:
                return self._receive_stream_data(event)
            except MessageError:
                if not event.end_stream:
                    bad.add(sid)
                quic = self._quic
                if quic.send_room(sid) is not None:
                    quic.reset_stream(sid, ErrorCode.H3_MESSAGE_ERROR)
                if not event.end_stream:
                    quic.stop_stream(sid, ErrorCode.H3_MESSAGE_ERROR)
                return []
            except ProtocolError as exc:  # a connection error: as qh3's own handle_event
                self._is_done = True
                self._quic.close(error_code=exc.error_code, reason_phrase=exc.reason_phrase)
                return []
        if cls is StreamReset:
            self.malformed.discard(event.stream_id)
        return super().handle_event(event)


def validate_request(headers, stream=None) -> None:
    """``fields.request_fields_error`` as qh3 wants it (a ``MessageError``), installed in
    qh3's module below (it calls the function by its global name; only a server's
    H3Connection calls it, for the requests it receives); and the stream held to a
    Content-Length of digits only (RFC 9110 §8.6: ``int`` also takes "1_0" and "+7"). Another
    value is not a length the body is held to: it goes on in the head, and the core answers
    it 400 (as HTTP/1.1 and HTTP/2 do)."""
    why = request_fields_error(headers)
    if why is not None:
        raise MessageError(why)
    if stream:
        for key, value in headers:
            if key == b"content-length" and value.isdigit() and len(value) <= 18:
                stream.expected_content_length = int(value)


_h3_module.validate_request_headers = validate_request


class _Conn:
    """One QUIC connection: its HTTP/3 requests, their answers and what it still has to send.

    Strategy: the endpoint routes datagrams and timers to a connection and hands it the
    HTTP/3 events (``request``); the connection asks its site for the plan (``app.plans``,
    ``app.plan``: the core's one answer), sends the build's QPACK section and the body,
    feeds large bodies as their stream's send buffer drains (``feed``), and holds the time
    limits HTTP/1.1 and HTTP/2 have (``timed_out``)."""
    __slots__ = ("quic", "h3", "peer", "cids", "pending", "timer", "seq", "goaway", "last_sid",
                 "counted", "handshaking", "app", "since", "heard")

    def __init__(self, quic: _Quic, peer: str, seq: int, app) -> None:
        self.quic, self.peer, self.seq = quic, peer, seq
        self.app = app  # the endpoint's; with several sites, its SNI's view once handshaken
        self.h3 = _H3(quic)
        self.cids: set[bytes] = set()
        self.pending: dict[int, list] = {}  # stream id → [body view, bytes already queued]
        self.timer: float | None = None
        self.goaway = False
        self.last_sid = -4
        self.counted = True
        self.handshaking = True
        self.since = 0.0  # the last progress of its requests (a request, body bytes queued)
        self.heard = 0.0  # when its last datagram came

    def timed_out(self, now: float) -> bool:
        """The limits of HTTP/1.1 and HTTP/2 on a connection QUIC keeps alive (a client's
        PINGs reset QUIC's idle timer): bodies that move nothing for ``send_timeout``,
        a request stream whose HEADERS does not come whole within ``head_timeout`` (as
        h2: the connection, H3_EXCESSIVE_LOAD), and a connection with no request for
        ``idle_timeout`` (GOAWAY, closed once drained; RFC 9114 §5.1). None of them while
        the client has not confirmed its handshake (``confirming``): its request may wait
        for that (RFC 9002 §6.2.4: it probes its Handshake space only, backing off to 31
        and 63 s), and ``Endpoint.tick`` holds it as a handshake meanwhile."""
        if self.quic.confirming and not self.handshaking:
            self.since = now  # the time limits start when the client has confirmed
            return False
        if self.handshaking or self.goaway or self.h3._is_done or self.quic.closing:
            return False  # QUIC's own idle timeout; draining; closing
        limits, waited = self.app.limits, now - self.since
        if self.pending:
            if waited <= limits.send_timeout:
                return False
        elif any(sid % 4 == 0 and st.headers_recv_state == HeadersState.INITIAL
                 for sid, st in self.h3._stream.items()):
            if waited <= limits.head_timeout:
                return False
        elif waited > limits.idle_timeout:
            self.go_away()
            return True
        else:
            return False
        self.h3._is_done = True
        self.quic.close(error_code=ErrorCode.H3_EXCESSIVE_LOAD,
                     reason_phrase="no progress within the time limit")
        return True

    def go_away(self) -> None:
        if self.quic.closing:  # closed by either side: nothing more is sent on it
            self.goaway = True
            return
        if not self.goaway and self.h3._local_control_stream_id is not None:
            self.goaway = True
            # The first request stream we will not answer: one past the last we took.
            self.quic.send_stream_data(self.h3._local_control_stream_id,
                                    encode_frame(FrameType.GOAWAY, encode_uint_var(self.last_sid + 4)))

    def bounded(self, st) -> None:
        """H3_EXCESSIVE_LOAD for a stream (aioquic's ``H3Stream``) whose HTTP/3 layer
        holds, or waits to hold, more than ``FRAME_HEADS`` heads: a frame that is parsed
        whole (aioquic buffers one without limit) or the bytes queued behind a field
        section QPACK-blocked. A frame's type may be read before its length (a varint split
        across packets): ``frame_size`` is None then."""
        if self.h3._is_done:
            return
        most = FRAME_HEADS * self.app.limits.head
        if len(st.buffer) > most or (st.frame_type in _WHOLE and st.frame_size is not None
                                       and st.frame_size > most):
            self.h3._is_done = True  # as aioquic's own protocol errors leave it
            self.quic.close(error_code=ErrorCode.H3_EXCESSIVE_LOAD,
                         reason_phrase="frame or buffered stream data too large")

    def request(self, h: HeadersReceived, now: float) -> None:
        sid = h.stream_id
        stream = self.h3._stream.get(sid)
        if stream is not None and stream.headers_recv_state == HeadersState.AFTER_TRAILERS:
            return  # trailers of a request already answered: nothing to do
        if self.goaway and sid > self.last_sid:
            self.quic.reset_stream(sid, ErrorCode.H3_REQUEST_REJECTED)  # §5.2: after our GOAWAY
            return
        self.last_sid = max(self.last_sid, sid)
        self.since = now
        head, line = synthetic_head(h.headers)
        app = self.app
        if head is None or (h.stream_ended and declared_length(head) > 0):
            # Malformed (RFC 9114 §4.1.2): a stream error. A request that ends with its
            # HEADERS has no content, so a Content-Length other than 0 is not its length
            # (qh3 checks none; HTTP/2 resets the same request).
            self.quic.reset_stream(sid, ErrorCode.H3_MESSAGE_ERROR)
            return
        if len(head) > app.limits.head:
            plan = error_plan(431)
        elif self.handshaking and refused_early(head):
            plan = error_plan(TOO_EARLY)  # before the handshake completes: it came as 0-RTT
        else:
            plan = app.plans.get(head)
            if plan is None:
                plan = app.plan(head)
        self.respond(sid, plan, line[:-8] + b"HTTP/3.0", now, head)
        if not h.stream_ended:  # §4.1: answered before the request ended; it need not go on
            self.quic.stop_stream(sid, ErrorCode.H3_NO_ERROR)

    def respond(self, sid: int, plan, line: bytes, now: float,
                 request: bytes = b"") -> None:
        head, _, body, _, _, status, stats = plan
        app = self.app
        if stats is None:  # not made by App.plan: the connection's site counts it (App.counts)
            stats = app.counts
        stats[Stat.REQUESTS] += 1
        stats[Stat.RESPONSE_BYTES] += len(body)
        if status >= 400:
            stats[Stat.ERROR[status]] += 1
        if app.log_lines is not None:
            app.log_lines.append(log_line(self.peer, now, line, status, len(body),
                                          b"" if app.hosts is None else app.hosts.label(request)))
        section = _SECTIONS.get(head) + _DATE(now)
        frames = encode_frame(FrameType.HEADERS, section)
        if _SECTIONS.early:
            # RFC 8297, RFC 9114 §4.1: the 103 of a page with early hints, its HEADERS
            # frame made when the site was taken, on the stream before the 200's.
            frames = _SECTIONS.early.get(head, b"") + frames
        if not body:
            self.quic.send_stream_data(sid, frames, True)
            return
        size = len(body)
        frames += encode_uint_var(FrameType.DATA) + encode_uint_var(size)
        if size <= _STREAM_AHEAD:  # the common case: the whole response in one write
            self.quic.send_stream_data(sid, frames + (body.view if body.__class__ is FileRegion
                                                   else body), True)
            return
        self.quic.send_stream_data(sid, frames)
        self.pending[sid] = [body.view if body.__class__ is FileRegion else memoryview(body), 0]

    def cancelled(self, sid: int) -> None:
        """The client reset a request stream (RFC 9114 §4.1.1: it cancelled the request):
        the answer is reset too, so the stream ends both ways and qh3's core frees it (and
        credits MAX_STREAMS for another); a response in progress stops being fed."""
        if sid % 4 == 0 and self.quic.send_room(sid) is not None:
            self.quic.reset_stream(sid, ErrorCode.H3_REQUEST_CANCELLED)
        self.pending.pop(sid, None)

    def feed(self, now: float) -> None:
        """Queue body bytes on each stream while its send buffer holds < ``_STREAM_AHEAD``."""
        quic = self.quic
        for sid, p in list(self.pending.items()):
            room = quic.send_room(sid)
            if room is None:
                del self.pending[sid]  # reset by the peer (STOP_SENDING) or gone
                continue
            view, pos = p
            if room <= 0:
                continue
            end = min(len(view), pos + room)
            self.quic.send_stream_data(sid, bytes(view[pos:end]), end == len(view))
            self.since = now
            if end == len(view):
                del self.pending[sid]
            else:
                p[1] = end


class _Timers:
    """Every connection's next QUIC timer in one heap of (deadline, seq, connection): a
    connection's newer deadline is pushed beside its old entry, which is skipped as stale
    (its deadline is no longer the connection's ``timer``)."""

    def __init__(self) -> None:
        self.heap: list = []
        self.seq = itertools.count()  # ties: connections are never compared

    def next(self) -> float | None:
        heap = self.heap
        while heap and heap[0][0] != heap[0][2].timer:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def due(self, now: float) -> list:
        """The connections whose timer is due, each taken off (its ``timer`` None)."""
        heap, due = self.heap, []
        while heap and heap[0][0] <= now:
            t, _, c = heapq.heappop(heap)
            if t == c.timer:
                c.timer = None
                due.append(c)
        return due

    def set(self, c: "_Conn", t: float | None, live: int) -> None:
        if t == c.timer:
            return
        c.timer = t
        if t is not None:
            heap = self.heap
            heapq.heappush(heap, (t, c.seq, c))
            if len(heap) > 4 * live + 1024:  # stale entries: keep it bounded
                heap[:] = [e for e in heap if e[0] == e[2].timer]
                heapq.heapify(heap)


class _Admission:
    """The endpoint's routing of datagrams to connections, apart from their processing.

    Strategy: a datagram of a known connection ID goes to its connection; one of no
    connection here is another worker's (handed over by its tag or the shared table of
    ``quic_steer.Owners``), the next generation's while stopping, a stray, or a client's
    first Initial — answered with version negotiation or a Retry, refused over the
    limits, or made a connection. Uses the state ``Endpoint.__init__`` makes."""

    def _route(self, data: bytes, addr, now: float, handed: bool = False) -> _Conn | None:
        """The connection a datagram belongs to, a new one for a client's first Initial, or
        None (answered here, handed to another worker, or dropped: garbage, an unknown
        connection)."""
        length = self.config.connection_id_length
        if data and not data[0] & 0x80:  # a short header: the ID we chose, of our length
            c = self.conns.get(data[1:1 + length])
        else:
            c = self.conns.get(data[6:6 + data[5]]) if len(data) > 6 else None
        if c is not None:
            return c
        try:
            header = _Header(pull_quic_header(data, 0, length))
        except ValueError:  # not QUIC: dropped
            return None
        if self._elsewhere(header, data, addr, handed):
            return None
        return self._accept(header, data, addr, now)

    def _elsewhere(self, header, data: bytes, addr, handed: bool) -> bool:
        """Whether a datagram of no connection here is not a new client's: another worker's
        (queued on ``forward``), the next generation's while stopping, or a stray."""
        kind = header.packet_type
        if kind is QuicPacketType.ONE_RTT or (kind is QuicPacketType.HANDSHAKE and header.version
                                              in self.config.supported_versions):
            # An ID we issued (the client has seen one): another worker's, or a connection gone.
            steer = self.steer
            if (steer is not None and not handed
                    and len(header.destination_cid) == self.config.connection_id_length):
                owner = steer.owner(header.destination_cid)
                if owner != steer.tag:
                    self.forward.append((owner, data, addr))
                    return True
            self.strays += 1
            return True
        steer = self.steer
        if steer is not None and (kind is QuicPacketType.INITIAL
                                  or kind is QuicPacketType.ZERO_RTT):
            if not handed and len(header.destination_cid) == self.config.connection_id_length:
                # A client's later Initials carry the ID the server chose: another worker's
                # (a fresh client's random ID names a worker that exists about once in
                # 65536 / (workers × generations); that worker takes it as new, as we would).
                owner = steer.owner(header.destination_cid)
                if owner != steer.tag and steer.lives(owner):
                    self.forward.append((owner, data, addr))
                    return True
            if self.stopping:  # a reload's new clients: the next generation's
                self.forward.append((steer.successor, data, addr))
                return True
        return False

    def _accept(self, header, data: bytes, addr, now: float) -> _Conn | None:
        """A new connection for a client's first Initial, or None: answered here (version
        negotiation, Retry) or dropped (too short, over the limits, stopping)."""
        if len(data) < SMALLEST_MAX_DATAGRAM_SIZE:
            return None  # RFC 9000 §14.1: a client's first datagram is padded to 1200 bytes
        if header.version is not None and header.version not in self.config.supported_versions:
            if header.packet_type != QuicPacketType.VERSION_NEGOTIATION:  # never answer one
                self.out.append((encode_quic_version_negotiation(
                    source_cid=header.destination_cid, destination_cid=header.source_cid,
                    supported_versions=self.config.supported_versions), addr, 0))
            return None
        app = self.app
        if (header.packet_type != QuicPacketType.INITIAL or self.stopping
                or app.open >= app.limits.connections):
            return None
        original, retried, token = header.destination_cid, None, header.token
        if token:  # a Retry's token (ours): the address is validated
            try:
                original = self.retry.validate(addr, header.destination_cid, token, now)
                retried = header.destination_cid
            except ValueError:  # another worker's, expired, or forged: as if it had none
                token = b""
        if not token and self.handshaking >= self.retry_above:
            # Tagged: the client's next Initial names us, so the worker whose key made the
            # token gets it even when another generation reads it.
            scid = self.steer.cid(8) if self.steer is not None else os.urandom(8)
            self.out.append((encode_quic_retry(
                version=header.version, source_cid=scid, destination_cid=header.source_cid,
                original_destination_cid=header.destination_cid,
                retry_token=self.retry.create(addr, header.destination_cid, scid, now)),
                addr, 0))
            return None
        quic = _Quic(configuration=self.config, original_destination_connection_id=original,
                     retry_source_connection_id=retried, steer=self.steer,
                     tickets=self.config.tickets)
        c = _Conn(quic, addr[0], next(self.timers.seq), app)
        c.since = now
        self.handshaking += 1
        for cid in (header.destination_cid, quic.host_cid):
            c.cids.add(cid)
            self.conns[cid] = c
        if self.steer is not None and not header.source_cid:
            # A client with zero-length IDs keeps the ID it chose (quic_qh3.py): untagged.
            self.steer.remember(header.destination_cid)
        self.live.add(c)
        app.open += 1
        app.stats[Stat.CONNECTIONS] += 1
        return c



class Endpoint(_Admission):
    """Every HTTP/3 connection of one worker: the datagram contract of ``loops/base.py``."""

    def __init__(self, app, config: QuicConfiguration) -> None:
        self.app, self.config = app, config
        _SECTIONS.take(app.site, app.hosts)  # the sections its builds encoded (once per site)
        self.conns: dict[bytes, _Conn] = {}  # connection ID → connection
        self.live: set[_Conn] = set()
        self.out: list = []
        self.timers = _Timers()
        self.stopping = False
        self.retry = RetryTokens()  # its key is made here: tokens are per worker
        self.retry_above = 0 if config is not None and config.retry else RETRY_ABOVE  # None: ACME
        self.handshaking = 0
        self.steer = None
        self.forward: list = []  # (worker tag, datagram, address) for other workers
        self.strays = 0  # datagrams of connections this worker does not know, dropped
        self.errors = 0  # connections ended on an internal error (the first is printed)

    def steer_with(self, steer) -> None:
        """Issue connection IDs that name this worker; hand others' datagrams over."""
        self.steer = steer

    # -- the loop body's side of the contract ---------------------------------
    @property
    def outgoing(self) -> list:
        return self.out

    def sent(self, n: int, now: float) -> None:
        del self.out[:n]

    @property
    def busy(self) -> bool:
        return bool(self.live)

    @property
    def timer(self) -> float | None:
        return self.timers.next()

    def receive(self, batch: list, now: float, handed: bool = False) -> None:
        """``handed``: the batch came from another worker (never handed on again)."""
        if self.config is None:  # no certificate yet (ACME): nothing to answer with
            return
        touched: dict[_Conn, list] = {}  # in arrival order, each once: its datagrams
        for data, addr in batch:
            c = self._route(data, addr, now, handed)
            if c is not None:
                got = touched.get(c)
                if got is None:
                    touched[c] = [(data, addr)]
                else:
                    got.append((data, addr))
        for c, got in touched.items():
            c.heard = now
            try:
                if len(got) == 1:
                    c.quic.receive_datagram(got[0][0], got[0][1], now)
                else:  # runs of one address, each one call of the core
                    for addr, run in itertools.groupby(got, key=_address):
                        c.quic.receive_batch([d for d, _ in run], addr, now)
            except QuicConnectionError:  # closed by its core: handled in _process
                pass
            self._process(c, now)

    def expire(self, now: float) -> None:
        for c in self.timers.due(now):
            try:
                c.quic.handle_timer(now)
            except QuicConnectionError:  # closed by its core: handled in _process
                pass
            self._process(c, now)

    def tick(self, now: float) -> None:
        """Each connection's time limits; and QUIC's idle timeout once the handshake is done
        (RFC 9000 §10.1: nothing heard for it, the connection is forgotten, silently). The
        core keeps it itself only while it is at least ``quic_qh3.HANDSHAKE_HOLD``: under
        it, the core held a handshake that long but holds an established connection to
        the client's own idle timeout (which may be longer) and no longer than that. Until
        the client has confirmed the handshake (``ServerConnection.confirming``) the hold
        is a handshake's: such a client probes as a handshaking one does (RFC 9002 §6.2.2.1),
        and a HANDSHAKE_DONE lost may wait for its probe at 63 s."""
        idle = self.config.idle_timeout if self.config is not None else None
        hold = max(idle, HANDSHAKE_HOLD) if idle else None
        for c in list(self.live):
            if idle and not c.handshaking \
                    and now - c.heard > (hold if c.quic.confirming else idle):
                self._forget(c)
            elif self.stopping:
                self._process(c, now)
        if self.stopping:
            return
        for c in list(self.live):
            try:
                out = c.timed_out(now)
            except QuicConnectionError:  # closed by its core meanwhile
                out = True
            if out:
                self._process(c, now)

    def shutdown(self, now: float) -> None:
        """GOAWAY on every connection (RFC 9114 §5.2); each closes once drained."""
        self.stopping = True
        for c in list(self.live):
            try:
                if c.handshaking:  # no request can have come yet: close now, not at the idle timeout
                    c.quic.close(error_code=ErrorCode.H3_NO_ERROR)
                else:
                    c.go_away()
            except QuicConnectionError:  # closed by its core meanwhile
                pass
            self._process(c, now)

    def close(self) -> None:
        if self.strays and self.steer is not None:
            print(f"orisha: HTTP/3 worker {self.steer.tag.hex()}: {self.strays} datagrams of "
                  "connections no worker knew were dropped", file=sys.stderr)
            self.strays = 0
        for c in self.live:
            if c.counted:
                self.app.open -= 1
        self.live.clear()
        self.handshaking = 0
        self.conns.clear()
        self.timers.heap.clear()
        self.out.clear()

    def _process(self, c: _Conn, now: float) -> None:
        """After input or a timer: handle its events, queue bodies, gather its datagrams.
        An error of qh3's (``QuicConnectionError``: the core closed the connection, e.g. on
        a client's protocol error, and refuses what the HTTP/3 layer still sends) or of
        this code ends that connection, never the worker: its CONNECTION_CLOSE is still
        gathered, and it is forgotten when the core says it has terminated."""
        quic = c.quic
        try:
            ended = self._events(c, now)
            if c.pending:
                c.feed(now)
            if c.goaway and not c.pending and not quic.closing and quic.drained(now):
                quic.close(error_code=ErrorCode.H3_NO_ERROR)  # §5.2: every response delivered
        except QuicConnectionError:
            ended = False
        except Exception as e:  # a bug here: this connection ends, the worker goes on
            ended = False
            self.errors += 1
            if self.errors == 1:
                print(f"orisha: HTTP/3 connection closed on an internal error: {e!r}\n"
                      + traceback.format_exc(), file=sys.stderr, end="")
            quic.close(error_code=ErrorCode.H3_INTERNAL_ERROR, reason_phrase="internal error")
        try:
            _gather(self.out, quic.datagrams_to_send(now))
        except QuicConnectionError as e:  # the core failed building: the connection is lost…
            ended = True
            self.errors += 1
            if self.errors == 1:
                print(f"orisha: HTTP/3 connection closed on an error of the QUIC core: {e!r}",
                      file=sys.stderr)
            try:  # …and the client told so, not left to its idle timeout
                quic.close(error_code=ErrorCode.H3_INTERNAL_ERROR, reason_phrase="internal error")
                _gather(self.out, quic.datagrams_to_send(now))
            except QuicConnectionError:
                pass
        if ended:
            self._forget(c)
            return
        self.timers.set(c, quic.get_timer(), len(self.live))

    def _events(self, c: _Conn, now: float) -> bool:
        """Handle a connection's QUIC events: whether it has terminated."""
        quic, h3 = c.quic, c.h3
        if c.handshaking and c.app is self.app and self.app.hosts is not None \
                and getattr(quic, "tls", None) is not None and quic.tls.early_data_accepted:
            c.app = self.app.view(quic.sni)  # 0-RTT: requests before the handshake completes
        event = quic.next_event()
        ended = False
        while event is not None:
            cls = event.__class__
            if cls is ConnectionIdIssued:
                c.cids.add(event.connection_id)
                self.conns[event.connection_id] = c
                if self.steer is not None:  # drawn by qh3's core: no tag in it
                    self.steer.remember(event.connection_id)
            elif cls is ConnectionIdRetired:
                c.cids.discard(event.connection_id)
                self.conns.pop(event.connection_id, None)
            elif cls is ConnectionTerminated:
                ended = True
            elif cls is HandshakeCompleted and c.handshaking:
                c.handshaking, c.since = False, now
                self.handshaking -= 1
                if self.app.hosts is not None:  # several sites: the SNI's answers (or 421)
                    c.app = self.app.view(quic.sni)
            else:
                for h in h3.handle_event(event):
                    if h.__class__ is HeadersReceived:
                        c.request(h, now)
                if cls is StreamDataReceived:
                    st = h3._stream.get(event.stream_id)
                    if st is not None and (st.buffer or st.frame_size is not None):
                        c.bounded(st)  # a frame is still coming
                elif cls is StreamReset:
                    c.cancelled(event.stream_id)
            event = quic.next_event()
        return ended

    def _forget(self, c: _Conn) -> None:
        for cid in c.cids:
            if self.conns.get(cid) is c:
                del self.conns[cid]
        c.timer = None
        if c.handshaking:
            c.handshaking = False
            self.handshaking -= 1
        if c in self.live:
            self.live.discard(c)
            self.app.open -= 1
            c.counted = False



def _address(item: tuple):
    return item[1]


class _Header:
    """qh3's parsed header (a tuple) by name, for the datagrams of no known connection."""
    __slots__ = ("version", "packet_type", "destination_cid", "source_cid", "token")

    def __init__(self, t: tuple) -> None:
        self.version, self.destination_cid, self.source_cid, self.token = t[0], t[3], t[4], t[5]
        self.packet_type = QuicPacketType(t[1])


def _gather(out: list, datagrams: list) -> None:
    """Queue ``datagrams``, runs of one size to one address as GSO groups (base.py): a
    group ends after a shorter datagram, at ``_GSO_SEGMENTS`` or at ``_GSO_BYTES``."""
    i, n = 0, len(datagrams)
    while i < n:
        data, addr = datagrams[i]
        size = total = len(data)
        j = i + 1
        while j < n and j - i < _GSO_SEGMENTS:
            d, a = datagrams[j]
            m = len(d)
            if a != addr or m > size or total + m > _GSO_BYTES:
                break
            total += m
            j += 1
            if m < size:
                break
        if j - i == 1:
            out.append((data, addr, 0))
        else:
            out.append((b"".join([d for d, _ in datagrams[i:j]]), addr, size))
        i = j


