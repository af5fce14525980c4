"""HTTP policy, written once: methods, statuses, limits, counters.

Strategy: this module is the specification every other place reads. The
Python core uses these tables directly; the CLI, the container's argument
parser and the unikernel's kernel command line derive their options from
``LIMITS``; the C core gets all of it from a header generated at build time
(``orisha/targets/unikernel/policy_header.py``). Nothing here may be typed a
second time anywhere else.
"""

from __future__ import annotations

import re
from typing import NamedTuple

# RFC 9110 §9.3: the methods a static site performs.
SAFE_METHODS = (b"GET", b"HEAD")
# Methods a static site knows but cannot perform: 405 with Allow (RFC 9110 §15.5.6);
# any other well-formed method is 501 (RFC 9110 §15.6.2).
KNOWN_METHODS = (b"POST", b"PUT", b"DELETE", b"PATCH", b"OPTIONS", b"CONNECT", b"TRACE")
CONNECT = KNOWN_METHODS[5]  # HTTP/2 frames it differently (RFC 9113 §8.5)
ALLOW = b"GET, HEAD"

# The SPA fallback (``--fallback``) answers navigations only. A request that says
# (Fetch Metadata, ``Sec-Fetch-Dest``) it is for anything else — a script, a style, an
# image, a ``fetch()`` (``empty``) — gets the not-found answer, never the HTML shell a
# browser would run as a script. The navigation destinations of the Fetch standard that
# load a document into a browsing context: a page, and the page of an iframe or frame
# (``embed``/``object`` load plugins' data). An absent, empty or repeated field is
# treated as a navigation: curl, old browsers.
NAVIGATION_DESTS = (b"document", b"iframe", b"frame")

# Reason phrases of every status the core itself produces (the rest come from the build).
REASONS = {200: b"OK", 206: b"Partial Content", 301: b"Moved Permanently",
           304: b"Not Modified", 308: b"Permanent Redirect", 400: b"Bad Request",
           401: b"Unauthorized", 403: b"Forbidden", 404: b"Not Found",
           405: b"Method Not Allowed", 406: b"Not Acceptable", 408: b"Request Timeout",
           411: b"Length Required", 413: b"Content Too Large", 414: b"URI Too Long",
           416: b"Range Not Satisfiable", 421: b"Misdirected Request", 425: b"Too Early",
           431: b"Request Header Fields Too Large",
           501: b"Not Implemented", 503: b"Service Unavailable",
           505: b"HTTP Version Not Supported"}
# The plain port beside a TLS port (``orisha serve --http-port`` with TLS on) answers every
# request with this redirect to https (RFC 9110 §15.4.9: the method and body are kept),
# except ACME HTTP-01 challenges (RFC 8555 §8.3), answered 200 under this prefix.
TO_HTTPS = 308
ACME_CHALLENGE_PREFIX = b"/.well-known/acme-challenge/"
# The statuses answered with a built-in plain-text error (``ERRORS`` in connection.py).
ERROR_PAGES = (400, 403, 405, 406, 408, 411, 413, 414, 425, 431, 501, 503, 505)
# RFC 8470 §5.2: a request that came as early data (HTTP/3's 0-RTT), which an attacker may
# replay, is answered only when its method is one of SAFE_METHODS; the rest get this, and the
# client sends them again once the handshake is done.
TOO_EARLY = 425
# RFC 9110 §15.5.20: a Host that names another site than the connection's TLS server name
# (several sites, orisha/core/hosts.py); the connection stays open for requests it can answer.
MISDIRECTED = 421
# After these the request stream cannot be trusted (or the client is gone): close.
FATAL = frozenset((400, 408, 411, 413, 414, 431, 503, 505))
# Basic authentication (``orisha build --basic-auth GLOB=HTPASSWD``, RFC 7617): without
# valid credentials a protected path is answered 401 with a challenge naming the realm
# (its GLOB) and UTF-8 (RFC 7617 §2.1: user-ids and passwords are UTF-8). Passwords are
# bcrypt hashes only (``htpasswd -B``). A verified Authorization value is remembered per
# worker, at most AUTH_REMEMBERED of them (least recently used forgotten), so bcrypt's
# cost is paid once per client, not per request. Responses behind auth carry
# ``Cache-Control: private`` (RFC 9111 §5.2.2.7: no shared cache may keep them) unless a
# rule sets Cache-Control.
# A worker runs bcrypt (~50-250 ms at the costs htpasswd -B uses) for at most AUTH_CHECKS
# Authorization values it has not judged yet per second (its loop's once-a-second tick);
# beyond that, until the next second, such a request gets AUTH_BUSY with Retry-After: 1
# (nginx's limit_req answers 503 too), not remembered: a flood of wrong passwords costs the
# worker at most that share of each second, and everything else it serves — other paths,
# credentials it has already verified — keeps being answered meanwhile.
AUTH_STATUS = 401
AUTH_REMEMBERED = 1024
AUTH_CHECKS = 4
AUTH_BUSY = 503
AUTH_HASHES = ("$2a$", "$2b$", "$2y$")  # bcrypt's prefixes, as htpasswd -B writes $2y$
AUTH_CACHE_CONTROL = "private"


def unauthorized(realm: str) -> tuple[bytes, bytes]:
    """(head without Date, body) of the 401 for a realm (RFC 7235 §3.1, RFC 7617 §2)."""
    quoted = realm.replace("\\", "\\\\").replace('"', '\\"')  # a quoted-string
    body = b"401 Unauthorized\n"
    head = (b"HTTP/1.1 401 Unauthorized\r\nContent-Type: text/plain; charset=utf-8\r\n"
            b"Content-Length: %d\r\nWWW-Authenticate: Basic realm=\"%s\", charset=\"UTF-8\"\r\n"
            b"Cache-Control: no-store\r\n" % (len(body), quoted.encode("utf-8")))
    return head, body


