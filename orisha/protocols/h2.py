"""HTTP/2 (RFC 9113) in front of the HTTP/1.1 core's decisions.

Strategy: a compact frame layer, sans-I/O, with the loop-body contract of
``orisha/loops/base.py`` (``receive``, ``outgoing``, ``sent``, ``tick``…). It
decides nothing about HTTP: each request's pseudo-header and regular fields
become a synthetic HTTP/1.1 head, and ``App.plan`` — the same ``answer()`` and
the same memo as HTTP/1.1 — returns the Plan; negotiation, conditionals,
ranges, routing and limits are therefore one code for both protocols. A Plan
maps to a HEADERS frame (the head's HPACK block — encoded by the build for
every variant's head, memoised for the rest, see ``hpack_blocks.py``; the fields
a site's heads share named from the connection's dynamic table once they are in
it, ``_block`` — plus one Date literal per second) and DATA frames that
are memoryview slices of the build's blob: a response is still a lookup and
a write, never a copy.

Why not the ``h2`` library: it encodes every header block itself (there is no
way to hand it a precomputed block) and runs a general state machine per
frame; measured in a core-only loop (h2 4.4.1 as the server, the same plans)
it cost ~400 µs per repeated request against ~5 µs here. The ``hpack``
library still decodes request blocks (memoised, see ``_decode``).

What the RFC asks and where it is done here: the preface and SETTINGS first
(§3.4), flow control on both windows with SETTINGS_INITIAL_WINDOW_SIZE deltas
(§6.9), padding (§6.1, §6.2), CONTINUATION (§6.10), stream-id rules (§5.1.1),
the concurrency limit (§5.1.2, REFUSED_STREAM), malformed requests (§8.1.1,
§8.2, RST_STREAM PROTOCOL_ERROR), GOAWAY on errors, graceful stop and idle.

Stream states (§5.1): a request is answered as soon as its HEADERS are in,
but its stream stays open on the client's side (``remote_open``: a ``_Body``
per stream) until the client ends it (END_STREAM) or resets it, so whatever
comes later is judged by the state it really has: DATA is checked against the
request's content-length and the stream's window (§8.1.1, §6.9.1), trailers
must end the stream and carry no pseudo-header (§8.1), WINDOW_UPDATE counts
on a stream whose answer is sent (§6.9), and DATA on a stream the client ended
or reset is STREAM_CLOSED (§5.1, §6.1: a connection error, as §5.4.1 allows
for any stream error). Only a stream we reset ourselves ignores late frames
(§5.1 "closed": they may be in flight); a body the server does not need and
that has filled its window is stopped with RST_STREAM NO_ERROR once the
answer is sent (§8.1).

Abuse is bounded (RFC 9113 §10.5; answers are ENHANCE_YOUR_CALM unless the
RFC names another): frames that cost work but produce no response — resets
(CVE-2023-44487 rapid reset), PING, SETTINGS, PRIORITY, empty DATA and
CONTINUATION, refused streams — spend a per-connection budget refilled once a
second; a header block may span at most ``_BLOCK_FRAMES`` frames and
``_BLOCK_MAX`` bytes (the CONTINUATION flood class, CVE-2024-27316); the HPACK
decoder stops at a hard header-list bound (HPACK bomb: COMPRESSION_ERROR,
since its state is then lost) and a list over ``Limits.head`` gets 431; a
connection that makes no progress (zero window, a stalled frame) is closed
after the send or head timeout. Input is parsed only while fewer than
``_OUT_FRAMES`` buffers wait to be written, so PING and SETTINGS floods cannot
grow the output: memory per connection stays one read plus bounded state.
"""

from __future__ import annotations

import struct
from collections import deque

from hpack import Decoder, HPACKError
from hpack.table import HeaderTable

try:  # the compiled module's C helpers (h2.pxd); the pure module never calls them
    import cython
    _COMPILED = cython.compiled
except ImportError:  # no Cython installed: the pure module
    _COMPILED = False

from ..blob import FileRegion
from ..core.connection import log_line
from ..core.hosts import Hosts
from ..core.policy import LINGER, Stat
from .fields import PerSecond, declared_length, error_plan, synthetic_head
from .hpack_blocks import REF, TABLE_SIZE, Blocks, date_field, size_update
from ..core.outgoing import consume

# The hot path's constants as module globals (C integers in the compiled module).
_REQUESTS, _RESPONSE_BYTES, _ERROR_SLOT = Stat.REQUESTS, Stat.RESPONSE_BYTES, Stat.ERROR

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # RFC 9113 §3.4

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20


class Error:
    """RFC 9113 §7 error codes."""
    NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, SETTINGS_TIMEOUT, \
        STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, \
        CONNECT_ERROR, ENHANCE_YOUR_CALM, INADEQUATE_SECURITY, HTTP_1_1_REQUIRED = range(14)


MAX_STREAMS = 100            # SETTINGS_MAX_CONCURRENT_STREAMS (RFC 9113 §6.5.2 suggests ≥ 100)
FRAME_MAX = 16384            # our SETTINGS_MAX_FRAME_SIZE: the default (§4.2), never raised
WINDOW_MAX = (1 << 31) - 1   # §6.9.1
_WINDOW = 65535              # the initial windows (§6.9.2) in both directions
_OUT_HIGH = 256 * 1024       # DATA bytes queued ahead of the socket
_OUT_FRAMES = 512            # buffers queued before input parsing waits (backpressure)
_BLOCK_FRAMES = 32           # HEADERS + CONTINUATION frames one header block may take
_CALM_MAX = 400              # work-without-response frames a connection may send in a burst…
_CALM_PER_SECOND = 100       # …and per second after it
_MEMO_MAX = 256              # header blocks memoised per connection (see ``_decode``)
_SENT_MAX = 64               # our blocks memoised per connection (see ``_block``)


