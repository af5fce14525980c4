"""The author's ``_headers`` and ``_redirects`` (Netlify / Cloudflare Pages syntax), compiled.

Strategy: both files (and the ``--header`` / ``--redirect`` options, which
come first) are read once, every line checked: a line that cannot be
understood is a one-line ``BuildError`` naming the file and line
(``SITE/_redirects:7: unknown status 399``). Then ``resolve`` decides at build
time everything a rule can decide:

* Rules are tried in order and the first match wins. A rule without ``!``
  applies only where no file answers the path (Netlify's shadowing); a forced
  one (``301!``) always. So for every path the route table already has, only
  forced rules are evaluated — here, placeholders and all, since the path is
  known — and for every exact rule path (no ``*``, no ``:name``) the answer
  becomes an ordinary route: a ``Redirect`` with its status, a 200 rewrite
  pointing at the destination's document, a 404 rule at that document served
  with status 404.
* What cannot be known before a request arrives is left to the run-time
  matcher (orisha/core/matcher.py), consulted on a route-table miss only:
  rules with splats or placeholders, and, as ``Rules`` routes, rules whose
  query conditions (``/store id=:id /blog/:id 301``) match a known path.

Headers: every ``_headers`` block whose path pattern matches the request path
(``--header GLOB`` matches the file's path in the site, like
``--cache-control``) adds its fields; the same field from several blocks is
joined with ", " (both hosts document it), ``! Name`` (Cloudflare) drops what
earlier blocks set. Fields that frame or validate a response are the server's
and refused.

Paths match exactly (a trailing slash counts). Redirects pass the request's
query on (Netlify) unless the destination has its own or the rule has query
conditions. Not supported, each a
one-line error: proxying (a 200 rule to another site), host-specific rules,
country/language/role/cookie conditions.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from urllib.parse import quote, unquote_to_bytes

from ..errors import BuildError

STATUSES = (200, 301, 302, 303, 307, 308, 404)
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
# Fields the server sets from the document or the connection (RFC 9110, 9112).
SERVER_FIELDS = frozenset(("content-length", "transfer-encoding", "connection", "keep-alive",
                           "upgrade", "te", "trailer", "date", "content-encoding", "content-range",
                           "etag", "last-modified", "accept-ranges", "proxy-connection"))
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_PLACE = re.compile(r"\*|:[A-Za-z_][A-Za-z0-9_]*")
_NAME = re.compile(r":([A-Za-z_][A-Za-z0-9_]*)")
_STATUS = re.compile(r"([0-9]{3})(!?)")
_CONDITIONS = ("country", "language", "role", "cookie")
# Characters a Location may carry as they are (RFC 3986 reserved and unreserved, and "%").
_URL_SAFE = ":/?#[]@!$&'()*+,;=%-._~"


def pattern_pieces(src: str) -> tuple:
    """A path pattern in order: literal text (str), ``("*", "splat")`` for ``*`` (anything)
    and ``(":", name)`` for ``:name`` (one path segment). The compiled form both matchers
    start from: the regular expression below, and the unikernel image's pieces."""
    out, pos = [], 0
    for m in _PLACE.finditer(src):
        if m.start() > pos:
            out.append(src[pos:m.start()])
        out.append(("*", "splat") if m.group() == "*" else (":", m.group()[1:]))
        pos = m.end()
    if pos < len(src):
        out.append(src[pos:])
    return tuple(out)


def _pattern(src: str, where: str) -> tuple[str, tuple[str, ...]]:
    """A path pattern as a regular expression: ``*`` → ``splat`` (anything), ``:name`` →
    one path segment. Returns the expression and the placeholder names in order."""
    out, names = [], []
    for piece in pattern_pieces(src):
        if piece.__class__ is str:
            out.append(re.escape(piece))
            continue
        kind, name = piece
        if name in names:
            raise BuildError(f"{where}: {'*' if name == 'splat' else ':' + name} appears twice in {src}")
        names.append(name)
        out.append("(?P<splat>.*)" if kind == "*" else f"(?P<{name}>[^/]+)")
    return "".join(out), tuple(names)


