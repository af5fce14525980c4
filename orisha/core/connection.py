"""The sans-I/O request core: bytes in, buffers out.

Strategy: a ``Connection`` is fed the bytes a loop body read and hands back
the buffers to write, in order. It frames requests (pipelining, keep-alive,
bodies to discard), picks a precomputed response, and decides when the
connection ends and when it times out. It never touches a socket or a clock:
the loop passes ``now`` (seconds since the epoch) into every call.

The loop body contract (see ``orisha/loops/base.py``):
  ``app.connect(now)`` on accept; ``receive(data, now)`` with what was read
  (``b""`` = the peer finished sending); write ``outgoing`` and report it with
  ``sent(n, now)``; read only while ``wants_read``; close when ``should_close``;
  call ``tick(now)`` about once a second; ``shutdown(now)`` to stop gracefully;
  ``close()`` once the socket is closed.

Backpressure: while output is pending the core asks for no input, and it
answers at most ``Limits.pipeline`` requests per round, so a connection holds
at most one read's worth of unparsed bytes plus references to constant bodies.
"""

from __future__ import annotations

import re

from .dates import format_http_date, parse_http_date
from .negotiate import accept_encoding_mask, byte_range, none_match, route_key
from .request import KNOWN_METHODS, SAFE_METHODS, HttpError, parse_head
from .site import IDENTITY, Entry, Redirect, Site


class Limits:
    """Per-worker limits; every one is configurable from the CLI."""

    __slots__ = ("head", "target", "body", "idle_timeout", "head_timeout", "send_timeout",
                 "pipeline", "connections", "grace")

    def __init__(self, head: int = 8192, target: int = 4096, body: int = 1 << 20,
                 idle_timeout: float = 15.0, head_timeout: float = 10.0,
                 send_timeout: float = 60.0, pipeline: int = 32,
                 connections: int = 10000, grace: float = 8.0) -> None:
        self.head = head                  # request head bytes before 431
        self.target = target              # request-target bytes before 414
        self.body = body                  # request body bytes read and discarded before 413
        self.idle_timeout = idle_timeout  # keep-alive connection with nothing to do
        self.head_timeout = head_timeout  # a started head (or body) that stalls: slowloris
        self.send_timeout = send_timeout  # a reader that takes nothing for this long
        self.pipeline = pipeline          # responses produced per round before waiting for the writes
        self.connections = connections    # open connections per worker; more get 503 and close
        self.grace = grace                # on stop, how long in-flight responses may take


_REASONS = {400: b"Bad Request", 403: b"Forbidden", 405: b"Method Not Allowed",
            406: b"Not Acceptable", 408: b"Request Timeout", 411: b"Length Required",
            413: b"Content Too Large", 414: b"URI Too Long",
            431: b"Request Header Fields Too Large", 501: b"Not Implemented",
            503: b"Service Unavailable", 505: b"HTTP Version Not Supported"}
# After these the request stream cannot be trusted (or the client is gone): close.
_FATAL = frozenset((400, 408, 411, 413, 414, 431, 503, 505))


def _error_response(status: int) -> tuple[bytes, bytes]:
    body = b"%d %s\n" % (status, _REASONS[status])
    head = b"HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\n" % (
        status, _REASONS[status], len(body))
    if status in (405, 501):
        head += b"Allow: GET, HEAD\r\n"
    if status == 503:
        head += b"Retry-After: 1\r\n"
    return head, body


_ERRORS = {status: _error_response(status) for status in _REASONS}
_END = re.compile(rb"\r?\n\r?\n")
_PLANS_MAX = 4096       # memoised request heads per worker
_PLAN_HEAD_MAX = 1024   # longer heads are planned every time (at most ~4 MiB memoised)


# Counters a worker keeps (see ``App.stats``), in the order they are published.
STATS = ("requests", "response_bytes", "connections", "open_connections")
ERROR_STATUSES = (400, 404, 405, 406, 408, 411, 413, 414, 416, 431, 501, 503, 505)
_ERROR_INDEX = {status: len(STATS) + i for i, status in enumerate(ERROR_STATUSES)}
STATS_SLOTS = len(STATS) + len(ERROR_STATUSES)


