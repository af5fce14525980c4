"""Checking the site's internal links at build time.

Strategy: every HTML page is read with the standard library's ``html.parser`` and
every stylesheet (and ``<style>``, ``style=``) with a small ``url()``/``@import``
scanner; each reference the browser would fetch or follow from the site itself —
``href``, ``src``, ``srcset``, ``poster``, ``data``, CSS ``url()`` — is resolved
against the page's URL (or its ``<base href>``) and then answered the way the
request core would answer it: the route table (index documents, ``/x`` → ``/x.html``,
``_redirects`` rules decided at build time), the run-time rules (the core's own
matcher), and the fallback for what a navigation reaches (``connection.unknown``). A
reference the site answers with a 404 (no route, a 404 rule, the not-found page) is
broken. External references (a scheme or a host), fragments alone and ``data:`` URLs
are not checked; nothing is fetched. The references of a file are cached by its bytes
beside the compressed variants, so a rebuild re-reads only what changed.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from html.parser import HTMLParser
from urllib.parse import quote, urljoin, urlsplit

from ..core import connection, matcher
from ..core.negotiate import route_key
from ..core.site import Redirect, Rule, Rules
from .mime import content_type

VERSION = "links-3"  # in the cache key: a change of what is extracted invalidates it

# Attributes that name a URL, by attribute (any element): ``href`` (a, area, link, and
# SVG's use/image), ``src`` (img, script, iframe, source, audio, video, track, embed,
# input), ``poster`` (video), ``data`` (object); ``srcset``/``imagesrcset`` hold several.
_URL_ATTRS = frozenset(("href", "xlink:href", "src", "poster", "data"))
_SRCSET_ATTRS = frozenset(("srcset", "imagesrcset"))
# <link rel> values whose href names an origin (or a feed elsewhere), not a resource.
_ORIGIN_RELS = frozenset(("preconnect", "dns-prefetch"))
# What a URL in a Link field keeps as it is (RFC 3986 reserved and unreserved, "%"; not
# ">" or "," or a space, which would end the value).
_URL_SAFE = ":/?#[]@!$&'()*+;=%-._~"
_CSS_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_CSS_URL = re.compile(r"""url\(\s*(?:"([^"]*)"|'([^']*)'|([^)"'\s]*))\s*\)"""
                      r"""|@import\s+(?:"([^"]*)"|'([^']*)')""", re.I)


def css_refs(text: str, line: int = 1) -> list[tuple[int, str]]:
    """(line, reference) of every ``url()`` and ``@import`` in CSS text starting at ``line``."""
    text = _CSS_COMMENT.sub(lambda m: "\n" * m.group().count("\n"), text)
    out, at, pos = [], line, 0
    for m in _CSS_URL.finditer(text):
        at += text.count("\n", pos, m.start())
        pos = m.start()
        out.append((at, next(g for g in m.groups() if g is not None)))
    return out


def _srcset(value: str) -> list[str]:
    """The URLs of a srcset (HTML's candidate list: URL, optional descriptor, commas)."""
    urls, i, n = [], 0, len(value)
    while i < n:
        while i < n and (value[i].isspace() or value[i] == ","):
            i += 1
        start = i
        while i < n and not value[i].isspace():
            i += 1
        url = value[start:i]
        if url.endswith(","):  # no descriptor: the comma ends the candidate
            url = url.rstrip(",")
        else:
            while i < n and value[i] != ",":  # the descriptor (may hold parentheses)
                i += 1
        if url:
            urls.append(url)
    return urls