def path_regex(src: str, where: str) -> re.Pattern:
    """A ``_headers``-style path pattern (``/private/*``, ``:name``) compiled over decoded
    paths (str)."""
    return re.compile(_pattern(src, where)[0], re.S)


def _path(src: str, where: str, what: str) -> str:
    if src.startswith(("http://", "https://")):
        raise BuildError(f"{where}: host-specific {what} {src} are not supported (use a path)")
    if not src.startswith("/"):
        raise BuildError(f"{where}: {src}: a path must start with /")
    return src


@dataclass
class RedirectRule:
    """One ``_redirects`` line (or ``--redirect``)."""
    where: str                              # "SITE/_redirects:7", for messages
    source: str                             # the path pattern as written
    query: tuple[tuple[str, str], ...]      # (key, ":name" or a literal value)
    to: str
    status: int
    force: bool
    regex: re.Pattern = field(repr=False, default=None)
    names: tuple[str, ...] = ()

    @property
    def keeps_query(self) -> bool:
        """A redirect passes the request's query on (Netlify) unless the destination has its
        own or the rule matched on it (then the destination says what to keep: ``?id=:id``)."""
        return "?" not in self.to and not self.query

    @property
    def exact(self) -> bool:
        """No placeholder, splat or query condition: it fits in the route table."""
        return not self.names and not self.query

    def bind(self, path: str) -> dict[str, str] | None:
        m = self.regex.fullmatch(path)
        return None if m is None else m.groupdict()

    def location(self, bound: dict[str, str]) -> str:
        """The destination with path placeholders filled in, as it goes on the wire."""
        to = _NAME.sub(lambda m: quote(bound[m.group(1)], safe="/", errors="surrogateescape")
                       if m.group(1) in bound else m.group(), self.to)
        return quote(to, safe=_URL_SAFE, errors="surrogateescape")

    def pieces(self) -> tuple:
        """The destination for the run-time matcher: bytes literals and placeholder names."""
        bound = set(self.names) | {v[1:] for _, v in self.query if v.startswith(":")}
        out, pos = [], 0
        for m in _NAME.finditer(self.to):
            if m.group(1) in bound:
                out += [quote(self.to[pos:m.start()], safe=_URL_SAFE).encode(), m.group(1)]
                pos = m.end()
        out.append(quote(self.to[pos:], safe=_URL_SAFE).encode())
        return tuple(p for p in out if p != b"")

    def conditions(self) -> tuple:
        """The query conditions for the run-time matcher: (key, name, literal) in bytes."""
        return tuple((k.encode(), v[1:] if v.startswith(":") else None,
                      None if v.startswith(":") else v.encode()) for k, v in self.query)