class App:
    """One worker's view of the site: shared by all its connections.

    Observability is injected, never performed here: ``publish(stats)`` is
    handed the counters once a second, and ``log(data)`` the access-log lines
    (common log format) gathered since the last call — both from ``tick``,
    which every loop body calls about once a second.
    """

    def __init__(self, site: Site, limits: Limits | None = None, publish=None, log=None) -> None:
        self.site = site
        self.routes = site.routes
        self.limits = limits or Limits()
        self.open = 0
        self.stats = [0] * STATS_SLOTS
        self.publish = publish
        self.log = log
        self.log_lines: list[bytes] | None = [] if log is not None else None
        # Plans memoised by the exact head bytes: clients repeat the same heads, and a
        # plan depends on nothing else. Bounded in entries and in head size.
        self.plans: dict[bytes, tuple] = {}
        self._second = -1
        self._tails = (b"", b"", b"")

    def tails(self, now: float) -> tuple[bytes, bytes, bytes]:
        """(keep-alive, close, HTTP/1.0 keep-alive) end-of-head lines with Date.

        Formatted once per second: the rest of every head is a build-time
        constant, so Date stays exact (RFC 9110 §6.6.1) at no per-request cost.
        """
        second = int(now)
        if second != self._second:
            date = b"Date: " + format_http_date(second) + b"\r\n"
            self._tails = (date + b"\r\n", date + b"Connection: close\r\n\r\n",
                           date + b"Connection: keep-alive\r\n\r\n")
            self._second = second
        return self._tails

    def tick(self, now: float) -> None:
        """Once a second: hand counters and access-log lines to whoever wants them."""
        self.stats[3] = self.open
        if self.publish is not None:
            self.publish(self.stats)
        if self.log_lines:
            data, self.log_lines[:] = b"".join(self.log_lines), []
            self.log(data)

    def plan(self, head: bytes) -> tuple:
        plan = answer(self.site, self.routes, self.limits, head)
        plan += (int(plan[0][9:12]),)  # the status, for counters and the access log
        if len(head) <= _PLAN_HEAD_MAX:
            if len(self.plans) >= _PLANS_MAX:
                self.plans.clear()
            self.plans[head] = plan
        return plan

    def connect(self, now: float, peer: str = "-") -> "Connection":
        conn = Connection(self, now, peer)
        self.stats[2] += 1
        if self.open > self.limits.connections:
            conn._error(503, now)
        return conn