class _Page(HTMLParser):
    """The references of one HTML page, its first ``<base href>``, and its early hints:
    (reference, Link parameters) of what its head needs before it can render — a
    stylesheet (``as=style``), a script without async/defer (``as=script``) — and of what
    it declares (``<link rel=preload as=…>``, fonts included, ``rel=modulepreload``)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.refs: list[tuple[int, str]] = []
        self.hints: list[tuple[str, str]] = []
        self.base: str | None = None
        self._style: int | None = None  # the line where an open <style> started
        self._head = True               # until <body> or </head>

    def _hint(self, tag: str, a: dict, rels: set) -> None:
        if tag == "script":
            if a.get("src") and self._head and "async" not in a and "defer" not in a \
                    and (a.get("type") or "").lower() != "module":
                self.hints.append((a["src"], "rel=preload; as=script"))
            return
        href = a.get("href")
        if not href:
            return
        cors = "; crossorigin" if "crossorigin" in a else ""
        if "modulepreload" in rels:
            self.hints.append((href, "rel=modulepreload" + cors))
        elif "preload" in rels and a.get("as"):
            self.hints.append((href, f"rel=preload; as={a['as'].lower()}{cors}"))
        elif "stylesheet" in rels and self._head and "alternate" not in rels:
            self.hints.append((href, "rel=preload; as=style" + cors))

    def handle_starttag(self, tag, attrs) -> None:
        line = self.getpos()[0]
        if tag == "body":
            self._head = False
        elif tag == "script":
            self._hint(tag, dict(attrs), set())
        if tag == "base":
            href = dict(attrs).get("href")
            if href is not None and self.base is None:
                self.base = href.strip()
            return
        if tag == "link":
            rels = set((dict(attrs).get("rel") or "").lower().split())
            self._hint(tag, dict(attrs), rels)
            # No rel (DocBook's <link rev="made" href="list@host">): an obsolete reverse
            # link naming the author, neither fetched nor followed.
            if not rels or rels & _ORIGIN_RELS:
                return
        for name, value in attrs:
            if value is None:
                continue
            if name in _URL_ATTRS:
                self.refs.append((line, value))
            elif name in _SRCSET_ATTRS:
                self.refs += [(line, u) for u in _srcset(value)]
            elif name == "style":
                self.refs += css_refs(value, line)
        if tag == "style":
            self._style = line

    handle_startendtag = handle_starttag

    def handle_endtag(self, tag) -> None:
        if tag == "style":
            self._style = None
        elif tag == "head":
            self._head = False

    def handle_data(self, data) -> None:
        if self._style is not None:
            self.refs += css_refs(data, self.getpos()[0])


def read(rel: str, data: bytes):
    """(base href, [(line, reference)], [(reference, Link parameters)]) of a file: an HTML
    page or a stylesheet (no hints); nothing for other files."""
    ctype = content_type(rel)
    if ctype.startswith("text/css"):
        return None, css_refs(data.decode("utf-8", "replace")), []
    if not ctype.startswith("text/html"):
        return None, [], []
    page = _Page()
    page.feed(data.decode("utf-8", "replace"))
    page.close()
    return page.base, page.refs, page.hints


def refs(rel: str, data: bytes) -> tuple[str | None, list[tuple[int, str]]]:
    """(base href, [(line, reference)]) of a file."""
    return read(rel, data)[:2]


def cached_read(rel: str, data: bytes, digest: str, cache: str | None):
    """``read``, through the cache (the file's bytes' digest names the entry)."""
    ctype = content_type(rel)
    if not (ctype.startswith("text/html") or ctype.startswith("text/css")):
        return None, [], []
    path = os.path.join(cache, f"{digest}.{VERSION}") if cache else None
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                base, found, hints = json.load(f)
            return base, [tuple(r) for r in found], [tuple(h) for h in hints]
        except (OSError, ValueError):  # not cached yet (or a torn file): read the page
            pass
    base, found, hints = read(rel, data)
    if path:
        os.makedirs(cache, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump([base, found, hints], f)
        os.replace(tmp, path)  # atomic: concurrent builds never see half a file
    return base, found, hints


# What a route answers, for the checker: a page (or a redirect: it leads somewhere) or a 404.
_OK, _BROKEN = "ok", "broken"


class Routes:
    """The site's answers as the core gives them, reduced to found / not found.

    ``table``: the resolved route table (``rules.resolve``: "doc", "doc404", "redirect",
    "rules" values); ``runtime``: the run-time rules (``emit.CompiledRule``), and
    ``compile_rule`` turns a pending rule of a "rules" route into one; ``fallback``:
    whether there is one; ``assets``: ``Site.assets``.
    """

    def __init__(self, table: dict, runtime: list, compile_rule, fallback: bool,
                 assets: frozenset | None) -> None:
        self.not_found = _BROKEN
        self.fallback = _OK if fallback else None
        self.assets = assets
        self.routes: dict = {}
        made: dict[int, Rule] = {}

        def rule(c) -> Rule:  # the core's Rule; a 404 rule's documents are all not found
            if id(c) not in made:
                made[id(c)] = Rule(c.pattern, c.query, c.to, c.status, c.query_append,
                                   {k: _BROKEN for k in c.entries})
            return made[id(c)]

        def value(v):
            kind, x = v
            if kind == "rules":
                pending, default = x
                return Rules(tuple(rule(compile_rule(r)) for r in pending),
                             None if default is None else value(default))
            return _BROKEN if kind == "doc404" else _OK
        for key, v in table.items():
            self.routes[key] = value(v)
        self.rules = tuple(rule(c) for c in runtime)

    def found(self, path: bytes, query: bytes | None) -> bool:
        """Whether a GET of ``path`` (as sent) answers anything but a 404: ``answer()``'s
        routing, with the core's matcher and fallback choice."""
        routes = self.routes
        key = path
        target = routes.get(key)
        if target is None:
            key = route_key(key)
            if key is None:
                return False  # 400: malformed percent-encoding
            target = routes.get(key)
            if target is None:
                target = ((self.rules and matcher.match(self.rules, key, query, self))
                          or connection.unknown(self, key, {}))
        if target.__class__ is Rules:
            target = (matcher.match(target.rules, key, query, self) or target.default
                      or connection.unknown(self, key, {}))
        return target is _OK or target.__class__ is Redirect