def redirect_line(line: str, where: str) -> RedirectRule | None:
    """Parse one line of ``_redirects``: FROM [KEY=VALUE…] TO [STATUS[!]]; None if blank."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    tokens = line.split()
    for i, token in enumerate(tokens):  # a word starting with "#" starts a comment
        if token.startswith("#"):
            del tokens[i:]
            break
    source = _path(tokens[0], where, "rules")
    i, query = 1, []
    while i < len(tokens) and "=" in tokens[i] and not tokens[i].startswith(("/", "http://", "https://")):
        key, _, value = tokens[i].partition("=")
        if not key:
            raise BuildError(f"{where}: {tokens[i]}: a query condition is KEY=VALUE or KEY=:name")
        query.append((key, value))
        i += 1
    if i >= len(tokens):
        raise BuildError(f"{where}: no destination (expected FROM TO [STATUS])")
    to = tokens[i]
    status, force = 301, False
    rest = tokens[i + 1:]
    if rest and _STATUS.fullmatch(rest[0]):
        m = _STATUS.fullmatch(rest[0])
        status, force = int(m.group(1)), bool(m.group(2))
        if status not in STATUSES:
            raise BuildError(f"{where}: unknown status {status} "
                             f"(expected one of {', '.join(map(str, STATUSES))})")
        rest = rest[1:]
    if rest:
        word = rest[0].partition("=")[0].lower()
        if word in _CONDITIONS:
            raise BuildError(f"{where}: {rest[0]}: {word} conditions are not supported")
        raise BuildError(f"{where}: unexpected {rest[0]!r} (expected FROM TO [STATUS])")
    remote = to.startswith(("http://", "https://"))
    if not remote and not to.startswith("/"):
        raise BuildError(f"{where}: {to}: a destination is a path starting with / or an http(s) URL")
    if remote and status in (200, 404):
        raise BuildError(f"{where}: {to}: a {status} rule to another site (proxying) is not supported")
    regex, names = _pattern(source, where)
    return RedirectRule(where, source, tuple(query), to, status, force, re.compile(regex, re.S), names)


def parse_redirects(text: str, where: str) -> list[RedirectRule]:
    rules = []
    for n, line in enumerate(text.splitlines(), 1):
        rule = redirect_line(line, f"{where}:{n}")
        if rule is not None:
            rules.append(rule)
    return rules


def cli_redirect(value: str) -> RedirectRule:
    """``--redirect "FROM TO [STATUS]"``."""
    rule = redirect_line(value, f"--redirect {value!r}")
    if rule is None:
        raise BuildError(f"--redirect {value!r}: expected \"FROM TO [STATUS]\"")
    return rule


@dataclass
class HeaderRule:
    """One ``_headers`` block (a path pattern and its fields), or one ``--header``."""
    where: str
    source: str
    glob: bool                               # --header: a glob over the file's path in the site
    headers: list[tuple[str, str | None]]    # (Name, value); value None: "! Name" (detach)
    regex: re.Pattern = field(repr=False, default=None)

    def matches(self, path: str, rel: str) -> bool:
        if self.glob:
            return fnmatch.fnmatchcase(rel, self.source)
        return self.regex.fullmatch(path) is not None


def _field(name: str, value: str, where: str) -> tuple[str, str]:
    if not _TOKEN.fullmatch(name):
        raise BuildError(f"{where}: {name!r} is not a header name")
    if name.lower() in SERVER_FIELDS:
        raise BuildError(f"{where}: {name} is set by the server and cannot be changed")
    if _BAD_VALUE.search(value):
        raise BuildError(f"{where}: the value of {name} has a control character")
    return name, value


def parse_headers(text: str, where: str) -> list[HeaderRule]:
    rules: list[HeaderRule] = []
    for n, raw in enumerate(text.splitlines(), 1):
        here = f"{where}:{n}"
        line = raw.rstrip()
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line[0] in " \t":
            if not rules:
                raise BuildError(f"{here}: a header line before any path")
            body = line.strip()
            if body.startswith("!"):
                name = body[1:].strip()
                if not _TOKEN.fullmatch(name):
                    raise BuildError(f"{here}: {name!r} is not a header name")
                rules[-1].headers.append((name, None))
                continue
            name, sep, value = body.partition(":")
            if not sep:
                raise BuildError(f"{here}: expected 'Name: value'")
            rules[-1].headers.append(_field(name, value.strip(), here))
        else:
            source = _path(line.strip(), here, "header rules")
            regex, _ = _pattern(source, here)
            rules.append(HeaderRule(here, source, False, [], re.compile(regex, re.S)))
    for r in rules:
        if not r.headers:
            raise BuildError(f"{r.where}: {r.source} has no header lines under it")
    return rules


def cli_header(value: str) -> HeaderRule:
    """``--header GLOB:NAME=VALUE``."""
    where = f"--header {value!r}"
    glob, sep, rest = value.partition(":")
    name, sep2, fvalue = rest.partition("=")
    if not (sep and sep2 and glob and name):
        raise BuildError(f"{where}: expected GLOB:NAME=VALUE, e.g. '*.html:X-Frame-Options=DENY'")
    return HeaderRule(where, glob, True, [_field(name.strip(), fvalue.strip(), where)])


def headers_for(rules: list[HeaderRule], path: str, rel: str,
                initial: tuple = ()) -> tuple[tuple[str, str], ...]:
    """The merged author fields for a request path served from the file ``rel``, after
    the build's ``initial`` ones (early hints: a rule adds to them or detaches them)."""
    merged: dict[str, tuple[str, list[str]]] = {n.lower(): (n, [v]) for n, v in initial}
    cookies = 0
    for r in rules:
        if not r.matches(path, rel):
            continue
        for name, value in r.headers:
            key = name.lower()
            if value is None:
                merged.pop(key, None)
                continue
            if key == "set-cookie":  # never joined (RFC 9110 §5.3): one line each
                cookies += 1
                key = f"set-cookie {cookies}"
            merged.setdefault(key, (name, []))[1].append(value)
    return tuple((name, ", ".join(values)) for name, values in merged.values())