class Connection:
    __slots__ = ("app", "buf", "out", "out_bytes", "since", "discard", "eof",
                 "close_after", "should_close", "_closed", "peer", "shut_write")

    def __init__(self, app: App, now: float, peer: str = "-") -> None:
        app.open += 1
        self.app = app
        self.peer = peer
        self.buf = b""
        self.out: list = []
        self.out_bytes = 0
        self.since = now          # start of the current wait, for timeouts
        self.discard = 0          # request body bytes still to skip
        self.eof = False
        self.close_after = False  # no more requests: close once ``out`` is written
        self.should_close = False
        self.shut_write = False   # lingering: our side is done, input is drained until EOF
        self._closed = False

    # -- the loop body's side of the contract ---------------------------------

    @property
    def outgoing(self) -> list:
        return self.out

    @property
    def wants_read(self) -> bool:
        return not self.out and (not self.close_after or self.shut_write) and not self.should_close

    def receive(self, data: bytes, now: float) -> None:
        if self.shut_write:  # lingering: input is discarded; the peer's EOF ends it
            if not data:
                self.should_close = True
            return
        if not data:
            self.eof = True
        elif self.buf:
            self.buf += data
        else:
            self.buf = data
        self._process(now)

    def sent(self, n: int, now: float) -> None:
        self.since = now
        if n >= self.out_bytes:
            self.out.clear()
            self.out_bytes = 0
        else:
            self.out_bytes -= n
            out = self.out
            while n:
                size = len(out[0])
                if n < size:
                    out[0] = memoryview(out[0])[n:]
                    break
                n -= size
                del out[0]
        if not self.out:
            if self.close_after:
                self._finish(now)
            elif self.buf or self.eof:  # requests held back by the pipeline limit
                self._process(now)

    def tick(self, now: float) -> None:
        limits = self.app.limits
        waited = now - self.since
        if self.shut_write:
            if waited > _LINGER:
                self.should_close = True
        elif self.out:
            if waited > limits.send_timeout:
                self.should_close = True
        elif self.buf or self.discard:
            if waited > limits.head_timeout and not self.close_after:
                self._error(408, now)
        elif waited > limits.idle_timeout:
            self.should_close = True

    def shutdown(self, now: float) -> None:
        """Graceful stop: finish what is being written, take no new requests."""
        self.close_after = True
        if not self.out:
            self.should_close = True

    def _finish(self, now: float) -> None:
        """Our last response is written. Close at once if the peer has finished too;
        otherwise linger: shut our sending side and drain input until the peer's EOF
        (at most ``_LINGER`` s), because closing with unread input sends a reset that
        can destroy the response before the client reads it (e.g. a 413 or 431)."""
        if self.eof:
            self.should_close = True
        else:
            self.shut_write = True
            self.since = now

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.app.open -= 1

    # -- framing ---------------------------------------------------------------

    def _error(self, status: int, now: float) -> None:
        self._emit(_error_plan(status, True) + (status,), self.app.tails(now), b"-", now)

    def _emit(self, plan: tuple, tails: tuple, request: bytes, now: float) -> None:
        head, kind, body, close, discard, status = plan
        stats = self.app.stats
        stats[0] += 1
        stats[1] += len(body)
        if status >= 400:
            stats[_ERROR_INDEX[status]] += 1
        if self.app.log_lines is not None:
            self.app.log_lines.append(_log_line(self.peer, now, request, status, len(body)))
        out = self.out
        tail = tails[kind]
        out.append(head)
        out.append(tail)
        self.out_bytes += len(head) + len(tail)
        if body:
            out.append(body)
            self.out_bytes += len(body)
        if close:
            self.close_after = True
            if close is _FATAL_CLOSE:
                self.buf = b""  # the rest of the stream cannot be framed: drop it
        self.discard = discard

    def _process(self, now: float) -> None:
        app = self.app
        limits = app.limits
        plans = app.plans
        tails = app.tails(now)
        answered = 0
        while not self.close_after and answered < limits.pipeline:
            buf = self.buf
            if self.discard:
                skip = min(self.discard, len(buf))
                self.discard -= skip
                self.buf = buf = buf[skip:]
                if self.discard:
                    break
            # RFC 9112 §2.2: ignore empty lines received before a request-line.
            if buf[:1] in (b"\r", b"\n"):
                self.buf = buf = buf.lstrip(b"\r\n")
            if not buf:
                break
            end = buf.find(b"\r\n\r\n", 0, limits.head + 4)
            head = buf[:end] if end >= 0 else buf[:limits.head + 4]
            if end < 0 or b"\n\n" in head or b"\n\r\n" in head:
                m = _END.search(buf, 0, limits.head + 4)
                if m is None:
                    if len(buf) > limits.head:
                        status = 414 if b"\n" not in buf[:limits.head] else 431
                        self._emit(_error_plan(status, True) + (status,), tails, buf[:200], now)
                    break
                end, rest = m.start(), m.end()
                head = buf[:end]
            else:
                rest = end + 4
            self.buf = buf[rest:]
            self.since = now
            answered += 1
            plan = plans.get(head)
            if plan is None:
                plan = app.plan(head)
            self._emit(plan, tails, head, now)
        if self.eof and not self.close_after and answered < limits.pipeline:
            self.close_after = True  # the peer sent all it will; what it asked for is queued
        if self.close_after and not self.out:
            self._finish(now)


_FATAL_CLOSE = 2  # ``close`` value in a plan: close and drop the unparsed rest
_LINGER = 2.0     # seconds a closing connection drains input waiting for the peer's EOF


def _error_plan(status: int, get: bool) -> tuple:
    head, body = _ERRORS[status]
    if status in _FATAL:
        return head, 1, body, _FATAL_CLOSE, 0
    return head, 0, body if get else b"", False, 0


_UNSAFE = re.compile(rb'[^\x20-\x7e]|["\\]')


