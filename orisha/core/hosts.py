"""Several sites in one server: which site a request's Host names.

Strategy: a ``Hosts`` table is made once per worker generation from the
``--site HOST=OUT`` pairs: exact names in a dict, ``*.example.org`` patterns as
suffixes tried longest first (nginx's rule: a wildcard matches every name under
it, not the bare domain). The core consults it once per *new* request head,
inside ``App.plan`` — a memoised head already carries its site — and a server
of one site has no table at all, so it pays nothing. An unknown or absent Host
gets the first site (nginx's default server).

``sole(i)``: the table of a TLS connection whose SNI named site ``i``: its own
names and unknown ones answer from site ``i``; a Host naming *another* site is
misdirected (``None``: the core answers 421, RFC 9110 §15.5.20), so neither a
mistaken Host nor HTTP/2 connection coalescing (RFC 9113 §9.1.1) ever reads one
site's content over another's certificate.
"""

from __future__ import annotations

import re

_HOST = re.compile(rb"\n[Hh][Oo][Ss][Tt]:[ \t]*([^\r\n]*?)[ \t]*\r?(?:\n|$)")


def normal(host: bytes | str | None) -> bytes:
    """A Host (or :authority, or SNI) as the table knows it: lower case, no port, no
    trailing dot ("Example.ORG.:8080" → b"example.org"; "[::1]:80" → b"[::1]")."""
    if host is None:
        return b""
    if host.__class__ is str:
        host = host.encode("ascii", "replace")
    if host[:1] == b"[":  # an IPv6 literal: its colons are not a port
        host = host[:host.find(b"]") + 1]
    else:
        host = host.partition(b":")[0]
    return host.rstrip(b".").lower()


class Hosts:
    """The host table: ``pick(host)`` → the ``Site`` it names (None: misdirected)."""

    __slots__ = ("sites", "exact", "wild", "default", "names_of")

    def __init__(self, sites: list[tuple[tuple[str, ...], object]]) -> None:
        """``sites``: (host patterns, Site) in command-line order; the first is the default."""
        self.sites = [site for _, site in sites]
        self.names_of = [names for names, _ in sites]  # for log lines, metrics, messages
        self.exact: dict[bytes, int] = {}
        wild: list[tuple[bytes, int]] = []
        for i, (names, _) in enumerate(sites):
            for name in names:
                key = normal(name)
                if key.startswith(b"*."):
                    wild.append((key[1:], i))  # b".example.org"
                else:
                    self.exact.setdefault(key, i)
        self.wild = sorted(wild, key=lambda w: -len(w[0]))  # the longest suffix wins
        self.default = 0

    # What the server's start-up and reload lines read of a site (``Site.summary``, ``.loop``).
    @property
    def summary(self) -> str:
        return f"{len(self.sites)} sites: " + "; ".join(
            f"{names[0]} ({site.summary})" for names, site in zip(self.names_of, self.sites))

    @property
    def loop(self) -> str:
        return self.sites[0].loop

    def index(self, host: bytes | str | None) -> int | None:
        """Which site names ``host`` (exact before wildcard), or None."""
        key = normal(host)
        i = self.exact.get(key)
        if i is None:
            for suffix, j in self.wild:
                if key.endswith(suffix) and len(key) > len(suffix):
                    return j
        return i

    def choice(self, host: bytes | None) -> int:
        """The index of the site that answers ``host``: the default for an unknown one,
        -1 for a misdirected one (``sole``)."""
        i = self.index(host)
        return self.default if i is None else i

    def pick(self, host: bytes | None):
        i = self.choice(host)
        return None if i < 0 else self.sites[i]

    def sole(self, i: int) -> "Hosts":
        """The table of a connection whose SNI chose site ``i`` (see the Strategy)."""
        t = Hosts.__new__(Hosts)
        t.sites, t.names_of, t.default = self.sites, self.names_of, i
        t.exact = {k: (j if j == i else -1) for k, j in self.exact.items()}
        t.wild = [(s, j if j == i else -1) for s, j in self.wild]
        return t

    def label(self, head: bytes) -> bytes:
        """How the access log names the site that answered ``head`` (its first HOST; ``-``:
        misdirected). Only a server of several sites that keeps a log asks."""
        m = _HOST.search(head)
        site = self.pick(m.group(1) if m else None)
        return b"-" if site is None else self.name(site).encode()

    def name(self, site) -> str:
        """The first HOST of ``--site`` for ``site``: how log lines and metrics name it."""
        for names, s in zip(self.names_of, self.sites):
            if s is site:
                return names[0]
        return "-"
