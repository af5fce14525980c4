"""TLS 1.3 and 1.2 as a Connection around the plaintext protocols, sans-I/O.

Strategy: the stdlib's ``ssl.SSLObject`` over two ``MemoryBIO``s does the
handshake and the records; this module only moves bytes between the loop
body's contract (ciphertext) and an inner connection (plaintext), which is a
``front.Sniffing`` connection: ALPN "h2" switches it to HTTP/2 (RFC 9113
§3.2), anything else leaves it HTTP/1.1 (or h2 with prior knowledge). The loop
bodies never learn about TLS: they read and write ciphertext as before, io_uring
included.

Output: the inner connection's buffers are encrypted as they appear, a chunk
of up to ``CHUNK`` bytes per ``SSLObject.write`` (small heads and bodies are
joined so one response is one record), and reported to it as sent at once; at
most ``HIGH`` bytes of ciphertext wait for the socket, so a large body is
encrypted as the client reads it, never whole. Input: plaintext is read from
the TLS object only while the inner connection wants input — its backpressure
reaches the socket unchanged.

Ends: when the inner connection closes or lingers, a close_notify is sent
first. A handshake must finish within ``Limits.head_timeout`` (slow or silent
handshakes); a record left incomplete that long is dropped the same way; a
peer's EOF without close_notify (a truncated stream, ``SSLEOFError``) is an EOF
for the inner connection, which then answers what it has and closes; a corrupt
record (bad MAC, overflow) closes at once after OpenSSL's alert. A plain HTTP
request on the TLS port gets a plain 400, as nginx answers it, and a close.

kTLS (``probe_ktls``): Linux can encrypt in the kernel (``OP_ENABLE_KTLS``,
Python ≥ 3.12, OpenSSL 3 and the "tls" ULP). OpenSSL only turns it on for a
socket BIO it owns, and here the loop bodies own the sockets and TLS runs over
memory BIOs, so the probe states why kTLS is not in use; user-space TLS over
memory BIOs is the path that always works, on every loop body and kernel.

Layers: this module is the pure one and the specification. Where setup.py built
``compiled_tls.pyx``, ``Tls`` is that module's (chosen once, at the end of this
file; ``ORISHA_PURE=1`` keeps this one): the same contract and behaviour with
OpenSSL called from C over its own contexts, which it makes from what ``context``
read and set (``ctx.pem``, the options, versions and tickets; ``by_names`` leaves
its tables on the first context, ``sni_names``). ``LAYER`` says which serves.
"""

from __future__ import annotations

import ssl
import sys

from ..blob import FileRegion
from ..core.connection import Tail
from ..errors import ServeError
from .front import Sniffing, to_h2
from ..core.outgoing import consume
from ..core.policy import LINGER

CHUNK = 64 * 1024     # plaintext per SSLObject.write (OpenSSL cuts it into 16 KiB records)
HIGH = 256 * 1024     # ciphertext queued ahead of the socket
# A plain HTTP request on the TLS port: its first byte is an uppercase method letter, never
# a TLS record's content type (0x14-0x18); the answer is nginx's 400, its Date and
# "Connection: close" lines between head and body (App.tails). The unikernel's TLS glue
# takes these from the build (orisha/targets/unikernel/policy_header.py), not a C copy.
PLAIN_FIRST = range(0x41, 0x5B)
PLAIN_400_BODY = b"The plain HTTP request was sent to HTTPS port\n"  # nginx's words
PLAIN_400_HEAD = (b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
                  b"Content-Length: %d\r\n" % len(PLAIN_400_BODY))
ALPN = ("h2", "http/1.1")
# RFC 9113 §9.2.2: HTTP/2 over TLS 1.2 needs ephemeral key exchange and an AEAD cipher.
# The server's order is Mozilla's "intermediate" one: AES-128-GCM first (10 AES rounds and
# SHA-256, where OpenSSL's own order by strength put AES-256-GCM-SHA384 first), ChaCha20
# raised to the top for a client that asks for it first (OP_PRIORITIZE_CHACHA: phones
# without AES instructions).
TLS12_CIPHERS = ("ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-RSA-AES128-GCM-SHA256:"
                  "ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-RSA-AES256-GCM-SHA384:"
                  "ECDHE-ECDSA-CHACHA20-POLY1305:ECDHE-RSA-CHACHA20-POLY1305")