def _log_line(peer: str, now: float, head: bytes, status: int, size: int) -> bytes:
    """One line of the common log format; the request line escaped, cut at 200 bytes."""
    line = head.split(b"\n", 1)[0].rstrip(b"\r")[:200]
    line = _UNSAFE.sub(lambda m: b"\\x%02x" % m.group()[0], line)
    d = format_http_date(int(now))  # b'Sun, 06 Nov 1994 08:49:37 GMT'
    stamp = b"%s/%s/%s:%s +0000" % (d[5:7], d[8:11], d[12:16], d[17:25])
    return b'%s - - [%s] "%s" %d %d\n' % (peer.encode(), stamp, line, status, size)


def _tokens(value: bytes | None) -> set[bytes]:
    return {t.strip().lower() for t in value.split(b",")} if value else set()


def answer(site: Site, routes: dict, limits: Limits, head: bytes) -> tuple:
    """The plan for one request head: (head bytes, tail kind, body, close, body bytes to skip).

    Tail kind indexes ``App.tails``: 0 keep-alive, 1 close, 2 HTTP/1.0 keep-alive.
    A plan depends on nothing but the head bytes and the build, so plans can be
    memoised; the Date line is the only per-second part and lives in the tail.
    """
    try:
        req = parse_head(head, limits.target)
    except HttpError as e:
        return _error_plan(e.status, True)
    fields = req.fields
    te = fields.get(b"transfer-encoding")
    cl = fields.get(b"content-length")
    discard = 0
    if te is not None:
        # RFC 9112 §6.1/§6.3: TE with CL is a smuggling attempt; a chunked body we
        # will not read (411 asks for a length); any other coding cannot be framed.
        if cl is not None or req.minor == 0:
            return _error_plan(400, True)
        return _error_plan(411 if te.rpartition(b",")[2].strip().lower() == b"chunked" else 400, True)
    if cl is not None:
        if not cl.isdigit() or len(cl) > 18:
            return _error_plan(400, True)
        discard = int(cl)
        if discard > limits.body:
            return _error_plan(413, True)

    conn = _tokens(fields.get(b"connection"))
    if req.minor >= 1:
        kind, close = (1, True) if b"close" in conn else (0, False)
    elif b"keep-alive" in conn:
        kind, close = 2, False
    else:
        kind, close = 1, True

    method = req.method
    if method not in SAFE_METHODS:
        h, b = _ERRORS[405 if method in KNOWN_METHODS else 501]
        return h, kind, b, close, discard
    get = method == b"GET"

    target = routes.get(req.path)
    if target is None:
        key = route_key(req.path)
        if key is None:
            return _error_plan(400, True)
        target = routes.get(key)
        if target is None:
            target = site.fallback or site.not_found
    if target.__class__ is Redirect:
        q = b"?" + req.query if req.query is not None else b""
        return target.location + q + target.tail, kind, b"", close, discard

    entry: Entry = target
    mask = accept_encoding_mask(fields.get(b"accept-encoding"))
    v = entry.choice[mask]
    if v is None:
        h, b = _ERRORS[406]
        return h + b"Vary: Accept-Encoding\r\n", kind, b if get else b"", close, discard
    if entry.conditional:
        inm = fields.get(b"if-none-match")
        if inm is not None:
            if none_match(inm, v.etag):
                return v.head_304, kind, b"", close, discard
        else:
            ims = fields.get(b"if-modified-since")
            if ims:
                t = parse_http_date(ims)
                if t is not None and entry.last_modified <= t:
                    return v.head_304, kind, b"", close, discard
        rng = fields.get(b"range") if get else None
        if rng and mask & IDENTITY and _if_range(fields.get(b"if-range"), entry):
            ident = entry.identity
            r = byte_range(rng, ident.length)
            if r is False:
                return entry.head_416, kind, b"", close, discard
            if r is not None:
                first, last = r
                return (b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes %d-%d/%d\r\n"
                        b"Content-Length: %d\r\n%s" % (first, last, ident.length, last - first + 1,
                                                          ident.fields),
                        kind, ident.body[first:last + 1], close, discard)
    return v.head, kind, v.body if get else b"", close, discard


def _if_range(value: bytes | None, entry: Entry) -> bool:
    """RFC 9110 §13.1.5: a strong ETag match or an exact Last-Modified match."""
    if value is None:
        return True
    if value[:1] == b'"':
        return value == entry.identity.etag
    return parse_http_date(value) == entry.last_modified