# Fixed-width packing (one C call; the compiled h2 types these ints as C integers, where a
# 72-bit shift would overflow). The compiled module writes frame headers with h2.pxd's
# ``_c_frame``/``_c_framed`` instead (a struct call with five int objects was ~6% of an h2
# request, perf); the other packers serve both.
_HEAD = struct.Struct(">BHBBL").pack  # a frame header: 24-bit length, type, flags, stream id
_U32 = struct.Struct(">L").pack
_U32_U32 = struct.Struct(">LL").pack
_SETTING = struct.Struct(">HL").pack


def _frame(length: int, ftype: int, flags: int, sid: int) -> bytes:
    """A 9-byte frame header (§4.1)."""
    if _COMPILED:
        return _c_frame(length, ftype, flags, sid)  # h2.pxd: the nine bytes written in C
    return _HEAD(length >> 16, length & 0xFFFF, ftype, flags, sid)


def _framed(ftype: int, flags: int, sid: int, payload: bytes, tail: bytes,
            data: int = -1) -> bytes:
    """A frame whose payload is ``payload + tail``, header included, as one buffer; and
    when ``data`` >= 0, after it the header of a DATA frame of ``data`` bytes that ends the
    stream (the response's body follows it)."""
    if _COMPILED:
        return _c_framed(ftype, flags, sid, payload, tail, data)  # one allocation, two memcpy
    frame = _frame(len(payload) + len(tail), ftype, flags, sid) + payload + tail
    return frame if data < 0 else frame + _frame(data, DATA, END_STREAM, sid)


_SETTINGS_ACK = _frame(0, SETTINGS, ACK, 0)
# A graceful stop in two steps (§6.8): a GOAWAY naming the highest stream id there can be
# (every stream the client has sent or is sending is still taken) with a PING; once the
# PING comes back, every stream the client sent before it read that GOAWAY has arrived,
# and the GOAWAY with the last stream taken follows. A client whose ACK does not come
# within _DRAIN_WAIT gets it then (at a tick: about once a second).
_DRAIN_PING = b"orisha\x00\x01"
_DRAIN_FIRST = (_frame(8, GOAWAY, 0, 0) + _U32_U32(WINDOW_MAX, 0)
                + _frame(8, PING, 0, 0) + _DRAIN_PING)
_DRAIN_WAIT = 1.0
_BLOCKS = Blocks()
_OUR_SETTINGS: dict = {}  # header-list limit → our first SETTINGS frame (H2Connection)
_DATE = PerSecond(date_field)  # the one per-second part of a header block: its Date


def _date_field(now: float) -> bytes:
    """``_DATE``'s field for ``now``, read without a call within its second."""
    date = _DATE
    second = int(now)
    return date.field if second == date.second else date(now)


def take(site) -> None:
    """The header blocks of ``site``'s builds (a ``Hosts``: every site's) and the tables
    made of them (``Blocks.take``), before the workers fork: a worker's first HTTP/2
    connection finds them made (a 9,000-head site: ~0.2 s)."""
    if site.__class__ is Hosts:
        _BLOCKS.take(site.sites[0], site)
    else:
        _BLOCKS.take(site)


# What a header block is (``_Block.kind``): every kind is decoded (HPACK state).
_REQUEST, _TRAILERS, _IGNORED = 0, 1, 2


class _Block:
    """A header block being received: HEADERS, then CONTINUATION frames until END_HEADERS."""
    __slots__ = ("sid", "end", "frags", "size", "kind")

    def __init__(self, sid: int, end: int, first: bytes, kind: int) -> None:
        self.sid, self.end, self.frags, self.size, self.kind = sid, end, [first], len(first), kind


class _Stream:
    """A response whose DATA is not all queued yet (the send side of one stream)."""
    __slots__ = ("sid", "window", "body", "pos", "parked")

    def __init__(self, sid: int, window: int, body) -> None:
        self.sid, self.window, self.body, self.pos, self.parked = sid, window, body, 0, False


class _Body:
    """The client's side of a stream it has not ended yet (§5.1 "open", "half-closed
    (local)"): the content-length it declared (-1: none to check), the DATA bytes so far,
    its receive window, and, once our answer is all queued, that answer's send window
    (None while ``streams`` holds it)."""
    __slots__ = ("length", "got", "window", "send")

    def __init__(self, length: int) -> None:
        self.length, self.got, self.window, self.send = length, 0, _WINDOW, None


