"""HTTP/3 with several sites (issues 21 and 22, where they meet): over QUIC, SNI picks the
certificate and the site as over TLS/TCP, a :authority of another site gets 421, the access
log names the site; with ACME, the certificates it issues reach the QUIC side too.

Real servers (``orisha serve --site … --tls-cert … --tls-cert …``, and ACME with Pebble,
tests/test_acme.py) and aioquic's HTTP/3 client (tests/test_h3.py's ``_Client``) over
loopback UDP; the sites and their certificates are tests/test_sites.py's fixtures.
"""

from __future__ import annotations

import asyncio
import ssl

from aioquic.asyncio.client import connect
from aioquic.h3.connection import H3_ALPN
from aioquic.quic.configuration import QuicConfiguration
from cryptography import x509

from test_acme import pebble  # noqa: F401  (a fixture)
from test_h3 import _Client
from test_sites import (ACME_SITES, SITE_FILES, _site_args, _start, _tls_args, acme_sites,
                        sites_issued, two)  # noqa: F401  (two: a fixture)
from tlsutil import pki  # noqa: F401  (the fixture test_acme's Pebble is made with)


def h3_site(port: int, ca: str, sni: str | None, requests: list, verify: bool = True):
    """(the DNS names of the certificate the server presented, [(status, fields, body)])
    for ``requests``, (path, :authority), on one connection whose SNI is ``sni``.
    ``verify``: the chain and the name are checked against ``ca`` (aioquic's own check)."""
    async def run():
        config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name=sni)
        config.load_verify_locations(ca)
        if not verify:
            config.verify_mode = ssl.CERT_NONE
        async with connect("127.0.0.1", port, configuration=config, create_protocol=_Client,
                           wait_connected=True) as client:
            leaf = client._quic.tls._peer_certificate
            got = []
            for path, authority in requests:  # in order: the access log's order
                status, fields, body, _ = await client.request(path, authority=authority)
                got.append((status, fields, body))
            sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            return set(sans.get_values_for_type(x509.DNSName)), got
    return asyncio.run(asyncio.wait_for(run(), 60))


def _page(site: str) -> bytes:
    return SITE_FILES[site]["index.html"].encode()


def test_h3_sni_chooses_certificate_and_site_and_misdirects(two, tmp_path):
    log = tmp_path / "access.log"
    s = _start("epoll", *_site_args(two), *_tls_args(two), "--access-log", str(log))
    try:
        sans, got = h3_site(s.port, two["ca"], "a.test", [("/", "a.test"), ("/", "b.test")])
        assert sans == {"a.test"}
        assert (got[0][0], got[0][1].get("x-site"), got[0][2]) == (200, "a", _page("a"))
        assert got[1][0] == 421 and b"site B" not in got[1][2]
        sans, got = h3_site(s.port, two["ca"], "www.b.test",  # the wildcard certificate
                            [("/", "x.b.test"), ("/", "a.test"), ("/bold", "b.test:443")])
        assert sans == {"b.test", "*.b.test"}
        assert (got[0][0], got[0][1].get("x-site"), got[0][2]) == (200, "b", _page("b"))
        assert got[1][0] == 421 and b"site A" not in got[1][2]
        assert (got[2][0], got[2][1].get("location")) == (302, "/bnew")
        # no SNI, or a name no certificate holds: the first certificate; then :authority
        # chooses (no SNI), or the name no site holds answers from the first site
        sans, got = h3_site(s.port, two["ca"], None, [("/", "b.test")], verify=False)
        assert sans == {"a.test"} and got[0][1].get("x-site") == "b"
        sans, got = h3_site(s.port, two["ca"], "unknown.example", [("/", "unknown.example")],
                            verify=False)
        assert sans == {"a.test"} and got[0][1].get("x-site") == "a"
    finally:
        assert s.stop() == 0
    # site, request line, status (sorted: each worker writes its own lines once a second)
    lines = sorted(" ".join((x.split()[0], x.split('"')[1], x.split('"')[2].split()[0]))
                   for x in log.read_text().splitlines())
    assert lines == ["- GET / HTTP/3.0 421", "- GET / HTTP/3.0 421",
                     "a.test GET / HTTP/3.0 200", "a.test GET / HTTP/3.0 200",
                     "b.test GET / HTTP/3.0 200", "b.test GET / HTTP/3.0 200",
                     "b.test GET /bold HTTP/3.0 302"], lines


