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
from typing import NamedTuple

try:  # the compiled module's C helpers (connection.pxd); the pure module never calls them
    import cython
    _COMPILED = cython.compiled
except ImportError:  # no Cython installed: the pure module
    _COMPILED = False

from .dates import format_http_date, parse_http_date
from .negotiate import accept_encoding_mask, accepts_dcz, byte_range, none_match, route_key
from .outgoing import consume
from .policy import (ALLOW, AUTH_BUSY, AUTH_STATUS, ERROR_PAGES, KNOWN_METHODS, LINGER, MISDIRECTED,
                     NAVIGATION_DESTS, REASONS, SAFE_METHODS, STATS_SLOTS, Limits, Stat)
from .hosts import Hosts
from .request import HttpError, cannot_begin, parse_head
from .matcher import match as match_rules
from .ranges import multipart, range_set
from .site import IDENTITY, Entry, Guarded, Redirect, Rules, Site, refill_checks


class Tail:
    """Which end-of-head lines follow a planned head (indexes ``App.tails``)."""
    KEEP_ALIVE, CLOSE, KEEP_ALIVE_10 = 0, 1, 2


class Close:
    """What a plan does to the connection after its response."""
    NO, AFTER, FATAL = 0, 1, 2  # keep it; close once written; close and drop the unparsed rest


class Plan(NamedTuple):
    """Everything one request head decides, memoised by the exact head bytes.

    ``head``: the status line and fields up to (not including) the Date line;
    ``tail``: a ``Tail`` value; ``body``: bytes or a memoryview of the blob;
    ``close``: a ``Close`` value; ``discard``: request body bytes to skip;
    ``status``: for counters and the access log; ``counts``: the counter list the
    request is counted on (with several sites, the answering site's, which ``App.plan``
    puts in the plans it makes; None: the connection's own site, ``App.counts``).
    """
    head: bytes
    tail: int
    body: bytes
    close: int
    discard: int
    status: int
    counts: list | None = None


def _error_response(status: int) -> tuple[bytes, bytes]:
    reason = REASONS[status]
    body = b"%d %s\n" % (status, reason)
    head = b"HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\n" % (
        status, reason, len(body))
    if status in (405, 501):
        head += b"Allow: " + ALLOW + b"\r\n"
    if status == 503:
        head += b"Retry-After: 1\r\n"
    if status == 406:  # only ever sent by negotiation: the answer varies with Accept-Encoding
        head += b"Vary: Accept-Encoding\r\n"
    return head, body


# The built-in error responses: status → (head without Date, body). The C core's
# image carries these same bytes (orisha/targets/unikernel/layout.py).
ERRORS = {status: _error_response(status) for status in ERROR_PAGES}
# Only a server of several sites answers it (not a page of the booted image's table).
_MISDIRECTED = _error_response(MISDIRECTED)
_END = re.compile(rb"\r?\n\r?\n")
# The hot path's constants as module globals (cheaper to load than class attributes).
_REQUESTS, _RESPONSE_BYTES, _ERROR_SLOT = Stat.REQUESTS, Stat.RESPONSE_BYTES, Stat.ERROR
_FATAL_CLOSE = Close.FATAL
_PLANS_MAX = 4096       # memoised request heads per worker
_PLAN_HEAD_MAX = 1024   # longer heads are planned every time (at most ~4 MiB memoised)