# -- resolving rules against the route table -------------------------------------------------

def _key(path: str) -> bytes:
    return path.encode("utf-8", "surrogateescape")


def _lookup(table: dict, url: str) -> tuple | None:
    path = url.split("?", 1)[0].split("#", 1)[0]
    return table.get(unquote_to_bytes(path))


def _answer(rule: RedirectRule, bound: dict[str, str], table: dict) -> tuple:
    """What ``rule`` answers for a known path: a route-table value."""
    to = rule.location(bound)
    if rule.status in REDIRECT_STATUSES:
        return "redirect", (to.encode(), rule.status, rule.keeps_query)
    target = _lookup(table, to)
    if target is None or (rule.status == 404 and target[0] != "doc"):
        raise BuildError(f"{rule.where}: {to} is not a document of the site")
    if rule.status == 404:
        return "doc404", target[1]
    return target


def _at(path: str, table: dict, rules: list[RedirectRule], shadowed: bool):
    """(query-conditioned rules that match ``path`` before the answer, the answer or None)."""
    pending = []
    for rule in rules:
        if shadowed and not rule.force:
            continue
        bound = rule.bind(path)
        if bound is None:
            continue
        if rule.query:
            pending.append(rule)
            continue
        return pending, _answer(rule, bound, table)
    return pending, None


def resolve(table: dict, rules: list[RedirectRule]) -> tuple[dict, list[RedirectRule]]:
    """The route table with every rule decided at build time, and the rules left for the
    run-time matcher (in order). Route values: ``("doc", rel)``, ``("doc404", rel)``,
    ``("redirect", (location, status, pass the query))`` and ``("rules", (rules, default))``."""
    if not rules:
        return table, []
    out = dict(table)
    forced = [r for r in rules if r.force]
    for key in table if forced else ():
        pending, answer = _at(key.decode("utf-8", "surrogateescape"), table, forced, True)
        if pending:
            out[key] = ("rules", (tuple(pending), answer or table[key]))
        elif answer is not None:
            out[key] = answer
    for rule in rules:
        key = _key(rule.source)
        if not rule.names and key not in table and key not in out:
            pending, answer = _at(rule.source, table, rules, False)
            out[key] = ("rules", (tuple(pending), answer)) if pending else answer
    runtime = [r for r in rules if r.names]
    return out, runtime


def not_found_targets(rule: RedirectRule, table: dict) -> dict[bytes, str]:
    """For a run-time 404 rule: every document its destination can name (key → rel)."""
    bound = set(rule.names) | {v[1:] for _, v in rule.query if v.startswith(":")}
    dest = rule.to.split("?", 1)[0]
    out, pos = [], 0
    for m in _NAME.finditer(dest):
        if m.group(1) in bound:
            path_segment = m.group(1) in rule.names and m.group(1) != "splat"
            out += [re.escape(dest[pos:m.start()]), "[^/]+" if path_segment else ".*"]
            pos = m.end()
    out.append(re.escape(dest[pos:]))
    pattern = re.compile("".join(out), re.S)
    found = {k: v[1] for k, v in table.items()
             if v[0] == "doc" and pattern.fullmatch(k.decode("utf-8", "surrogateescape"))}
    if not found:
        raise BuildError(f"{rule.where}: {rule.to} names no document of the site")
    return found
