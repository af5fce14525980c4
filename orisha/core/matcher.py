"""Run-time matching of the ``_redirects`` rules the build could not resolve.

Strategy: the build compiles every rule it can into the route table (exact
paths become ordinary routes), so this runs only on a route-table miss, or on
the few routes whose answer depends on the query (``Rules`` values). Rules are
tried in order and the first match wins (Netlify, Cloudflare Pages). A match
answers a target like a route-table value: an ``Entry`` (a 200 rewrite, or a
404 rule's document) or a ``Redirect`` made for this path. Answers are plans,
which the connection memoises by head, so a repeated request matches once.
"""

from __future__ import annotations

import re

from .negotiate import route_key
from .site import Redirect, Rules

# What a path segment may carry in a Location (RFC 3986 pchar and "/"): the rest is
# percent-encoded, since the core matched the decoded path. (The C core's table is
# generated from LOCATION_SAFE: orisha/targets/unikernel/policy_header.py.)
LOCATION_SAFE = (b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
                 b"-._~!$&'()*+,;=:@/")
_UNSAFE = re.compile(b"[^" + re.escape(LOCATION_SAFE) + b"]")


def _quote(value: bytes) -> bytes:
    return _UNSAFE.sub(lambda m: b"%%%02X" % m.group()[0], value)


def _params(query: bytes | None) -> dict[bytes, bytes]:
    """Raw query parameters, the first value of each name."""
    out: dict[bytes, bytes] = {}
    if query:
        for pair in query.split(b"&"):
            name, _, value = pair.partition(b"=")
            out.setdefault(name, value)
    return out


def match(rules: tuple, path: bytes, query: bytes | None, site):
    """The target of the first rule matching ``path`` (decoded) and ``query``, or None."""
    params = None
    for rule in rules:
        m = rule.pattern.fullmatch(path)
        if m is None:
            continue
        bound = {name: _quote(value) for name, value in m.groupdict().items()}
        if rule.query:
            if params is None:
                params = _params(query)
            for key, name, literal in rule.query:
                value = params.get(key)
                if value is None or (literal is not None and value != literal):
                    break
                if name is not None:
                    bound[name] = value
            else:
                return _target(rule, bound, site)
            continue
        return _target(rule, bound, site)
    return None


def _target(rule, bound: dict, site):
    url = b"".join(p if p.__class__ is bytes else bound.get(p, b"") for p in rule.to)
    if rule.status >= 300 and rule.status != 404:
        return Redirect(url, rule.status, rule.query_append)
    key = route_key(url.partition(b"?")[0])
    if rule.status == 404:
        return rule.entries.get(key) or site.not_found
    target = site.routes.get(key) if key is not None else None  # 200: a rewrite
    if target.__class__ is Rules:
        target = target.default
    return target or site.not_found