class App:
    """One worker's view of the site: shared by all its connections.

    Observability is injected, never performed here: ``publish(stats)`` is
    handed the counters once a second, and ``log(data)`` the access-log lines
    (common log format) gathered since the last call — both from ``tick``,
    which every loop body calls about once a second.
    """

    def __init__(self, site: Site, limits: Limits | None = None, publish=None, log=None,
                 protocols=None, hosts=None, alt_svc: bytes = b"") -> None:
        if site.__class__ is Hosts:  # several sites: the first answers unknown hosts
            site, hosts = site.sites[0], site
        self.site = site
        # ``hosts``: several sites (orisha/core/hosts.py), consulted once per new head in
        # ``plan``; None for one site, which then does no host lookup at all.
        self.hosts = hosts
        self.views: dict = {}  # SNI-chosen site index → its App (``view``)
        # ``alt_svc``: an "Alt-Svc: …" line for every response (HTTP/3 advertised on the TLS
        # port), spliced beside Date: the port is known at serve time, not at build time.
        self.alt_svc = alt_svc
        # ``protocols``: what a connection speaks besides plain HTTP/1.1 — TLS, HTTP/2
        # (orisha/protocols/, chosen once at start-up); it makes each new connection.
        self.protocols = protocols
        self.routes = site.routes
        self.limits = limits or Limits()
        # what every request reads of the limits (C integers where compiled: connection.pxd):
        # the pipeline bound and how far to look for a head's end (the head limit + CRLFCRLF)
        self.pipeline, self.head_scan = self.limits.pipeline, self.limits.head + 4
        self.open = 0
        self.stats = [0] * STATS_SLOTS
        # Several sites: each one's request counters (``Stat`` slots; its connections are the
        # worker's, in ``stats``), published after ``stats``. A kept plan carries its site's
        # list, so counting a request looks nothing up. ``counts``: where a request that no
        # site's table chose is counted (a head refused before its Host is read, a 421):
        # the connection's own site, the default one's or the SNI's (nginx's default server).
        self.site_stats = [[0] * STATS_SLOTS for _ in hosts.sites] if hosts is not None else []
        self.counts = self.site_stats[hosts.default] if hosts is not None else self.stats
        self.publish = publish
        self.log = log
        self.log_lines: list[bytes] | None = [] if log is not None else None
        # Plans memoised by the exact head bytes: clients repeat the same heads, and a
        # plan depends on nothing else. Bounded in entries and in head size.
        self.plans: dict[bytes, tuple] = {}  # Plan fields, as plain tuples
        self._second = -1
        self._tails = (b"", b"", b"")
        # A graceful stop began (``Connection.shutdown``): from now on the response to the
        # last request a connection has read is its last and says ``Connection: close``.
        self.stopping = False

    def tails(self, now: float) -> tuple[bytes, bytes, bytes]:
        """(keep-alive, close, HTTP/1.0 keep-alive) end-of-head lines with Date.

        Formatted once per second: the rest of every head is a build-time
        constant, so Date stays exact (RFC 9110 §6.6.1) at no per-request cost.
        """
        second = int(now)
        if second != self._second:
            date = b"Date: " + format_http_date(second) + b"\r\n" + self.alt_svc
            self._tails = (date + b"\r\n", date + b"Connection: close\r\n\r\n",
                           date + b"Connection: keep-alive\r\n\r\n")
            self._second = second
        return self._tails

    def tick(self, now: float) -> None:
        """Once a second: hand counters and access-log lines to whoever wants them; the
        worker's bcrypt checks for --basic-auth are this second's again (``Auth.allows``)."""
        refill_checks()
        self.stats[Stat.OPEN_CONNECTIONS] = self.open
        if self.publish is not None:
            self.publish(self.stats if not self.site_stats else
                         self.stats + [n for counts in self.site_stats for n in counts])
        if self.log_lines:
            data, self.log_lines[:] = b"".join(self.log_lines), []
            self.log(data)

    def plan(self, head: bytes) -> tuple:
        # Kept as a plain tuple: CPython specialises unpacking for exact tuples only, and
        # ``_emit`` unpacks a plan per request (measured: a NamedTuple costs ~0.2 µs more).
        plan, i = answer_of(self.site, self.routes, self.limits, head, self.hosts)
        plan = (*plan[:6], self.counts if i is None else self.site_stats[i])
        # A multipart 206 carries a body assembled for it (not a slice of the blob): not kept;
        # nor a 503 for want of a bcrypt check this second (``_unauthorized``).
        if len(head) <= _PLAN_HEAD_MAX and not (plan[5] == 206 and plan[2].__class__ is bytes
                                                or plan[5] == AUTH_BUSY):
            if len(self.plans) >= _PLANS_MAX:
                self.plans.clear()
            self.plans[head] = plan
        return plan

    def view(self, server_name) -> "App":
        """The App a TLS connection whose SNI is ``server_name`` answers from: with several
        sites and a name one of them holds, an App whose host table answers 421 for the
        others (``Hosts.sole``), with its own plans and the same counters and log; else
        this one. The caller hands the connection back (``app = ``) before its close."""
        if self.hosts is None:
            return self
        i = self.hosts.index(server_name)
        if i is None:
            return self
        v = self.views.get(i)
        if v is None:
            v = self.views[i] = App(self.hosts.sites[i], self.limits, protocols=self.protocols,
                                    hosts=self.hosts.sole(i), alt_svc=self.alt_svc)
            v.stats, v.log_lines, v.site_stats = self.stats, self.log_lines, self.site_stats
            v.counts = self.site_stats[i]
        return v

    def connect(self, now: float, peer: str = "-") -> "Connection":
        self.stats[Stat.CONNECTIONS] += 1
        refuse = self.open >= self.limits.connections  # this one would be over the limit: 503
        if self.protocols is not None:  # it answers the 503 in the connection's protocol
            return self.protocols.connect(self, now, peer, refuse)
        conn = Connection(self, now, peer)
        if refuse:
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
        return Connection.reading(self)

    def reading(self) -> bool:
        """``wants_read`` as a method: compiled, the loop bodies and the TLS layer call it
        at C level (``orisha/loops/seam.pxd``), without a property lookup."""
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
        if n >= self.out_bytes:  # the common case, inline: everything was written
            if _COMPILED:
                c_clear(self.out)  # list.clear in C, not a method call by name
            else:
                self.out.clear()
            self.out_bytes = 0
        else:
            self.out_bytes = consume(self.out, self.out_bytes, n)
        if not self.out:
            if self.close_after:
                self._finish(now)
            elif self.buf or self.eof:  # requests held back by the pipeline limit
                self._process(now)

    def tick(self, now: float) -> None:
        limits = self.app.limits
        waited = now - self.since
        if self.shut_write:
            if waited > LINGER:
                self.should_close = True
        elif self.out:
            if waited > limits.send_timeout:
                self.should_close = True
        elif self.buf or self.discard:
            if waited > limits.head_timeout and not self.close_after:
                self._error(408, now)
        elif waited > (LINGER if self.app.stopping else limits.idle_timeout):
            # Idle after a stop (its response in flight at the stop written, no request since):
            # as long as a lingering close, then closed with nothing unread (no reset).
            self.should_close = True

    def shutdown(self, now: float) -> None:
        """Graceful stop: a connection idle for ``LINGER`` closes now. Any other finishes
        the response it is writing, and a request it reads next (or is reading) is answered,
        with ``Connection: close`` (``App.stopping``), before it closes; with none within
        ``LINGER`` of its last response, it closes (``tick``). Closing at once after the
        response in flight dropped the next request unanswered (read and drained while
        lingering) though no response had said the connection would close; and a response
        just handed to the kernel, not yet read by its client, was cut by the reset that
        client's next request met at a closed socket."""
        self.app.stopping = True
        if not self.out and not self.buf and not self.discard and now - self.since > LINGER:
            self.should_close = True

    def _finish(self, now: float) -> None:
        """Our last response is written. Close at once if the peer has finished too;
        otherwise linger: shut our sending side and drain input until the peer's EOF
        (at most ``policy.LINGER`` s), because closing with unread input sends a reset that
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
        self._emit(_error_plan(status), self.app.tails(now), b"-", now)

    def _emit(self, plan: tuple, tails: tuple, request: bytes, now: float) -> None:
        head, tail, body, close, discard, status, stats = plan
        if stats is None:  # a plan App.plan did not make (an error before a head is read)
            stats = self.app.counts
        # A graceful stop: the response to the last request read is the connection's last and
        # says so. Requests already read behind it (pipelined) are answered first, each in
        # turn: closing after this one would leave them unanswered though read.
        if self.app.stopping and not close and not self.buf:
            tail, close = Tail.CLOSE, Close.AFTER
        stats[_REQUESTS] += 1
        stats[_RESPONSE_BYTES] += len(body)
        if status >= 400:
            stats[_ERROR_SLOT[status]] += 1
        if self.app.log_lines is not None:
            app = self.app
            app.log_lines.append(_log_line(self.peer, now, request, status, len(body),
                                           b"" if app.hosts is None else app.hosts.label(request)))
        out = self.out
        tail = tails[tail]
        out.append(head)
        out.append(tail)
        self.out_bytes += len(head) + len(tail)
        if body:
            out.append(body)
            self.out_bytes += len(body)
        if close:
            self.close_after = True
            if close == _FATAL_CLOSE:
                self.buf = b""  # the rest of the stream cannot be framed: drop it
        self.discard = discard

    def _process(self, now: float) -> None:
        app = self.app
        plans = app.plans
        tails = app.tails(now)
        pipeline, head_max = app.pipeline, app.head_scan
        answered = 0
        while not self.close_after and answered < pipeline:
            buf = self.buf
            if self.discard:
                skip = min(self.discard, len(buf))
                self.discard -= skip
                self.buf = buf = buf[skip:]
                if self.discard:
                    break
            # RFC 9112 §2.2: ignore empty lines received before a request-line.
            if buf and (buf[0] == 13 or buf[0] == 10):  # CR, LF
                self.buf = buf = buf.lstrip(b"\r\n")
            if not buf:
                break
            # compiled: memchr (connection.pxd), not bytes.find's method call and argument parsing
            end = _c_find_end(buf, head_max) if _COMPILED else buf.find(b"\r\n\r\n", 0, head_max)
            plan = None
            if end >= 0:
                head = _c_slice(buf, 0, end) if _COMPILED else buf[:end]
                plan = plans.get(head)
                # A bare-LF end of head before the first CRLFCRLF (RFC 9112 §2.2) is looked
                # for only when the head is new: a memoised head never contains one (it was
                # cut at it). ``find``, not ``in``: bytes.__contains__ first tries its operand
                # as an int and raises and clears a formatted TypeError each time.
                if plan is None and (head.find(b"\n\n") >= 0 or head.find(b"\n\r\n") >= 0):
                    end = -1
            if end < 0:
                m = _END.search(buf, 0, head_max)
                if m is None:
                    if cannot_begin(buf, head_max):  # e.g. a TLS ClientHello: no wait
                        self._emit(_error_plan(400), tails, buf[:200], now)
                    elif len(buf) > app.limits.head:
                        status = 414 if b"\n" not in buf[:app.limits.head] else 431
                        self._emit(_error_plan(status), tails, buf[:200], now)
                    break
                end, rest = m.start(), m.end()
                head = buf[:end]
                plan = plans.get(head)
            else:
                rest = end + 4
            if _COMPILED:  # the whole buffer read, the common case: no copy
                self.buf = b"" if rest == len(buf) else _c_slice(buf, rest, len(buf))
            else:
                self.buf = buf[rest:]
            self.since = now
            answered += 1
            if plan is None:
                plan = app.plan(head)
            self._emit(plan, tails, head, now)
        if self.eof and not self.close_after and answered < pipeline:
            self.close_after = True  # the peer sent all it will; what it asked for is queued
        if self.close_after and not self.out:
            self._finish(now)


def _error_plan(status: int) -> Plan:
    """A built-in error after which the stream cannot be framed (every status in FATAL)."""
    head, body = ERRORS[status]
    return Plan(head, Tail.CLOSE, body, Close.FATAL, 0, status)


_UNSAFE = re.compile(rb'[^\x20-\x7e]|["\\]')


def _log_line(peer: str, now: float, head: bytes, status: int, size: int,
              site: bytes = b"") -> bytes:
    """One line of the common log format; the request line escaped, cut at 200 bytes.
    ``site``: with several sites, the one that answered comes first (as nginx's
    ``vhost_combined`` puts the host first); ``-`` for a misdirected request."""
    line = head.split(b"\n", 1)[0].rstrip(b"\r")[:200]
    line = _UNSAFE.sub(lambda m: b"\\x%02x" % m.group()[0], line)
    d = format_http_date(int(now))  # b'Sun, 06 Nov 1994 08:49:37 GMT'
    stamp = b"%s/%s/%s:%s +0000" % (d[5:7], d[8:11], d[12:16], d[17:25])
    return b'%s%s - - [%s] "%s" %d %d\n' % (site and site + b" ", peer.encode(), stamp, line,
                                            status, size)


log_line = _log_line  # public for the other protocol layers (orisha/protocols/h2.py)


def _tokens(value: bytes | None) -> set[bytes]:
    return {t.strip().lower() for t in value.split(b",")} if value else set()


def answer(site: Site, routes: dict, limits: Limits, head: bytes, hosts=None) -> Plan:
    """The plan for one request head.

    A plan depends on nothing but the head bytes and the build, so plans can be
    memoised; the Date line is the only per-second part and lives in the tail.
    ``hosts``: several sites; the Host field chooses one (orisha/core/hosts.py).
    """
    return answer_of(site, routes, limits, head, hosts)[0]


def answer_of(site: Site, routes: dict, limits: Limits, head: bytes, hosts=None):
    """(``answer``'s plan, the index in ``hosts`` of the site that answered it), the index
    None where no site did: one site, a head the framing refused, a misdirected request."""
    try:
        req = parse_head(head, limits.target)
    except HttpError as e:
        return _error_plan(e.status), None
    framing = _framing(req, limits)
    if framing.__class__ is Plan:
        return framing, None
    tail, close, discard = framing
    if hosts is None:
        return _route(site, routes, req, tail, close, discard), None
    i = hosts.choice(req.fields.get(b"host"))
    if i < 0:  # another site's name on this connection's TLS server name
        h, b = _MISDIRECTED
        return Plan(h, tail, b if req.method != b"HEAD" else b"", close, discard,
                    MISDIRECTED), None
    site = hosts.sites[i]
    return _route(site, site.routes, req, tail, close, discard), i


def _route(site: Site, routes: dict, req, tail: int, close: int, discard: int) -> Plan:
    """The plan of a framed request to ``site``: its routes, rules, negotiation."""
    fields = req.fields
    method = req.method
    if method not in SAFE_METHODS:
        h, b = ERRORS[405 if method in KNOWN_METHODS else 501]
        return Plan(h, tail, b, close, discard, 405 if method in KNOWN_METHODS else 501)
    get = method == b"GET"

    key = req.path
    target = routes.get(key)
    if target is None:
        key = route_key(key)
        if key is None:
            return _error_plan(400)
        target = routes.get(key)
        if target is None:
            if site.auth:  # a --basic-auth area guards its unknown paths too
                area = next((a for pattern, a in site.auth if pattern.fullmatch(key)), None)
                if area is not None:
                    ok = area.allows(fields.get(b"authorization"))
                    if not ok:
                        return _unauthorized(area, ok, get, tail, close, discard)
            # _redirects rules with splats or placeholders: only where no route answers.
            target = ((site.rules and match_rules(site.rules, key, req.query, site))
                      or unknown(site, key, fields))
    if target.__class__ is not Entry:
        target = _indirect(target, site, key, req, get, tail, close, discard)
        if target.__class__ is Plan:
            return target

    entry: Entry = target
    mask = accept_encoding_mask(fields.get(b"accept-encoding"))
    v = entry.choice[mask]
    if v is None:
        h, b = ERRORS[406]
        return Plan(h, tail, b if get else b"", close, discard, 406)
    if entry.deltas:
        v = _delta(entry, v, fields)
    if entry.conditional:
        plan = _conditional(entry, v, fields, get and mask & IDENTITY, tail, close, discard,
                            site.boundary)
        if plan is not None:
            return plan
    return Plan(v.head, tail, v.body if get else b"", close, discard, entry.status)


def _delta(entry: Entry, v, fields: dict):
    """A dcz delta (RFC 9842) instead of ``v`` when the client holds one of the dictionaries
    this document has a delta from (the Available-Dictionary value, byte for byte: anything
    malformed or unknown is no key) and says it decodes dcz. A Dictionary-ID names a
    dictionary by an id this server never sends (§2.3): not one of ours."""
    d = entry.deltas.get(fields.get(b"available-dictionary"))
    if d is None or b"dictionary-id" in fields or not accepts_dcz(fields.get(b"accept-encoding")):
        return v
    return d


def _indirect(target, site: Site, key: bytes, req, get: bool, tail: int, close: int,
              discard: int):
    """The Entry behind a route that is not one (Basic auth, query rules), or the Plan
    that answers instead (a 401, a redirect)."""
    fields = req.fields
    if target.__class__ is Guarded:  # behind --basic-auth: credentials first
        ok = target.auth.allows(fields.get(b"authorization"))
        if not ok:
            return _unauthorized(target.auth, ok, get, tail, close, discard)
        target = target.target
    if target.__class__ is Rules:  # a route whose rules have query conditions
        target = (match_rules(target.rules, key, req.query, site) or target.default
                  or unknown(site, key, fields))
    if target.__class__ is Redirect:
        q = b"?" + req.query if req.query is not None and target.query else b""
        return Plan(target.location + q + target.tail, tail, b"", close, discard,
                    target.status)
    return target


def _unauthorized(auth, ok, get: bool, tail: int, close: int, discard: int) -> Plan:
    """The 401 challenge of a --basic-auth area (RFC 7617); ``ok`` None: no bcrypt check
    is left this second (``Auth.allows``), the 503 with Retry-After instead."""
    if ok is None:
        return _error_plan(AUTH_BUSY)
    return Plan(auth.head_401, tail, auth.body_401 if get else b"", close, discard, AUTH_STATUS)


def unknown(site: Site, key: bytes, fields: dict) -> Entry:
    """The document for a path nothing routes (``key``: decoded): the fallback (SPA mode)
    for a navigation, else the not-found one. Not a navigation: a ``Sec-Fetch-Dest`` that
    names another destination (policy.NAVIGATION_DESTS), or a last segment whose
    extension is one of the build's non-HTML types (``Site.assets``) — a missing
    ``/js/app.3f2a1b9c.js`` gets a 404, not HTML with 200 that a browser would run as a
    script. Only route-table misses come here: other requests pay nothing for it."""
    fallback = site.fallback
    if fallback is None:
        return site.not_found
    assets = site.assets
    if assets is None:  # --fallback-all (or a build made before): every unknown path
        return fallback
    dest = fields.get(b"sec-fetch-dest")
    if dest and dest not in NAVIGATION_DESTS:
        return site.not_found
    name = key.rpartition(b"/")[2]
    dot = name.rfind(b".")
    if dot >= 0 and name[dot + 1:].lower() in assets:
        return site.not_found
    return fallback


def _framing(req, limits: Limits):
    """(tail, close, body bytes to skip) for a parsed request, or the error Plan."""
    fields = req.fields
    te = fields.get(b"transfer-encoding")
    cl = fields.get(b"content-length")
    discard = 0
    if te is not None:
        # RFC 9112 §6.1/§6.3: TE with CL is a smuggling attempt; a chunked body we
        # will not read (411 asks for a length); any other coding cannot be framed.
        if cl is not None or req.minor == 0:
            return _error_plan(400)
        return _error_plan(411 if te.rpartition(b",")[2].strip().lower() == b"chunked" else 400)
    if cl is not None:
        # RFC 9110 §8.6: Content-Length = 1*DIGIT (ASCII digits only).
        if not cl.isdigit() or len(cl) > 18:
            return _error_plan(400)
        discard = int(cl)
        if discard > limits.body:
            return _error_plan(413)
    conn = _tokens(fields.get(b"connection"))
    if req.minor >= 1:
        if b"close" in conn:
            return Tail.CLOSE, Close.AFTER, discard
        return Tail.KEEP_ALIVE, Close.NO, discard
    if b"keep-alive" in conn:
        return Tail.KEEP_ALIVE_10, Close.NO, discard
    return Tail.CLOSE, Close.AFTER, discard


def _conditional(entry: Entry, v, fields: dict, ranged: int, tail: int, close: int,
                 discard: int, boundary: bytes = b"") -> Plan | None:
    """304, 206 or 416 for a document that takes preconditions and ranges; None for its 200.

    Ranges are served from the identity variant only (``ranged``: a GET that accepts it).
    """
    inm = fields.get(b"if-none-match")
    if inm is not None:
        if none_match(inm, v.etag):
            return Plan(v.head_304, tail, b"", close, discard, 304)
    else:
        ims = fields.get(b"if-modified-since")
        if ims:
            t = parse_http_date(ims)
            if t is not None and entry.last_modified <= t:
                return Plan(v.head_304, tail, b"", close, discard, 304)
    rng = fields.get(b"range") if ranged else None
    if not rng or not _if_range(fields.get(b"if-range"), entry):
        return None
    ident = entry.identity
    if b"," in rng:
        return _ranges(entry, rng, tail, close, discard, boundary)
    r = byte_range(rng, ident.length)
    if r is False:
        return Plan(entry.head_416, tail, b"", close, discard, 416)
    if r is None:
        return None
    first, last = r
    head = (b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes %d-%d/%d\r\n"
            b"Content-Length: %d\r\n%s" % (first, last, ident.length, last - first + 1, ident.fields))
    return Plan(head, tail, ident.body[first:last + 1], close, discard, 206)


def _ranges(entry: Entry, rng: bytes, tail: int, close: int, discard: int,
            boundary: bytes) -> Plan | None:
    """Several ranges (RFC 9110 §14.6): a multipart/byteranges 206, a single-part 206 when
    they merge into one, a 416 when none is satisfiable, None (the 200) when ignored."""
    ident = entry.identity
    length = ident.length
    r = range_set(rng, length)
    if r is False:
        return Plan(entry.head_416, tail, b"", close, discard, 416)
    if r is None:
        return None
    if len(r) == 1:
        first, last = r[0]
        head = (b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes %d-%d/%d\r\n"
                b"Content-Length: %d\r\n%s" % (first, last, length, last - first + 1, ident.fields))
        return Plan(head, tail, ident.body[first:last + 1], close, discard, 206)
    body = multipart(ident.body, r, length, boundary, entry.part_type)
    head = (b"HTTP/1.1 206 Partial Content\r\nContent-Type: multipart/byteranges; boundary=%s\r\n"
            b"Content-Length: %d\r\n%s" % (boundary, len(body), entry.multi_fields))
    return Plan(head, tail, body, close, discard, 206)


def _if_range(value: bytes | None, entry: Entry) -> bool:
    """RFC 9110 §13.1.5: a strong ETag match or an exact Last-Modified match."""
    if value is None:
        return True
    if value[:1] == b'"':
        return value == entry.identity.etag
    return parse_http_date(value) == entry.last_modified
# Public for the plain port beside a TLS port (orisha/core/upgrade.py), which frames its
# requests the same way and answers the same errors.
framing = _framing
error_plan = _error_plan