def test_h3_serves_each_site_its_acme_certificate(two, pebble, tmp_path):
    ca = pebble()
    s = acme_sites(two, ca, tmp_path / "state", "epoll", True)
    try:
        s.wait_for("HTTP/3 on udp 127.0.0.1:%d (answered once ACME has a certificate)" % s.port)
        root = sites_issued(s, ca, str(tmp_path / "root.pem"))
        for site, names in ACME_SITES.items():
            for name in names:  # verified against Pebble's root and by name, by aioquic
                sans, got = h3_site(s.port, root, name, [("/", name)])
                assert sans == set(names), name
                assert (got[0][0], got[0][1].get("x-site"), got[0][2]) == (200, site, _page(site))
        sans, got = h3_site(s.port, root, "a.test", [("/", "www.b.test")])
        assert got[0][0] == 421
    finally:
        assert s.stop() == 0


def test_0rtt_requests_answer_from_the_tickets_site(two):
    """A resumed connection's 0-RTT requests arrive before its handshake completes: they
    are answered from the SNI's site too, another site's :authority gets 421, and a ticket
    issued under one name does not resume a connection to another."""
    s = _start("epoll", *_site_args(two), *_tls_args(two))
    tickets = []

    async def run(sni: str, ticket, requests):
        config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name=sni,
                                   session_ticket=ticket)
        config.load_verify_locations(two["ca"])
        async with connect("127.0.0.1", s.port, configuration=config, create_protocol=_Client,
                           session_ticket_handler=tickets.append, wait_connected=False) as c:
            got = [(await c.request(p, authority=a))[0:3:2] for p, a in requests]
            return c._quic.tls.session_resumed, c._quic.tls.early_data_accepted, got
    try:
        first = asyncio.run(asyncio.wait_for(run("a.test", None, [("/", "a.test")]), 30))
        assert first[0] is False and first[2] == [(200, _page("a"))]
        for _ in range(100):
            if tickets:
                break
            asyncio.run(asyncio.sleep(0.02))
        again = asyncio.run(asyncio.wait_for(
            run("a.test", tickets[-1], [("/", "b.test"), ("/", "a.test")]), 30))
        assert again[:2] == (True, True), again
        assert again[2][0][0] == 421 and again[2][1] == (200, _page("a")), again[2]
        other = asyncio.run(asyncio.wait_for(run("www.b.test", tickets[0], [("/", "b.test")]), 30))
        assert other[0] is False and other[2] == [(200, _page("b"))]
    finally:
        assert s.stop() == 0



def test_a_ticket_offered_under_another_name_does_not_resume(two):
    """A ticket from a.test offered under the server name www.b.test, as a client that does
    not check the name would (aioquic checks it: the ticket's name is rewritten so that it
    offers it): each certificate's tickets are sealed with a key of its own (h3_quic.c), so
    the connection is not resumed and b's certificate is presented; the ticket offered to
    a.test again is resumed. The default engine (ngtcp2)."""
    import dataclasses
    s = _start("epoll", *_site_args(two), *_tls_args(two))
    tickets = []

    async def run(sni: str, ticket):
        config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name=sni,
                                   session_ticket=ticket)
        config.load_verify_locations(two["ca"])
        async with connect("127.0.0.1", s.port, configuration=config, create_protocol=_Client,
                           session_ticket_handler=tickets.append, wait_connected=True) as c:
            status = (await c.request("/", authority=sni))[0]
            return c._quic.tls.session_resumed, status

    try:
        assert asyncio.run(asyncio.wait_for(run("a.test", None), 30)) == (False, 200)
        for _ in range(100):
            if tickets:
                break
            asyncio.run(asyncio.sleep(0.02))
        elsewhere = dataclasses.replace(tickets[0], server_name="www.b.test")
        assert asyncio.run(asyncio.wait_for(run("www.b.test", elsewhere), 30)) == (False, 200)
        assert asyncio.run(asyncio.wait_for(run("a.test", tickets[0]), 30)) == (True, 200)
    finally:
        assert s.stop() == 0