class H2Connection:
    """One HTTP/2 connection; the loop-body contract of ``orisha/loops/base.py``.

    ``preface``: False when the 24-byte client preface was already consumed
    (h2c sniffing saw it); ``refuse``: answer every request 503 (over the
    connection limit) and go away. The owner counts the connection in
    ``App.open``; this object does not.
    """

    def __init__(self, app, now: float, peer: str = "-", preface: bool = True,
                 refuse: bool = False) -> None:
        self.app, self.peer, self.since, self.refuse = app, peer, now, refuse
        _BLOCKS.take(app.site, app.hosts)  # the header blocks its builds encoded (once)
        # What every request reads, looked up once per connection: the App's plan memo,
        # counters, log and head limit (an App never rebinds them), the blocks of its builds.
        self.built, self.early = _BLOCKS.built, _BLOCKS.early
        # Our side of the peer's HPACK dynamic table (hpack_blocks.py, ``vocabulary``): where
        # each shared field went in (its count of insertions before it; 255: not in), how
        # many went in and their size, the most the peer allows, a size update owed to the
        # next header block (§4.2), and head → (insertions, block) while nothing new goes in.
        self.pieces, self.inc, self.sizes = _BLOCKS.pieces, _BLOCKS.inc, _BLOCKS.sizes
        self.table_max = TABLE_SIZE
        self.table_update = b""
        self.sent_blocks: dict[bytes, tuple] = {}
        self._empty_table()
        self.plans, self.counts, self.log_lines = app.plans, app.counts, app.log_lines
        self.hosts, self.head_max = app.hosts, app.limits.head
        self.buf = b""
        self.out: list = []
        self.out_bytes = 0
        self.should_close = self.shut_write = self.eof = False
        self.preface = 0 if preface else len(PREFACE)  # preface bytes seen so far
        self.settings_seen = False
        self.closing = False      # GOAWAY sent: no new streams
        self.draining = False     # a stop's first GOAWAY and PING sent, the PING not back yet
        self.drain_since = 0.0
        self.dead = False         # a connection error: input is no longer parsed
        self.decoder = Decoder(max_header_list_size=4 * app.limits.head)
        self.window = _WINDOW     # connection send window
        self.initial = _WINDOW    # the peer's SETTINGS_INITIAL_WINDOW_SIZE
        self.max_frame = FRAME_MAX
        self.recv_window, self.recv_used = _WINDOW, 0
        self.streams: dict[int, _Stream] = {}
        self.ready: deque[_Stream] = deque()
        self.remote_open: dict[int, _Body] = {}  # streams whose request has not ended yet
        self.resets: deque[int] = deque(maxlen=128)  # streams we reset lately (frames in flight)
        self.memo: dict[bytes, tuple] = {}  # header block → (head, log line, declared)
        self.last_id = 0
        self.hdr: _Block | None = None  # a header block still awaiting CONTINUATION
        self.calm = _CALM_MAX
        settings = _OUR_SETTINGS.get(self.head_max)  # the same frame for every connection
        if settings is None:
            settings = _OUR_SETTINGS[self.head_max] = (
                _frame(12, SETTINGS, 0, 0) + _SETTING(3, MAX_STREAMS) + _SETTING(6, self.head_max))
        self.out.append(settings)
        self.out_bytes = len(settings)

    # -- the loop body's side of the contract ---------------------------------
    @property
    def outgoing(self) -> list:
        return self.out

    @property
    def wants_read(self) -> bool:
        return self.reading()

    def reading(self) -> bool:
        """``wants_read``, as a method the compiled TLS layer calls in C."""
        return not self.out and not self.should_close

    def receive(self, data: bytes, now: float) -> None:
        if self.shut_write or self.dead:  # lingering: input is discarded until the peer's EOF
            if not data:
                self.should_close = True
            return
        if not data:
            self.eof = True
        else:
            self.buf = self.buf + data if self.buf else data
            self._process(now)
        self._settle(now)

    def sent(self, n: int, now: float) -> None:
        self.since = now
        if n >= self.out_bytes:  # everything written: the common case, inline
            self.out.clear()
            self.out_bytes = 0
        else:
            self.out_bytes = consume(self.out, self.out_bytes, n)
        if not self.out:
            self._pump()
            if self.buf and not self.dead:
                self._process(now)
            self._settle(now)

    def tick(self, now: float) -> None:
        self.calm = min(_CALM_MAX, self.calm + _CALM_PER_SECOND)
        if self.draining and now - self.drain_since > _DRAIN_WAIT:
            self._drained(now)
        limits = self.app.limits
        waited = now - self.since
        if self.shut_write:
            if waited > LINGER:
                self.should_close = True
        elif self.out:
            if waited > limits.send_timeout:
                self.should_close = True
        elif self.streams:  # every window is zero and nothing moves (§10.5)
            if waited > limits.send_timeout:
                self._fail(Error.ENHANCE_YOUR_CALM)
        elif self.buf or self.hdr is not None:  # a frame or header block that never completes
            if waited > limits.head_timeout:
                self._fail(Error.ENHANCE_YOUR_CALM)
        elif waited > limits.idle_timeout:
            self._go_away(Error.NO_ERROR)
        self._settle(now)

    def shutdown(self, now: float) -> None:
        """Graceful stop (§6.8): GOAWAY in two steps (``_DRAIN_FIRST``, then ``_drained``),
        finish the streams up to the last one taken, then close."""
        if self.closing or self.draining:
            return self._settle(now)
        if self.dead or not self.settings_seen:  # nothing in flight to wait for
            self._go_away(Error.NO_ERROR)
            return self._settle(now)
        self.draining, self.drain_since = True, now
        self.out.append(_DRAIN_FIRST)
        self.out_bytes += len(_DRAIN_FIRST)

    def _drained(self, now: float) -> None:
        """The stop's PING came back (or waited long enough): the GOAWAY with the last
        stream taken; the streams up to it finish, then the connection closes."""
        self.draining = False
        self._go_away(Error.NO_ERROR)
        self._settle(now)

    def close(self) -> None:
        self.streams.clear()
        self.ready.clear()

    # -- connection state ------------------------------------------------------
    def _settle(self, now: float) -> None:
        """Finish once nothing is left to do: our GOAWAY went out, or the peer is done."""
        if self.out or self.should_close or self.shut_write:
            return
        # After the peer's EOF with nothing left to write, what remains can never move: a
        # stream waiting for window (no WINDOW_UPDATE comes after a FIN), an unfinished block.
        if self.dead or self.eof or (self.closing and not self.streams and self.hdr is None):
            if self.eof:
                self.should_close = True
            else:  # linger: shut our side, drain input until the peer's EOF (as HTTP/1.1 does)
                self.shut_write = True
                self.since = now

    def _go_away(self, code: int) -> None:
        if not self.closing or code:
            self.out.append(_frame(8, GOAWAY, 0, 0) + _U32_U32(self.last_id, code))
            self.out_bytes += 17
        self.closing = True

    def _fail(self, code: int) -> None:
        """A connection error (§5.4.1): GOAWAY with ``code``, drop everything, close."""
        if not self.dead:
            self._go_away(code)
            self.dead = True
            self.buf = b""
            self.hdr = None
            self.streams.clear()
            self.ready.clear()

    def _reset(self, sid: int, code: int) -> None:
        """A stream error (§5.4.2): RST_STREAM and forget the stream."""
        self.out.append(_frame(4, RST_STREAM, 0, sid) + _U32(code))
        self.out_bytes += 13
        self.resets.append(sid)
        self.remote_open.pop(sid, None)
        st = self.streams.pop(sid, None)
        if st is not None and not st.parked:
            self.ready.remove(st)

    def _spend(self) -> bool:
        """One frame of work without a response; False (and GOAWAY) when the budget is gone."""
        self.calm -= 1
        if self.calm < 0:
            self._fail(Error.ENHANCE_YOUR_CALM)
            return False
        return True

    # -- input -----------------------------------------------------------------
    def _process(self, now: float) -> None:
        buf = self.buf
        pos = 0
        if self.preface < 24:
            n = min(24 - self.preface, len(buf))
            if buf[:n] != PREFACE[self.preface:self.preface + n]:
                self._fail(Error.PROTOCOL_ERROR)  # §3.4: not HTTP/2 after all
                return
            self.preface += n
            pos = n
        end_of_buf = len(buf)
        frames, frame_max = _OUT_FRAMES, FRAME_MAX  # typed locals in the compiled module
        while len(self.out) < frames and not self.dead:
            if end_of_buf - pos < 9:
                break
            length = buf[pos] << 16 | buf[pos + 1] << 8 | buf[pos + 2]
            if length > frame_max:
                self._fail(Error.FRAME_SIZE_ERROR)  # §4.2
                return
            end = pos + 9 + length
            if end > end_of_buf:
                break
            ftype, flags = buf[pos + 3], buf[pos + 4]
            sid = ((buf[pos + 5] & 0x7F) << 24 | buf[pos + 6] << 16 | buf[pos + 7] << 8
                   | buf[pos + 8])
            payload = _c_slice(buf, pos + 9, end) if _COMPILED else buf[pos + 9:end]
            pos = end
            if not self.settings_seen and ftype != SETTINGS:
                self._fail(Error.PROTOCOL_ERROR)  # §3.4: the preface ends with SETTINGS
                return
            if self.hdr is not None and (ftype != CONTINUATION or sid != self.hdr.sid):
                self._fail(Error.PROTOCOL_ERROR)  # §6.10: nothing may interleave a header block
                return
            # Direct calls, the common types first (C calls in the compiled module).
            if ftype == HEADERS:
                self._headers(flags, sid, payload, now)
            elif ftype == WINDOW_UPDATE:
                self._window_update(flags, sid, payload, now)
            elif ftype == DATA:
                self._data(flags, sid, payload, now)
            elif ftype == SETTINGS:
                self._settings(flags, sid, payload, now)
            elif ftype == CONTINUATION:
                self._continuation(flags, sid, payload, now)
            elif ftype == RST_STREAM:
                self._rst_stream(flags, sid, payload, now)
            elif ftype == PING:
                self._ping(flags, sid, payload, now)
            elif ftype == PRIORITY:
                self._priority(flags, sid, payload, now)
            elif ftype == GOAWAY:
                self._goaway(flags, sid, payload, now)
            elif ftype == PUSH_PROMISE:
                self._push_promise(flags, sid, payload, now)
            else:
                self._spend()  # §5.5: unknown types are ignored (and budgeted)
        if not self.dead:
            self.buf = buf[pos:] if pos else buf

    def _unpad(self, flags: int, payload: bytes) -> bytes | None:
        if flags & PADDED:
            if not payload or payload[0] >= len(payload):
                self._fail(Error.PROTOCOL_ERROR)  # §6.1: padding as long as the payload
                return None
            return payload[1:len(payload) - payload[0]]
        return payload

    def _data(self, flags: int, sid: int, payload: bytes, now: float) -> None:
        if sid == 0:
            return self._fail(Error.PROTOCOL_ERROR)
        size = len(payload)
        self.recv_window -= size  # padding counts too (§6.9.1)
        if self.recv_window < 0:
            return self._fail(Error.FLOW_CONTROL_ERROR)
        self.recv_used += len(payload)
        if self.recv_used >= _WINDOW // 2:  # request bodies are discarded: give the window back
            self.out.append(_frame(4, WINDOW_UPDATE, 0, 0) + _U32(self.recv_used))
            self.out_bytes += 13
            self.recv_window += self.recv_used
            self.recv_used = 0
        payload = self._unpad(flags, payload)
        if payload is None:
            return
        body = self.remote_open.get(sid)
        if body is not None:
            body.window -= size
            body.got += len(payload)
            if body.window < 0:
                self._reset(sid, Error.FLOW_CONTROL_ERROR)  # §6.9.1: past the stream's window
            elif body.length >= 0 and (body.got > body.length or flags & END_STREAM
                                       and body.got != body.length):
                self._reset(sid, Error.PROTOCOL_ERROR)  # §8.1.1: not its content-length
            elif flags & END_STREAM:
                del self.remote_open[sid]
            elif not payload:
                self._spend()
            elif body.window == 0 and body.send is not None:
                self._reset(sid, Error.NO_ERROR)  # §8.1: answered; the rest cannot come
        elif sid > self.last_id:
            self._fail(Error.PROTOCOL_ERROR)  # §5.1: DATA on an idle stream
        elif sid in self.resets:
            self._spend()  # §5.1 "closed": frames sent before our RST_STREAM arrived, ignored
        else:
            self._fail(Error.STREAM_CLOSED)  # §5.1, §6.1: the client ended or reset it

    def _headers(self, flags: int, sid: int, payload: bytes, now: float) -> None:
        if sid == 0 or sid % 2 == 0:
            return self._fail(Error.PROTOCOL_ERROR)  # §5.1.1: clients use odd ids
        payload = self._unpad(flags, payload)
        if payload is None:
            return
        self_dependent = False
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                return self._fail(Error.FRAME_SIZE_ERROR)
            self_dependent = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == sid
            payload = payload[5:]
        if sid in self.remote_open:
            kind = _TRAILERS
            if not flags & END_STREAM:
                self._reset(sid, Error.PROTOCOL_ERROR)  # §8.1: trailers end the stream
                kind = _IGNORED
        elif sid <= self.last_id:
            if sid not in self.resets:  # §5.1.1: ids only grow; a closed stream takes no HEADERS
                return self._fail(Error.PROTOCOL_ERROR)
            kind = _IGNORED  # late trailers on a stream we reset (§5.1 "closed"): decoded, for
            if not self._spend():  # the HPACK state, then dropped
                return
        else:
            self.last_id = sid
            kind = _REQUEST
            if self.closing:  # §6.8: after our GOAWAY a new stream is ignored, with its frames
                kind = _IGNORED
                self.resets.append(sid)
            self.since = now
        if self_dependent:  # §5.3.1: a stream error; the block is still decoded (HPACK state)
            self._reset(sid, Error.PROTOCOL_ERROR)
            kind = _IGNORED
        if flags & END_HEADERS:  # the whole block in this frame (the common case)
            self._end_block(sid, flags & END_STREAM, payload, len(payload), kind, now)
        else:
            self.hdr = _Block(sid, flags & END_STREAM, payload, kind)

    def _continuation(self, flags: int, sid: int, payload: bytes, now: float) -> None:
        hdr = self.hdr
        if hdr is None:
            return self._fail(Error.PROTOCOL_ERROR)  # §6.10: only after HEADERS
        hdr.frags.append(payload)
        hdr.size += len(payload)
        if len(hdr.frags) > _BLOCK_FRAMES or hdr.size > 2 * self.app.limits.head:
            return self._fail(Error.ENHANCE_YOUR_CALM)  # CONTINUATION flood
        if flags & END_HEADERS:
            self._end_headers(now)
        elif not payload:
            self._spend()

    def _end_headers(self, now: float) -> None:
        hdr, self.hdr = self.hdr, None
        frags = hdr.frags
        self._end_block(hdr.sid, hdr.end, frags[0] if len(frags) == 1 else b"".join(frags),
                        hdr.size, hdr.kind, now)

    def _end_block(self, sid: int, end: int, block: bytes, size: int, kind: int,
                   now: float) -> None:
        """A whole header block of ``size`` bytes (§4.3), received on stream ``sid``."""
        if size > 2 * self.head_max:
            return self._fail(Error.ENHANCE_YOUR_CALM)
        if kind == _TRAILERS:
            return self._trailers(sid, block)
        decoded = self._decode(block)
        if decoded is None:
            return
        if kind == _REQUEST:
            # The scan only near the limit: len(remote_open) bounds the half-closed count.
            if (len(self.streams) + len(self.remote_open) >= MAX_STREAMS
                    and len(self.streams) + _answered(self.remote_open) >= MAX_STREAMS):
                self._reset(sid, Error.REFUSED_STREAM)  # §5.1.2: half-closed streams count
                self._spend()
                return
            declared = decoded[2]
            if end and declared > 0:
                return self._reset(sid, Error.PROTOCOL_ERROR)  # §8.1.1: no DATA to match it
            if not end:
                self.remote_open[sid] = _Body(declared)
            self._request(sid, decoded, now)

    def _trailers(self, sid: int, block: bytes) -> None:
        """§8.1: trailers end the request; a pseudo-header in them, or a body short of its
        content-length, makes it malformed (§8.1.1). Decoded here, not memoised."""
        try:
            fields = self.decoder.decode(block, raw=True)
        except HPACKError:
            return self._fail(Error.COMPRESSION_ERROR)
        self.memo.clear()  # the dynamic table may have changed (see ``_decode``)
        body = self.remote_open.pop(sid, None)
        if body is None:
            return
        if _pseudo(fields) or 0 <= body.length != body.got:
            self._reset(sid, Error.PROTOCOL_ERROR)

    def _decode(self, block: bytes) -> tuple | None:
        """(synthetic head, log line, its declared content-length:
        ``fields.declared_length``) for a header block; None after a decoding error.

        Clients repeat requests as the same bytes: indexed fields, and literals *without*
        indexing for what they never index (nghttp2 keeps ``:path`` out of the table). A
        block that does not change the dynamic table decodes to what it did before for
        as long as the table stays as it was. So such blocks are memoised per connection
        — the ``hpack`` decoder was ~60% of the CPU per request (measured with a
        core-only loop) — and a block that changed the table (an incremental-indexing
        literal, a size update) empties the memo.
        """
        memo = self.memo
        pair = memo.get(block)
        if pair is not None:
            return pair
        table = self.decoder.header_table
        entries = table.dynamic_entries  # newest first: a new entry is a new tuple at [0]
        before = (len(entries), entries[0] if entries else None, table.maxsize)
        try:
            pair = _first_block(self.decoder, block)
        except HPACKError:  # a decoding error, a table-size violation or an HPACK bomb: the
            self._fail(Error.COMPRESSION_ERROR)  # shared table is now unusable (§4.3)
            return None
        first = entries[0] if entries else None
        if (len(entries), table.maxsize) != (before[0], before[2]) or first is not before[1]:
            memo.clear()
        else:
            if len(memo) >= _MEMO_MAX:
                memo.clear()
            memo[block] = pair
        return pair

    def _priority(self, flags: int, sid: int, payload: bytes, now: float) -> None:
        if sid == 0:
            return self._fail(Error.PROTOCOL_ERROR)
        if not self._spend():
            return
        if len(payload) != 5:
            self._reset(sid, Error.FRAME_SIZE_ERROR)  # §6.3: a stream error
        elif int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == sid:
            self._reset(sid, Error.PROTOCOL_ERROR)

    def _rst_stream(self, flags: int, sid: int, payload: bytes, now: float) -> None:
        if sid == 0 or sid > self.last_id:
            return self._fail(Error.PROTOCOL_ERROR)  # §6.4: not on idle streams
        if len(payload) != 4:
            return self._fail(Error.FRAME_SIZE_ERROR)
        if not self._spend():  # rapid reset (CVE-2023-44487) runs out of budget here
            return
        self.remote_open.pop(sid, None)
        st = self.streams.pop(sid, None)
        if st is not None and not st.parked:
            self.ready.remove(st)

    def _settings(self, flags: int, sid: int, payload: bytes, now: float) -> None:
        if sid != 0:
            return self._fail(Error.PROTOCOL_ERROR)
        if flags & ACK:
            if payload:
                self._fail(Error.FRAME_SIZE_ERROR)
            return
        if len(payload) % 6:
            return self._fail(Error.FRAME_SIZE_ERROR)
        if self.settings_seen and not self._spend():
            return
        self.settings_seen = True
        for i in range(0, len(payload), 6):
            key = int.from_bytes(payload[i:i + 2], "big")
            value = int.from_bytes(payload[i + 2:i + 6], "big")
            if key == 2 and value > 1:
                return self._fail(Error.PROTOCOL_ERROR)  # ENABLE_PUSH
            if key == 4:  # INITIAL_WINDOW_SIZE: applies to open streams as a delta (§6.9.2)
                if value > WINDOW_MAX:
                    return self._fail(Error.FLOW_CONTROL_ERROR)
                delta, self.initial = value - self.initial, value
                for st in self.streams.values():
                    st.window += delta
                    if st.window > WINDOW_MAX:
                        return self._fail(Error.FLOW_CONTROL_ERROR)
                    if st.parked and st.window > 0:
                        st.parked = False
                        self.ready.append(st)
                for body in self.remote_open.values():  # answered, still open: windows too
                    if body.send is not None:
                        body.send += delta
                        if body.send > WINDOW_MAX:
                            return self._fail(Error.FLOW_CONTROL_ERROR)
            elif key == 5:
                if not FRAME_MAX <= value <= (1 << 24) - 1:
                    return self._fail(Error.PROTOCOL_ERROR)
                self.max_frame = value
            elif key == 1 and value < self.table_max:  # HEADER_TABLE_SIZE, lowered (§6.5.2)
                self._shrink_table(value)
            # The rest are advisory; a larger table is not used (entries fit TABLE_SIZE).
        self.out.append(_SETTINGS_ACK)
        self.out_bytes += 9
        self._pump()

    def _push_promise(self, flags: int, sid: int, payload: bytes, now: float) -> None:
        self._fail(Error.PROTOCOL_ERROR)  # §8.4: a client cannot push

    def _ping(self, flags: int, sid: int, payload: bytes, now: float) -> None:
        if sid != 0:
            return self._fail(Error.PROTOCOL_ERROR)
        if len(payload) != 8:
            return self._fail(Error.FRAME_SIZE_ERROR)
        if flags & ACK:
            if self.draining and payload == _DRAIN_PING:
                self._drained(now)
        elif self._spend():
            self.out.append(_frame(8, PING, ACK, 0) + payload)
            self.out_bytes += 17

    def _goaway(self, flags: int, sid: int, payload: bytes, now: float) -> None:
        if sid != 0:
            return self._fail(Error.PROTOCOL_ERROR)
        self.closing = True  # the peer starts no more streams; ours finish, then we close

    def _window_update(self, flags: int, sid: int, payload: bytes, now: float) -> None:
        if len(payload) != 4:
            return self._fail(Error.FRAME_SIZE_ERROR)
        inc = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if sid == 0:
            if inc == 0:
                return self._fail(Error.PROTOCOL_ERROR)  # §6.9
            self.window += inc
            if self.window > WINDOW_MAX:
                return self._fail(Error.FLOW_CONTROL_ERROR)
        else:
            st = self.streams.get(sid)
            if st is not None:
                if inc == 0:
                    return self._reset(sid, Error.PROTOCOL_ERROR)
                st.window += inc
                if st.window > WINDOW_MAX:
                    return self._reset(sid, Error.FLOW_CONTROL_ERROR)
                if st.parked and st.window > 0:
                    st.parked = False
                    self.ready.append(st)
            elif sid in self.remote_open:  # answered, the request still open: it counts (§6.9)
                body = self.remote_open[sid]
                if inc == 0:
                    return self._reset(sid, Error.PROTOCOL_ERROR)
                body.send += inc
                if body.send > WINDOW_MAX:
                    return self._reset(sid, Error.FLOW_CONTROL_ERROR)
            elif sid > self.last_id:
                return self._fail(Error.PROTOCOL_ERROR)  # idle stream
        self._pump()

    # -- requests and responses ----------------------------------------------
    def _request(self, sid: int, decoded: tuple, now: float) -> None:
        head, line, _ = decoded
        if head is None:
            return self._reset(sid, Error.PROTOCOL_ERROR)  # §8.1.1 malformed
        if self.refuse:
            plan = error_plan(503)
        elif len(head) > self.head_max:
            plan = error_plan(431)  # RFC 9113 §10.5.1
        else:
            plan = self.plans.get(head)
            if plan is None:
                plan = self.app.plan(head)
        self._respond(sid, plan, line, now, request=head)
        if self.refuse:
            self._go_away(Error.NO_ERROR)

    def _respond(self, sid: int, plan, line: bytes, now: float, request: bytes = b"") -> None:
        head, _, body, _, _, status, stats = plan
        if stats is None:  # not made by App.plan: the connection's site counts it (App.counts)
            stats = self.counts
        size = len(body)
        stats[_REQUESTS] += 1
        stats[_RESPONSE_BYTES] += size
        if status >= 400:
            stats[_ERROR_SLOT[status]] += 1
        if self.log_lines is not None:
            self.log_lines.append(log_line(self.peer, now, line, status, size, b""
                                           if self.hosts is None else self.hosts.label(request)))
        if self.early:
            self._early_hints(sid, head)
        hit = self.sent_blocks.get(head)  # this head's block on this connection, if still valid
        block = hit[1] if hit is not None and hit[0] == self.inserted else self._block(head)
        date = _date_field(now)
        out = self.out
        length = len(block) + len(date)
        self.out_bytes += length + 9
        if length > self.max_frame:  # §6.10: the rest of a long block in CONTINUATION frames
            return self._long_block(sid, block + date, body)
        if not size:
            out.append(_framed(HEADERS, END_HEADERS | END_STREAM, sid, block, date))
            return self._ended(sid, self.initial)
        # DATA frames are at most 16 KiB (the peer's max frame size, usually), so a large
        # body is framed from its map (``FileRegion.view``) rather than sent with sendfile.
        view = body.view if type(body) is FileRegion else body
        if (not self.ready and self.out_bytes < _OUT_HIGH
                and size <= self.initial and size <= self.window and size <= self.max_frame):
            # What ``_pump`` would queue at once, without its stream: the body in one DATA
            # frame, its header in the HEADERS frame's buffer.
            out.append(_framed(HEADERS, END_HEADERS, sid, block, date, size))
            out.append(view)
            self.out_bytes += 9 + size
            self.window -= size
            return self._ended(sid, self.initial - size)
        out.append(_framed(HEADERS, END_HEADERS, sid, block, date))
        self._stream(sid, view)

    def _block(self, head: bytes) -> bytes:
        """``head``'s header block on this connection: its shared fields named in the dynamic
        table, or put there when there is room, the rest as the build encoded them; a head
        with none of them, the build's block (else Blocks.get's memo). Memoised while it
        puts nothing in (then it is the same bytes until something else does)."""
        owed = self._owed() if self.table_update else b""  # not part of the memoised block
        pieces = self.pieces.get(head)
        if pieces is None:
            block = self.built.get(head)
            if block is None:
                block = _BLOCKS.get(head)
            return owed + block if owed else block
        parts = []
        before = self.inserted
        slots = self.slots
        for vid, literal in pieces:
            if vid >= 0:
                k = slots[vid]
                if k != 255:  # in the table: index 62 is the newest entry (§2.3.3)
                    parts.append(REF[61 + self.inserted - k])
                    continue
                if self.table_used + self.sizes[vid] <= self.table_max:
                    slots[vid] = self.inserted
                    self.inserted += 1
                    self.table_used += self.sizes[vid]
                    parts.append(self.inc[vid])
                    continue
            parts.append(literal)
        block = b"".join(parts)
        if self.inserted == before:
            if len(self.sent_blocks) >= _SENT_MAX:
                self.sent_blocks.clear()
            self.sent_blocks[head] = (before, block)
        return owed + block if owed else block

    def _shrink_table(self, size: int) -> None:
        """The peer's table is smaller than ours now: the next header block starts by
        emptying it and setting our size to ``size`` (§4.2: the smallest, then the last);
        what went in is forgotten."""
        self.table_max = size
        self.table_update = size_update(0) + (size_update(size) if size else b"")
        self._empty_table()

    def _empty_table(self) -> None:
        """Nothing of ours in the peer's table (a new connection, or one it emptied)."""
        self.slots = bytearray(b"\xff" * len(self.inc))
        self.inserted = self.table_used = 0
        self.sent_blocks.clear()

    def _owed(self) -> bytes:
        """The dynamic table size update owed to the next header block (§4.2), once."""
        update, self.table_update = self.table_update, b""
        return update

    def _long_block(self, sid: int, block: bytes, body) -> None:
        """A header block longer than the peer's frame size: HEADERS, then CONTINUATION."""
        out = self.out
        step = self.max_frame
        out.append(_frame(step, HEADERS, 0 if body else END_STREAM, sid) + block[:step])
        for i in range(step, len(block), step):
            part = block[i:i + step]
            last = END_HEADERS if i + step >= len(block) else 0
            out.append(_frame(len(part), CONTINUATION, last, sid) + part)
            self.out_bytes += 9  # each CONTINUATION's header (HEADERS' is counted)
        if body:
            self._stream(sid, body.view if type(body) is FileRegion else body)
        else:
            self._ended(sid, self.initial)

    def _stream(self, sid: int, view) -> None:
        """The body goes out as the windows allow (``_pump``)."""
        st = self.streams[sid] = _Stream(sid, self.initial, memoryview(view))
        self.ready.append(st)
        self._pump()

    def _early_hints(self, sid: int, head: bytes) -> None:
        """A 103 (RFC 8297) before the 200 of a page with early hints: one HEADERS frame
        without END_STREAM, an informational response (RFC 9113 §8.1). Sent within the
        same write as the 200, it lets the browser start its preloads while it is still
        receiving and parsing the page."""
        hints = self.early.get(head)
        if hints and len(hints) + len(self.table_update) <= self.max_frame:
            if self.table_update:  # the next header block is this one
                hints = self._owed() + hints
            self.out.append(_frame(len(hints), HEADERS, END_HEADERS, sid) + hints)
            self.out_bytes += len(hints) + 9

    def _ended(self, sid: int, window: int) -> None:
        """Our side of ``sid`` is done (``window``: what is left of its send window). A
        request still open stays so (half-closed (local), §5.1) until the client ends or
        resets it; one whose body has filled its window is told to stop (§8.1)."""
        body = self.remote_open.get(sid) if self.remote_open else None
        if body is not None:
            body.send = window
            if body.window <= 0:
                self._reset(sid, Error.NO_ERROR)

    def _pump(self) -> None:
        """Queue DATA frames, round robin over ready streams, within windows and ``_OUT_HIGH``."""
        ready, out = self.ready, self.out
        while ready and self.window > 0 and self.out_bytes < _OUT_HIGH:
            st = ready[0]
            left = len(st.body) - st.pos
            n = min(left, st.window, self.window, self.max_frame)
            if n <= 0:
                ready.popleft()
                st.parked = True  # until a WINDOW_UPDATE or a SETTINGS delta opens its window
                continue
            pos = st.pos
            st.pos = pos + n
            st.window -= n
            self.window -= n
            done = n == left
            out.append(_frame(n, DATA, END_STREAM if done else 0, st.sid))
            out.append(st.body[pos:pos + n])
            self.out_bytes += 9 + n
            ready.popleft()
            if done:
                del self.streams[st.sid]
                self._ended(st.sid, st.window)
            else:
                ready.append(st)