# TLS 1.3's suites in the same order. The stdlib has no call for them (SSL_CTX_set_ciphersuites),
# so only the compiled layer applies it; the pure layer keeps OpenSSL's default order.
TLS13_SUITES = "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256"
_OP_PRIORITIZE_CHACHA = 1 << 21  # SSL_OP_PRIORITIZE_CHACHA (openssl/ssl.h); no ssl.OP_ name
VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
ULP = "/proc/sys/net/ipv4/tcp_available_ulp"  # the kernel's TCP upper-layer protocols ("tls")


def context(cert: str, key: str, minimum: str = "1.2") -> ssl.SSLContext:
    """A server context for CERT (PEM, chain allowed) and KEY; a bad file is a ServeError."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = VERSIONS[minimum]
    ctx.set_ciphers(TLS12_CIPHERS)
    ctx.set_alpn_protocols(list(ALPN))
    # §9.2.1: no renegotiation; compression is off by default in OpenSSL 3.
    ctx.options |= ssl.OP_NO_RENEGOTIATION | ssl.OP_NO_COMPRESSION
    # The server's order (the stdlib's default, OP_CIPHER_SERVER_PREFERENCE; testssl.sh rates
    # a server without one HIGH), AES-128-GCM first: with OpenSSL's order by strength,
    # AES-256-GCM-SHA384 cost ~0.36M more instructions of SHA-384 per handshake than nginx's
    # SHA-256 (callgrind), and 14 AES rounds, not 10. ChaCha20 for clients that put it first.
    ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE | _OP_PRIORITIZE_CHACHA
    ctx.num_tickets = 2  # TLS 1.3 session tickets (resumption); 1.2 tickets are on by default
    pem = []
    for path, what in ((cert, "certificate"), (key, "key")):
        try:
            with open(path, "rb") as f:
                pem += [path, f.read()]
        except OSError as e:
            raise ServeError(f"{path}: cannot read the TLS {what} ({e.strerror})") from None
    try:
        ctx.load_verify_locations(cafile=cert)  # parses every certificate in the file
    except ssl.SSLError:
        raise ServeError(f"{cert}: not a PEM certificate (chain)") from None
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as e:
        why = f"does not match the certificate {cert}" if "MISMATCH" in str(e).upper() else \
            "not a PEM private key (or an encrypted one)"
        raise ServeError(f"{key}: {why}") from None
    ctx.pem = tuple(pem)  # (cert, its bytes, key, its bytes): compiled_tls makes its SSL_CTX
    return ctx


def names(cert: str) -> tuple[str, ...]:
    """The DNS names of the certificate file's first (leaf) certificate: its subjectAltName,
    else its CN, in lower case. ``ssl._ssl._test_decode_cert`` is the stdlib's only reader
    of a certificate that is not a peer's (``SSLContext.get_ca_certs`` lists CA ones only);
    ``context`` has already checked the file."""
    leaf = ssl._ssl._test_decode_cert(cert)
    sans = [v.lower() for k, v in leaf.get("subjectAltName", ()) if k == "DNS"]
    return tuple(sans or [v.lower() for rdn in leaf.get("subject", ()) for k, v in rdn
                          if k == "commonName"])


def by_sni(pairs: list[tuple[str, ssl.SSLContext]]) -> ssl.SSLContext:
    """``by_names`` for certificate files: each context under its leaf's names (``names``).
    ``pairs``: (certificate file, its context), in command-line order."""
    return by_names([(names(cert), ctx) for cert, ctx in pairs])


def by_names(pairs) -> ssl.SSLContext:
    """One context for several certificates: the first, whose ``sni_callback`` moves each
    handshake to the context whose names match the client's SNI (RFC 6066 §3) — an exact
    name before a wildcard (one label, RFC 6125 §6.4.3), the first certificate when the
    name is absent or unknown. The name is kept on the SSLObject (``sni``) for the site.
    ``pairs``: (the certificate's DNS names, its context), in command-line order (ACME's
    certificates have no file until issued: their names are the ones ordered)."""
    first = pairs[0][1]
    # Installed for one certificate too: the SNI it records is what keeps a server of
    # several sites from answering another site's name over it (``App.view``: 421).
    pick = by_server_name(pairs)
    first.sni_pairs, first.sni_pick = pairs, pick  # the same choice in C (compiled_tls: no callback)

    def choose(sslobj, server_name, _ctx):
        sslobj.sni = server_name
        # A context swapped in from the raw ClientHello (``Tls.choose``: an ACME TLS-ALPN-01
        # challenge) stays: OpenSSL still calls the first context's callback after the swap.
        if server_name and sslobj.context is first:
            ctx = pick(server_name)
            if ctx is not None and ctx is not first:
                sslobj.context = ctx
        return None  # go on with the handshake
    first.sni_callback = choose
    return first


def by_server_name(pairs):
    """server name → the item of the first of ``pairs`` (DNS names, item) whose names match
    it — an exact name before a wildcard (one label, RFC 6125 §6.4.3), case and a trailing
    dot aside — or None. The one rule for every certificate choice (here, and over QUIC:
    orisha/protocols/compiled_h3.pyx)."""
    exact: dict[str, object] = {}
    wild: dict[str, object] = {}
    for cert_names, item in pairs:
        for name in cert_names:
            name = name.lower()
            table, key = (wild, name[2:]) if name.startswith("*.") else (exact, name)
            table.setdefault(key, item)

    def pick(server_name: str):
        name = server_name.lower().rstrip(".")
        found = exact.get(name)
        return found if found is not None else wild.get(name.partition(".")[2])
    return pick


def probe_ktls() -> str:
    """Why the kernel does not encrypt here (see the Strategy): the reason, always given."""
    if not hasattr(ssl, "OP_ENABLE_KTLS"):
        return (f"kTLS off: Python {sys.version_info[0]}.{sys.version_info[1]} has no "
                "ssl.OP_ENABLE_KTLS (3.12+)")
    try:
        with open(ULP) as f:
            ulps = f.read().split()
    except OSError:
        return f"kTLS off: no {ULP} (not Linux)"
    if "tls" not in ulps:
        return f"kTLS off: the kernel offers no 'tls' ULP (has: {' '.join(ulps) or 'none'})"
    return "kTLS off: TLS runs over in-memory BIOs (OpenSSL enables kTLS on socket BIOs only)"


ACME_ALPN = "acme-tls/1"  # RFC 8737 §6.2: the validator offers this protocol alone


def client_hello(data: bytes) -> tuple[str | None, list[bytes]] | None:
    """(server name, ALPN protocols offered) of the ClientHello at the start of ``data``
    (RFC 8446 §4.1.2, §4.2; SNI: RFC 6066 §3; ALPN: RFC 7301 §3.1), or None when ``data``
    holds no complete one (the caller then uses its default context)."""
    try:
        if data[0] != 0x16 or data[5] != 1:  # handshake record, client_hello message
            return None
        end = min(len(data), 5 + int.from_bytes(data[3:5], "big"))
        i = 9 + 2 + 32  # record and handshake headers, legacy_version, random
        i += 1 + data[i]  # legacy_session_id
        i += 2 + int.from_bytes(data[i:i + 2], "big")  # cipher_suites
        i += 1 + data[i]  # legacy_compression_methods
        stop = min(end, i + 2 + int.from_bytes(data[i:i + 2], "big"))
        i += 2
        name, alpn = None, []
        while i + 4 <= stop:
            kind, size = int.from_bytes(data[i:i + 2], "big"), int.from_bytes(data[i + 2:i + 4], "big")
            ext = data[i + 4:i + 4 + size]
            if kind == 0 and len(ext) > 5 and ext[2] == 0:  # server_name: host_name
                name = ext[5:5 + int.from_bytes(ext[3:5], "big")].decode("ascii").lower()
            elif kind == 16:  # application_layer_protocol_negotiation
                j = 2
                while j < len(ext):
                    alpn.append(ext[j + 1:j + 1 + ext[j]])
                    j += 1 + ext[j]
            i += 4 + size
        return name, alpn
    except (IndexError, UnicodeDecodeError):  # truncated or not ASCII: OpenSSL will judge it
        return None


class Tls:
    """The TLS port: every connection is a ``TlsConnection`` over one shared context
    (one set of session-ticket keys, so any worker resumes any session).

    ``challenges``: server name → the context that presents that name's ACME TLS-ALPN-01
    certificate (RFC 8737), chosen by ``choose`` from the raw ClientHello, before OpenSSL
    sees it, only for a hello that offers exactly ``acme-tls/1``: the SNI callback runs
    before ALPN is known, so the stdlib cannot decide it later. More certificates by
    server name (several sites) fit the same place: ``choose`` maps a hello to a context.
    """

    name = "https"

    def __init__(self, ctx: ssl.SSLContext,
                 challenges: dict[str, ssl.SSLContext] | None = None) -> None:
        self.ctx = ctx
        self.challenges = challenges or {}
        self.chooser = self.choose if self.challenges else None  # no parse when nothing to choose

    def choose(self, hello: bytes) -> ssl.SSLContext | None:
        parsed = client_hello(hello)
        if parsed is not None and parsed[1] == [ACME_ALPN.encode()]:
            return self.challenges.get(parsed[0])
        return None

    def connect(self, app, now: float, peer: str, refuse: bool) -> "TlsConnection":
        conn = TlsConnection(app, self.ctx, now, peer, refuse)
        conn.choose = self.chooser
        return conn


class TlsConnection:
    """One TLS connection; the loop-body contract of ``orisha/loops/base.py``."""

    __slots__ = ("app", "tls", "rbio", "wbio", "inner", "cipher", "cipher_bytes", "began",
                 "since", "state", "refuse", "should_close", "shut_write", "notified", "region_pos",
                 "fresh", "stopping", "ended", "choose", "hello")
    HANDSHAKE, OPEN, PLAIN = 0, 1, 2

    def __init__(self, app, ctx: ssl.SSLContext, now: float, peer: str, refuse: bool) -> None:
        self.app, self.refuse = app, refuse
        self.rbio, self.wbio = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = ctx.wrap_bio(self.rbio, self.wbio, server_side=True)
        self.inner = Sniffing(app, now, peer)  # counted in ``app.open`` by the core
        self.cipher: list = []
        self.cipher_bytes = 0
        self.began = self.since = now
        self.state = self.HANDSHAKE
        self.should_close = self.shut_write = self.notified = False
        self.region_pos = 0  # bytes of the inner connection's first FileRegion already encrypted
        self.fresh = True  # no plaintext yet: the client's first request may be on its way
        self.stopping = False  # a graceful stop waits for that first request (see ``shutdown``)
        self.ended = False
        self.choose = None  # ``Tls.choose`` when the context depends on the ClientHello
        self.hello = b""  # the ClientHello's first bytes while they arrive (``choose``)

    # -- the loop body's side of the contract ---------------------------------
    @property
    def outgoing(self) -> list:
        return self.cipher

    @property
    def wants_read(self) -> bool:
        if self.cipher or self.should_close:
            return False
        return self.state != self.OPEN or self.inner.wants_read

    def receive(self, data: bytes, now: float) -> None:
        if self.should_close:
            return
        if self.state == self.PLAIN:  # answered in plain text: drain until the peer's EOF
            if not data:
                self.should_close = True
            return
        if data:
            if self.state == self.HANDSHAKE and not self.rbio.pending and self._plain(data, now):
                return
            if self.choose is not None:
                data = self._chosen(data)
                if not data:  # the rest of the ClientHello is on its way
                    return
            self.rbio.write(data)
        else:
            self.rbio.write_eof()
        self.since = now
        if self.state == self.HANDSHAKE:
            self._handshake(now)
        if self.state == self.OPEN:
            self._work(now)

    def sent(self, n: int, now: float) -> None:
        self.since = now
        self.cipher_bytes = consume(self.cipher, self.cipher_bytes, n)
        if not self.cipher:
            if self.state == self.OPEN:
                self._work(now)
            elif self.state == self.PLAIN:
                self.shut_write = True

    def tick(self, now: float) -> None:
        limits = self.app.limits
        if self.state == self.HANDSHAKE:
            if now - self.began > limits.head_timeout:  # a slow or silent handshake
                self.should_close = True
        elif self.state == self.PLAIN:
            if now - self.since > (limits.send_timeout if self.cipher else LINGER):
                self.should_close = True
        else:
            if self.rbio.pending and now - self.since > limits.head_timeout:
                self.should_close = True  # a record that never completes
                return
            self.inner.tick(now)
            self._work(now)

    def shutdown(self, now: float) -> None:
        """Graceful stop. A connection still in its handshake, or past it with no request yet,
        is not idle the way a kept-alive one is: the client paid for the handshake and its
        first request is on its way, so that request is answered first (a reload must not
        fail it); the head timeout and the loop's grace still bound the wait."""
        if self.state == self.HANDSHAKE or (self.state == self.OPEN and self.fresh):
            self.stopping = True
        elif self.state == self.OPEN:
            self.inner.shutdown(now)
            self._work(now)
        elif not self.cipher:
            self.should_close = True

    def close(self) -> None:
        self.inner.app = self.app  # from its SNI view: the connection is counted here
        self.inner.close()

    # -- steps -----------------------------------------------------------------
    def _plain(self, data: bytes, now: float) -> bool:
        """A first read that is no TLS record (0x16: handshake) but an HTTP request line."""
        if data[0] not in PLAIN_FIRST:  # a record (0x16: handshake) or junk for OpenSSL
            return False
        tails = self.app.tails(now)
        self.cipher.extend((PLAIN_400_HEAD, tails[Tail.CLOSE], PLAIN_400_BODY))
        self.cipher_bytes = sum(len(b) for b in self.cipher)
        self.state = self.PLAIN
        return True

    def _chosen(self, data: bytes) -> bytes:
        """Hold the first bytes until the ClientHello record is whole (at most one record),
        then swap in the context ``choose`` gives, if any, and hand them all on."""
        hello = self.hello = self.hello + data
        if len(hello) < 5 or len(hello) < min(5 + int.from_bytes(hello[3:5], "big"), 16389):
            return b""
        ctx = self.choose(hello)
        if ctx is not None:
            self.tls.context = ctx  # SSL_set_SSL_CTX before the handshake: its certificate, ALPN
        self.choose, self.hello = None, b""
        return hello

    def _flush_tls(self) -> None:
        data = self.wbio.read()
        if data:
            self.cipher.append(data)
            self.cipher_bytes += len(data)

    def _handshake(self, now: float) -> None:
        try:
            self.tls.do_handshake()
        except ssl.SSLWantReadError:  # needs the client's next flight
            self._flush_tls()
            return
        except ssl.SSLError:  # a failed handshake: OpenSSL's alert goes out, then we close
            self._broken()
            return
        self._flush_tls()
        self.state = self.OPEN
        if self.app.hosts is not None:  # several sites: the SNI's site answers (or 421)
            self.inner.app = self.app.view(getattr(self.tls, "sni", None))
        if self.tls.selected_alpn_protocol() == "h2":
            to_h2(self.inner, now, refuse=self.refuse)
        elif self.refuse:
            self.inner.refuse(now)

    def _work(self, now: float) -> None:
        """Encrypt what the inner connection has, feed it what it wants, until neither moves."""
        inner, tls = self.inner, self.tls
        while True:
            self._encrypt(now)
            if self.state != self.OPEN:  # the session broke while writing
                return
            if not inner.wants_read or inner.should_close or self.ended:
                break
            if not self.rbio.pending and not self.rbio.eof and not tls.pending():
                break  # nothing buffered: skip a read that could only raise SSLWantReadError
            try:
                data = tls.read(CHUNK)
            except ssl.SSLWantReadError:  # no complete record buffered
                break
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):  # close_notify, or a bare EOF
                data = b""
            except ssl.SSLError:  # a corrupt record: OpenSSL queued its alert; nothing to save
                self._broken()
                return
            inner.receive(data, now)
            if self.fresh:
                self.fresh = False
                if self.stopping:  # answer this first request, then the stop proceeds
                    inner.shutdown(now)
            if not data:
                self.ended = True  # the peer's EOF reached the inner connection once
                self._encrypt(now)
                break
        # What OpenSSL wrote while reading leaves now, not with the next response: the
        # no_renegotiation alert to a TLS 1.2 renegotiation, TLS 1.3 tickets and KeyUpdate.
        self._flush_tls()
        self._settle(now)

    def _encrypt(self, now: float) -> None:
        inner = self.inner
        out = inner.outgoing
        while out and self.cipher_bytes < HIGH:
            first = out[0]
            if first.__class__ is FileRegion:  # encrypted from its map (no kTLS: see the
                pos = self.region_pos          # Strategy); reported whole, as the seam says
                chunk = first.view[pos:pos + CHUNK]
                if not self._write(chunk):
                    return
                self._flush_tls()
                pos += len(chunk)
                self.region_pos = 0 if pos >= first.length else pos
                inner.sent(first.length if pos >= first.length else 0, now)
                out = inner.outgoing
                continue
            if len(first) >= CHUNK:
                chunk = memoryview(first)[:CHUNK]
            else:
                parts, size = [first], len(first)
                for b in out[1:]:
                    if b.__class__ is FileRegion or size + len(b) > CHUNK:
                        break
                    parts.append(b)
                    size += len(b)
                chunk = first if len(parts) == 1 else b"".join(parts)
            if not self._write(chunk):
                return
            self._flush_tls()
            inner.sent(len(chunk), now)
            out = inner.outgoing

    def _write(self, chunk) -> bool:
        try:
            self.tls.write(chunk)
        except ssl.SSLError:  # the session is over (a peer's bare EOF, a fatal alert)
            self._broken()
            return False
        return True

    def _broken(self) -> None:
        """The session can carry no more records: what is encrypted goes out (OpenSSL's
        alert, if any), then input drains until EOF and the connection closes."""
        self._flush_tls()
        self.state = self.PLAIN
        self.should_close = not self.cipher

    def _settle(self, now: float) -> None:
        """The inner connection is done: close_notify, then close or linger once it is out."""
        inner = self.inner
        if inner.outgoing or not (inner.should_close or inner.shut_write):
            return
        if not self.notified:
            self.notified = True
            try:
                self.tls.unwrap()  # queues close_notify (RFC 8446 §6.1)
            except (ssl.SSLWantReadError, ssl.SSLError):  # the peer's close_notify is not awaited
                pass
            self._flush_tls()
        if not self.cipher:
            if inner.should_close:
                self.should_close = True
            else:
                self.shut_write = True