# Seconds a connection whose last response is written keeps draining input before it
# closes (unless the peer's EOF comes first): closing with unread input sends a reset
# that can destroy the response before the client has read it (RFC 9112 §9.6).
LINGER = 2.0

# Counters a worker keeps, in the order they are published (shared memory, Prometheus).
# ``open_connections`` is a gauge; the rest count up. Then one counter per error status.
STATS = ("requests", "response_bytes", "connections", "open_connections")
ERROR_STATUSES = (400, 401, 404, 405, 406, 408, 411, 413, 414, 416, 421, 425, 431, 501, 503,
                  505)
STATS_SLOTS = len(STATS) + len(ERROR_STATUSES)


class Stat:
    """Named slots of a worker's counter list (``App.stats``)."""
    REQUESTS, RESPONSE_BYTES, CONNECTIONS, OPEN_CONNECTIONS = range(len(STATS))
    ERROR = {status: len(STATS) + i for i, status in enumerate(ERROR_STATUSES)}


class Range(NamedTuple):
    """The values a numeric option accepts, both ends included.

    ``parse`` reads a command-line value by the one grammar every front end uses (click,
    the container's argparse): optional ``-``, decimal digits, and for a float a fraction —
    not Python's ``int``/``float`` quirks (``1_000``, ``nan``, ``inf``, ``0x10``).
    """
    low: int | float
    high: int | float
    kind: type = int

    def text(self) -> str:
        return f"{self.low}–{self.high}"

    def parse(self, text: str, name: str) -> int | float:
        """The value of ``text``, or ValueError with one line naming ``name`` and the range."""
        grammar = r"-?[0-9]+" if self.kind is int else r"-?[0-9]+(?:\.[0-9]+)?"
        if not re.fullmatch(grammar, text.strip()):
            what = "an integer" if self.kind is int else "a number"
            raise ValueError(f"{name} {text!r}: not {what} (expected {self.text()})")
        value = self.kind(text.strip())
        if not self.low <= value <= self.high:
            raise ValueError(f"{name} {text.strip()}: out of range (expected {self.text()})")
        return value


# The numeric options that are not per-worker limits, by name (the CLI's, the container's).
PORT = Range(0, 65535)  # 0: the kernel picks a free port (tests, `orisha boot --port 0`)
RANGES = {
    "port": PORT,
    "http-port": PORT,
    "admin-port": PORT,
    "workers": Range(1, 1024),
    "hsts": Range(0, 1 << 31),  # max-age in seconds; 0 tells browsers to forget (RFC 6797 §6.1.1)
    "memory": Range(4, 1 << 20),  # MiB of guest RAM (the kernel and its arena need a few)
    # `orisha boot --cpus`: the image's vCPUs. The kernel keeps a stack and a state slot per
    # core in tables of this size (POLICY_CPUS_MAX in its generated policy.h).
    "cpus": Range(1, 16),
    "timeout": Range(0.001, 3600.0, float),  # `orisha health` seconds
    # `orisha build --dictionaries K`: the earlier builds a dcz delta may start from (RFC
    # 9842); the upper end bounds the history a build folder carries and the deltas per file.
    "dictionaries": Range(1, 16),
}
DICTIONARIES_KEPT = 3  # K's default


class Limit(NamedTuple):
    """One configurable limit: its ``Limits`` attribute, default, CLI flag, meaning, range.

    ``kernel``: whether the unikernel takes it (on its command line as
    ``orisha.<attr>=<value>``); pipelining and the stop grace have no meaning there.
    """
    attr: str
    default: int | float
    flag: str
    help: str
    range: Range
    kernel: bool = True


_SECONDS = Range(0.001, 86400.0, float)  # a timer below 1 ms, or above a day, is a typo
LIMITS = (
    Limit("connections", 10000, "max-connections", "Open connections per worker; more get 503.",
          Range(1, 1 << 20)),
    # A head below 64 bytes cannot hold a request line and a Host field.
    Limit("head", 8192, "head-limit", "Request head bytes (431 above).", Range(64, 1 << 20)),
    Limit("target", 4096, "target-limit", "Request-target bytes (414 above).", Range(1, 1 << 20)),
    Limit("body", 1 << 20, "body-limit", "Request body bytes read and discarded (413 above).",
          Range(0, 1 << 40)),
    Limit("idle_timeout", 15.0, "idle-timeout", "Seconds an idle keep-alive connection stays open.",
          _SECONDS),
    Limit("head_timeout", 10.0, "head-timeout", "Seconds to receive a started request head.",
          _SECONDS),
    Limit("send_timeout", 60.0, "send-timeout", "Seconds a client may take nothing before it is dropped.",
          _SECONDS),
    Limit("pipeline", 32, "pipeline", "Pipelined requests answered per round.", Range(1, 1024),
          kernel=False),
    Limit("grace", 8.0, "grace", "Seconds in-flight responses may take after a stop.",
          Range(0.0, 86400.0, float), kernel=False),
)


class Limits:
    """Per-worker limits (defaults and meanings in ``LIMITS``)."""

    __slots__ = tuple(limit.attr for limit in LIMITS)

    def __init__(self, **values) -> None:
        for limit in LIMITS:
            setattr(self, limit.attr, values.pop(limit.attr, limit.default))
        if values:
            raise TypeError(f"unknown limits: {', '.join(sorted(values))}")

    def changed(self) -> list[tuple[Limit, int | float]]:
        """The limits that differ from their defaults, with their values."""
        return [(limit, getattr(self, limit.attr)) for limit in LIMITS
                if getattr(self, limit.attr) != limit.default]