def _answered(remote_open: dict) -> int:
    """How many open requests have their answer all queued (half-closed (local))."""
    return sum(1 for b in remote_open.values() if b.send is not None)


def _pseudo(fields) -> bool:
    """True when a decoded field list has a pseudo-header (not allowed in trailers)."""
    return any(name[:1] == b":" for name, _ in fields)


_FIRST_MAX = 64  # header blocks memoised per worker against a pristine table (``_first_block``)
_FIRST_BLOCK_MAX = 1024  # longer blocks are decoded every time (at most ~64 KiB memoised)
_FIRST: dict = {}  # (block, header-list bound) → (_decode's triple, the entries it left, their size)


def _first_block(decoder: Decoder, block: bytes) -> tuple:
    """``_decode``'s (head, log line, declared content-length) for ``block``, memoised per
    worker where the dynamic table is still pristine (empty, at its default size: a
    connection's first block, or the first after a table change emptied it). From that
    state a block decodes to the same fields and adds the same entries whatever the
    connection, and every new connection of a client sends the same first block (h2load,
    a browser: its ``:authority``, ``user-agent``…, Huffman-coded literals). The ``hpack``
    library decodes Huffman in Python: ~150-300 µs per new connection, a third of the CPU
    of a full TLS handshake with one h2 request (measured: 1,050 µs against nginx's 775);
    the synthetic head and its checks (``fields.synthetic_head``, ``declared_length``:
    regular expressions) are the same for the same fields, ~30k instructions more per connection
    (callgrind). A hit puts back the table the decoding left: its entries (newest first)
    and the size ``HeaderTable.add`` counted for them (``_current_size``: the ``hpack``
    table's own count, which decides its evictions; tests/test_h2.py compares the whole
    table with a decoded one), without a Python call per entry (a browser's first block
    adds ten or so). A block with a size update (the table no longer at its default size),
    a long block or a decoding error (HPACKError, raised) is not kept."""
    table = decoder.header_table
    pristine = not table.dynamic_entries and table.maxsize == HeaderTable.DEFAULT_SIZE
    if pristine:
        key = (block, decoder.max_header_list_size)
        hit = _FIRST.get(key)
        if hit is not None:
            if hit[1]:
                table.dynamic_entries.extend(hit[1])
                table._current_size = hit[2]
            return hit[0]
    fields = decoder.decode(block, raw=True)
    head, line = synthetic_head(fields)
    pair = (head, line, declared_length(head))
    if pristine and table.maxsize == HeaderTable.DEFAULT_SIZE and len(block) <= _FIRST_BLOCK_MAX:
        if len(_FIRST) >= _FIRST_MAX:
            _FIRST.clear()
        _FIRST[key] = (pair, tuple(table.dynamic_entries), table._current_size)
    return pair