# The layer, chosen once: compiled_tls.pyx (OpenSSL driven from C, built by setup.py where
# Cython, a compiler and libssl-dev are there) replaces ``Tls`` above, unless ORISHA_PURE asks
# for the pure modules (orisha/compiled.py); ``PureTls`` stays the specification.
PureTls = Tls
LAYER = "pure"


def _compiled_layer() -> None:
    global Tls, LAYER
    import importlib.util
    from ..compiled import pure
    if pure() or importlib.util.find_spec("orisha.protocols.compiled_tls") is None:
        return
    from ..core import connection  # the layer calls the compiled core at C level (seam.pxd)
    if connection.__file__.endswith(".py"):
        return
    from . import h2
    if h2.__file__.endswith(".py"):  # compiled_tls calls the compiled h2's methods in C
        print("orisha: the compiled TLS layer needs the compiled HTTP/2 layer; using "
              "ssl.SSLObject", file=sys.stderr)
        return
    try:
        from .compiled_tls import Tls as compiled  # imports this module's names back
    except ImportError as e:  # built against another Python or libssl: the pure layer
        print(f"orisha: the compiled TLS layer does not load ({e}); using ssl.SSLObject",
              file=sys.stderr)
        return
    Tls, LAYER = compiled, "compiled"


_compiled_layer()
