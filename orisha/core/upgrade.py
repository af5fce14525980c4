"""The plain port beside a TLS port: every request is redirected to https.

Strategy: with TLS on and ``--http-port`` given, the plain port serves no page.
Each request gets ``policy.TO_HTTPS`` (308) to the same host, path and query on
https, the TLS port in the URL when it is not 443; the only exception is an ACME
HTTP-01 challenge (RFC 8555 §8.3) whose token the supervisor handed this
generation (``tokens``: token → key authorization, run-time data fixed for a
worker's life: new tokens come with a new generation, so the plans stay
memoisable). The framing, limits and errors are the request core's
(``connection.framing``, ``error_plan``); ``Upgrade`` is an ``App`` whose plans
come from here instead of the route table, so every loop body serves it as is.

HSTS (``hsts``) is the other half, done once at load time: the field is added to
every head a build holds (and its HTTP/2 block re-encoded), never formatted per
request.
"""

from __future__ import annotations

import re

from .connection import App, Plan, error_plan, framing
from .policy import ACME_CHALLENGE_PREFIX, REASONS, TO_HTTPS
from .request import HttpError, parse_head
from .site import Entry, Guarded, Redirect, Rules

# A Host field we put in a Location: a reg-name or IPv4 (RFC 3986 §3.2.2, letters, digits,
# dots, hyphens) or a bracketed IPv6 literal, then an optional port, which is replaced.
_HOST = re.compile(rb"([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::\d*)?")
_TOKEN = re.compile(rb"[A-Za-z0-9_-]+")  # base64url (RFC 8555 §8.3)
_PLANS_MAX = 4096
_PLAN_HEAD_MAX = 1024


def to_https(head: bytes, limits, https_port: int, tokens: dict[bytes, bytes]) -> Plan:
    """The plan for one request head on the plain port (see the Strategy)."""
    try:
        req = parse_head(head, limits.target)
    except HttpError as e:
        return error_plan(e.status)
    framed = framing(req, limits)
    if framed.__class__ is Plan:
        return framed
    tail, close, discard = framed
    path = req.path
    if path.startswith(ACME_CHALLENGE_PREFIX):
        token = path[len(ACME_CHALLENGE_PREFIX):]
        answer = tokens.get(token) if _TOKEN.fullmatch(token) else None
        if answer is not None:
            head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                    b"Content-Length: %d\r\nCache-Control: no-store\r\n" % len(answer))
            return Plan(head, tail, answer if req.method == b"GET" else b"", close, discard, 200)
    host = _HOST.fullmatch(req.fields.get(b"host") or b"")
    if host is None:  # no Host (HTTP/1.0) or one we would not repeat: nowhere to send it
        return error_plan(400)
    port = b"" if https_port == 443 else b":%d" % https_port
    query = b"" if req.query is None else b"?" + req.query
    head = (b"HTTP/1.1 %d %s\r\nLocation: https://%s%s%s%s\r\nContent-Length: 0\r\n"
            % (TO_HTTPS, REASONS[TO_HTTPS], host.group(1).lower(), port, path, query))
    return Plan(head, tail, b"", close, discard, TO_HTTPS)


class Upgrade(App):
    """A worker's app on the plain port: ``to_https`` instead of the site's routes."""

    def __init__(self, site, limits=None, publish=None, log=None, *, https_port: int = 443,
                 tokens: dict[bytes, bytes] | None = None) -> None:
        super().__init__(site, limits, publish=publish, log=log)
        self.counts = self.stats  # no site's build answers here: its requests are the worker's
        self.https_port = https_port
        self.tokens = tokens or {}

    def plan(self, head: bytes) -> tuple:
        plan = tuple(to_https(head, self.limits, self.https_port, self.tokens))
        if len(head) <= _PLAN_HEAD_MAX:
            if len(self.plans) >= _PLANS_MAX:
                self.plans.clear()
            self.plans[head] = plan
        return plan


def hsts(site, seconds: int, encode=None, section=None):
    """Add ``Strict-Transport-Security: max-age=SECONDS`` (RFC 6797 §6.1) to every head of
    ``site``, in place, once at load time; ``encode(head)``: the HTTP/2 block encoder
    (orisha/protocols/hpack_blocks.py) and ``section(head)`` the QPACK one
    (qpack_blocks.py), for the blocks and sections the build stored. Returns ``site``."""
    line = b"Strict-Transport-Security: max-age=%d\r\n" % seconds
    entries, redirects, seen = [site.not_found, site.fallback], [], set()
    rules = list(site.rules)
    for target in site.routes.values():
        if target.__class__ is Guarded:  # behind --basic-auth: its document gets it too
            target = target.target
        if target.__class__ is Entry:
            entries.append(target)
        elif target.__class__ is Redirect:
            redirects.append(target)
        elif target.__class__ is Rules:
            entries.append(target.default)
            rules.extend(target.rules)
    for rule in rules:
        entries.extend(rule.entries.values())
    for e in entries:
        if e.__class__ is not Entry or id(e) in seen:
            continue
        seen.add(id(e))
        e.head_416 += line
        if e.multi_fields:
            e.multi_fields += line
        for v in e.variants:
            if id(v) in seen:
                continue
            seen.add(id(v))
            v.head += line
            v.head_304 += line
            if v.fields:
                v.fields += line
            if v.h2 and encode is not None:
                v.h2, v.h2_304 = encode(v.head), encode(v.head_304)
            if getattr(v, "h3", None) and section is not None:
                v.h3, v.h3_304 = section(v.head), section(v.head_304)
    for r in redirects:
        if id(r) not in seen:
            seen.add(id(r))
            r.tail += line
    return site