def _page_url(rel: str, base: str | None) -> str | None:
    """The URL a page's relative references resolve against; None: another site's."""
    page = "/" + rel
    if base is not None:
        b = urlsplit(base)
        if b.scheme or b.netloc:
            return None
        page = urljoin(page, base)
    return page


def _internal(page: str, ref: str):
    """The reference resolved against the page (a SplitResult), or None: nothing to check
    (a fragment alone, or external: http:, mailto:, data:, javascript:, //host)."""
    ref = ref.strip()
    if not ref or ref[0] == "#":
        return None
    u = urlsplit(ref)
    if u.scheme or u.netloc:
        return None
    return urlsplit(urljoin(page, ref))


def _found(routes: Routes, target) -> bool:
    return routes.found(target.path.encode("utf-8", "surrogateescape"),
                        target.query.encode("utf-8", "surrogateescape") if target.query else None)


def broken(rel: str, base: str | None, found: list[tuple[int, str]],
           routes: Routes) -> list[tuple[int, str]]:
    """(line, target) of each internal reference of the file ``rel`` that leads nowhere."""
    page = _page_url(rel, base)
    out = []
    for line, ref in found if page is not None else ():
        target = _internal(page, ref)
        if target is not None and not _found(routes, target):
            out.append((line, target.path + (f"?{target.query}" if target.query else "")))
    return out


HINTS_MAX = 16  # Link values per page: a head stays small, and so does its 103


def link_field(rel: str, base: str | None, hints: list[tuple[str, str]],
               routes: Routes) -> str | None:
    """The ``Link`` field value of a page's early hints that the site itself serves
    (RFC 8288: ``</css/a.css>; rel=preload; as=style, …``), or None."""
    page = _page_url(rel, base)
    values: list[str] = []
    for ref, params in hints if page is not None else ():
        target = _internal(page, ref)
        if target is None or not _found(routes, target):
            continue
        url = quote(target.path, safe=_URL_SAFE) + (
            "?" + quote(target.query, safe=_URL_SAFE) if target.query else "")
        value = f"<{url}>; {params}"
        if value not in values:
            values.append(value)
    return ", ".join(values[:HINTS_MAX]) or None
