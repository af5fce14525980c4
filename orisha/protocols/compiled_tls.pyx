# cython: language_level=3
"""TLS driven from C: ``tls.py``'s ``Tls``/``TlsConnection`` with OpenSSL called directly.

Strategy: the same loop-body contract and the same behaviour as ``tls.py`` (its
Strategy is this module's too, step for step: the plain-HTTP 400, the handshake
and incomplete-record timeouts, close_notify, the flush after reads, ``_HIGH``
and ``_CHUNK``, FileRegions encrypted from the map, the graceful stop, ALPN h2,
``refuse``, the ACME TLS-ALPN-01 and SNI context choice, ``app.view(sni)``); only
the calls differ: one ``SSL*`` per connection over two BIOs in memory (its own: see
``_cipher_in``), and ``SSL_do_handshake``/``SSL_read``/``SSL_write`` called from C, with no Python
object per record and no exception per "want read". Once ALPN chose h2, the
decrypted bytes go to the compiled ``H2Connection`` and its output is taken from
it by C calls (``self.h2``: cimported from h2.pxd), not through ``H2Front``'s
Python properties; so this module loads only beside the compiled h2 (tls.py).

The ``SSL_CTX``s are this module's own (``Context``), made from the PEM bytes that
``tls.context`` read (``ctx.pem``) and the policy of that ``ssl.SSLContext``: its
options, minimum and maximum versions and ticket count, ``tls.TLS12_CIPHERS`` and ``tls.TLS13_SUITES`` (which the stdlib cannot set),
``tls.ALPN`` (or the ``ctx.alpn`` an ACME challenge context was given) — never
retyped here. ``tls.context`` stays the one checker of the files and its one-line
errors. Python's own ``SSL_CTX`` cannot be shared: once ``sni_callback`` is set
(``tls.by_names`` always sets it) CPython's servername callback reads
``SSL_get_app_data`` as its own socket object, which an ``SSL*`` made here is not.
So the context is chosen before OpenSSL sees the ClientHello, from
``tls.client_hello`` (SNI and ALPN) over the same buffering as ``tls.py``'s
``_chosen``, with the tables ``tls.by_names`` keeps on its first context
(``ctx.sni_names``); the only callback is ALPN's selection, in C. A ``Tls`` is
made where ``tls.Tls`` is, in the supervisor for each generation before it forks:
each ``SSL_CTX`` gets its ticket keys there, so every worker of a generation
resumes every session (TLS 1.3 tickets and TLS 1.2 ones), and a reload (SIGHUP,
a changed certificate file, ACME) makes new ones with the new certificates.
"""

from libc.string cimport memcmp
from libc.stdlib cimport malloc, free
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from cpython.list cimport PyList_GET_SIZE, PyList_GET_ITEM
from libc.string cimport memcpy
from cpython.pycapsule cimport PyCapsule_New

from ..loops cimport seam
from ..core.connection cimport c_clear  # list.clear in C (the core's helper)
from ..loops.seam cimport Calls, Kinds, ORISHA_CALLS, calls_of, kinds_init

from ..blob import FileRegion
from ..core.connection import Tail
from ..core.outgoing import consume
from ..core.policy import LINGER
from ..errors import ServeError
from .front import Plain, Sniffing, to_h2
from .h2 cimport H2Connection  # the compiled h2: tls.py loads this module only beside it
from . import tls as _tls  # the pure layer: constants, client_hello (it imports us at its end)

cdef Py_ssize_t _CHUNK = _tls.CHUNK
cdef Py_ssize_t _HIGH = _tls.HIGH
cdef object PLAIN_FIRST = frozenset(_tls.PLAIN_FIRST)
cdef bytes PLAIN_400_HEAD = _tls.PLAIN_400_HEAD
cdef bytes PLAIN_400_BODY = _tls.PLAIN_400_BODY
cdef bytes ACME_ALPN = _tls.ACME_ALPN.encode()
cdef int HANDSHAKE = 0, OPEN = 1, PLAIN = 2
# A connection's record buffers (~34 KB: one for reading, one for writing) stay while it is busy
# (SSL_MODE_RELEASE_BUFFERS, the stdlib's choice, frees and allocates both for every request:
# ~1.2k instructions of an HTTPS/1.1 request) and go once it has been idle this long, at its tick
# (about once a second): an idle keep-alive connection holds no more than with that mode.
cdef double _IDLE_BUFFERS = 1.0
cdef char _plain_buf[65536]  # one SSL_read's plaintext (at most _CHUNK), copied out at once
cdef char _gather_buf[65536]  # small outgoing items gathered for one SSL_write (at most _CHUNK)
assert _CHUNK <= 65536
cdef bytes H2 = b"h2"
# _QUEUE: SSL_get_error reads the thread's OpenSSL error queue, so OpenSSL asks for it to be
# empty before each SSL_read/SSL_write; ERR_clear_error() before every call cost ~840
# instructions each (two per HTTPS/1.1 request). The queue is kept empty instead: each
# failed OpenSSL call of this module is followed by ERR_clear_error() before it returns,
# and nothing else in a worker shares it (the stdlib's ssl and hashlib clear what they
# raise; aioquic's and ACME's cryptography bundles its own OpenSSL).
cdef Kinds _INNER  # the inner connection's kinds: the compiled core's HTTP/1.1 at C level
kinds_init(&_INNER, Plain)  # its HTTP/1.1 connections are Plain's (Sniffing's choice)


cdef struct Alpn:
    unsigned char *wire  # the server's list, RFC 7301 wire format, in preference order
    unsigned int size


cdef int _no_password(char *buf, int size, int rwflag, void *u) noexcept nogil:
    return 0  # an encrypted key was refused by tls.context already; never prompt


cdef int _select_alpn(SSL *s, const unsigned char **out, unsigned char *outlen,
                      const unsigned char *offered, unsigned int offered_len,
                      void *arg) noexcept nogil:
    """The server's preference first, as the stdlib's callback chooses; no overlap: no ALPN."""
    cdef Alpn *alpn = <Alpn *>arg
    if SSL_select_next_proto(<unsigned char **>out, outlen, alpn.wire, alpn.size, offered,
                             offered_len) == OPENSSL_NPN_NEGOTIATED:
        return SSL_TLSEXT_ERR_OK
    return SSL_TLSEXT_ERR_NOACK


cdef inline bint _span(object item, Py_buffer *view) except -1:
    """``item``'s bytes as ``view.buf`` and ``view.len``: a bytes object's own, nothing to
    release (False: heads and tails are bytes), any other buffer exported (True: release it)."""
    if type(item) is bytes:
        view.buf = PyBytes_AS_STRING(item)
        view.len = PyBytes_GET_SIZE(item)
        return False
    PyObject_GetBuffer(item, view, PyBUF_SIMPLE)
    return True


# The two BIOs of every SSL* are the connection itself (no memory BIO to grow zero-filled,
# poll with BIO_ctrl_pending and copy through, as ssl.MemoryBIO does): OpenSSL reads the
# received bytes where the loop body handed them over (``inbuf`` from ``inpos``: at its
# end, "want read"; after the peer's EOF, EOF), and each record it writes is appended to
# ``cipher`` as bytes at once. The write never refuses, so SSL_write and the handshake
# never "want write"; ``_HIGH`` bounds what waits for the socket.
cdef class TlsConnection  # defined below; its C fields are read by the BIO callbacks


cdef int _cipher_in(BIO *b, char *out, int n) noexcept:
    cdef TlsConnection t = <TlsConnection>BIO_get_data(b)
    cdef Py_ssize_t left = t.in_left()
    BIO_clear_retry_flags(b)
    if left == 0:
        if t.eof_in:
            return 0  # the peer's EOF (ssl.MemoryBIO.write_eof)
        BIO_set_retry_read(b)
        return -1
    if n > left:
        n = <int>left
    memcpy(out, PyBytes_AS_STRING(t.inbuf) + t.inpos, n)
    t.inpos += n
    return n


cdef long _cipher_in_ctrl(BIO *b, int cmd, long num, void *ptr) noexcept:
    cdef TlsConnection t = <TlsConnection>BIO_get_data(b)
    if cmd == BIO_CTRL_PENDING:
        return t.in_left()
    if cmd == BIO_CTRL_EOF:
        return t.eof_in and not t.in_left()
    return 1 if cmd == BIO_CTRL_FLUSH else 0


cdef int _cipher_out(BIO *b, const char *data, int n) noexcept:
    cdef TlsConnection t = <TlsConnection>BIO_get_data(b)
    try:
        t.cipher.append(PyBytes_FromStringAndSize(data, n))
    except MemoryError:
        return -1  # the SSL call fails: the connection breaks (``_broken``)
    t.cipher_bytes += n
    return n


cdef long _cipher_ctrl(BIO *b, int cmd, long num, void *ptr) noexcept nogil:
    return 1 if cmd == BIO_CTRL_FLUSH else 0  # nothing is buffered here; nothing else applies


cdef BIO_METHOD *_CIPHER_IN = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK,
                                           b"orisha received bytes")
cdef BIO_METHOD *_CIPHER_OUT = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK,
                                            b"orisha cipher list")
if _CIPHER_IN == NULL or _CIPHER_OUT == NULL or \
        not BIO_meth_set_read(_CIPHER_IN, _cipher_in) or \
        not BIO_meth_set_ctrl(_CIPHER_IN, _cipher_in_ctrl) or \
        not BIO_meth_set_write(_CIPHER_OUT, _cipher_out) or \
        not BIO_meth_set_ctrl(_CIPHER_OUT, _cipher_ctrl):
    raise MemoryError("BIO_meth_new")


cdef class Context:
    """One ``SSL_CTX`` made from an ``ssl.SSLContext`` of ``tls.context`` (see the Strategy)."""
    cdef SSL_CTX *ctx
    cdef Alpn alpn

    def __cinit__(self, py):
        cdef bytes wire = b"".join(bytes([len(p)]) + p.encode() for p in
                                   getattr(py, "alpn", _tls.ALPN))
        cdef bytes ciphers = _tls.TLS12_CIPHERS.encode(), suites = _tls.TLS13_SUITES.encode()
        cert_path, cert_pem, key_path, key_pem = py.pem
        self.ctx = SSL_CTX_new(TLS_server_method())
        if self.ctx == NULL:
            raise MemoryError("SSL_CTX_new")
        self.alpn.size = len(wire)
        self.alpn.wire = <unsigned char *>malloc(len(wire) or 1)
        if self.alpn.wire == NULL:
            raise MemoryError("ALPN list")
        for i in range(len(wire)):
            self.alpn.wire[i] = wire[i]
        ctx = self.ctx
        SSL_CTX_clear_options(ctx, <uint64_t>-1)  # exactly the options of the stdlib context
        SSL_CTX_set_options(ctx, <uint64_t>int(py.options))
        lo, hi = int(py.minimum_version), int(py.maximum_version)  # -2/-1: no bound (0)
        if not SSL_CTX_set_min_proto_version(ctx, lo if lo > 0 else 0) or \
                not SSL_CTX_set_max_proto_version(ctx, hi if hi > 0 else 0) or \
                not SSL_CTX_set_cipher_list(ctx, ciphers) or \
                not SSL_CTX_set_ciphersuites(ctx, suites):
            ERR_clear_error()
            raise ServeError(f"{cert_path}: OpenSSL refused the TLS policy of tls.py")
        SSL_CTX_set_num_tickets(ctx, py.num_tickets)
        SSL_CTX_set_session_id_context(ctx, <const unsigned char *>b"orisha", 6)
        SSL_CTX_set_alpn_select_cb(ctx, _select_alpn, &self.alpn)
        self._certificate(cert_path, cert_pem, key_path, key_pem)
        ERR_clear_error()

    cdef _certificate(self, str cert_path, bytes cert_pem, str key_path, bytes key_pem):
        """The chain (leaf first) and key, as SSL_CTX_use_certificate_chain_file reads them."""
        cdef BIO *bio = BIO_new_mem_buf(PyBytes_AS_STRING(cert_pem), len(cert_pem))
        cdef X509 *x = PEM_read_bio_X509_AUX(bio, NULL, _no_password, NULL)
        cdef EVP_PKEY *pkey
        cdef bint ok = x != NULL and SSL_CTX_use_certificate(self.ctx, x) == 1
        if x != NULL:
            X509_free(x)
        while ok:
            x = PEM_read_bio_X509(bio, NULL, _no_password, NULL)
            if x == NULL:
                break  # the end of the file (PEM_R_NO_START_LINE)
            if not SSL_CTX_add0_chain_cert(self.ctx, x):
                X509_free(x)
                ok = False
        BIO_free(bio)
        ERR_clear_error()
        if not ok:
            raise ServeError(f"{cert_path}: not a PEM certificate (chain)")
        bio = BIO_new_mem_buf(PyBytes_AS_STRING(key_pem), len(key_pem))
        pkey = PEM_read_bio_PrivateKey(bio, NULL, _no_password, NULL)
        BIO_free(bio)
        ok = pkey != NULL and SSL_CTX_use_PrivateKey(self.ctx, pkey) == 1 and \
            SSL_CTX_check_private_key(self.ctx) == 1
        if pkey != NULL:
            EVP_PKEY_free(pkey)
        ERR_clear_error()
        if not ok:
            raise ServeError(f"{key_path}: not a PEM private key matching {cert_path}")

    def __dealloc__(self):
        if self.ctx != NULL:
            SSL_CTX_free(self.ctx)  # connections still open hold their own reference
        free(self.alpn.wire)


class Tls:
    """``tls.Tls`` on this module's contexts: the same arguments, the same choices."""

    name = "https"

    def __init__(self, ctx, challenges=None) -> None:
        self.ctx = ctx
        self.challenges = challenges or {}
        made: dict = {}

        def own(py) -> Context:  # one SSL_CTX per stdlib context, however often it is named
            if id(py) not in made:
                made[id(py)] = (py, Context(py))
            return made[id(py)][1]

        self.first = own(ctx)
        pairs = getattr(ctx, "sni_pairs", None)  # tls.by_names: (names, context) and its rule
        self.record_sni = pairs is not None  # as tls.py: the SNI is kept where by_names ran
        self.pick = getattr(ctx, "sni_pick", None)
        for _names, c in pairs or ():
            own(c)
        self.acme = {n: own(c) for n, c in self.challenges.items()}
        self.chooses = bool(self.acme) or len(made) > 1
        self.contexts = made  # kept alive with the generation

    def choose(self, hello: bytes) -> Context:
        """The context for a ClientHello: ACME's challenge for a hello offering exactly
        ``acme-tls/1`` (``tls.Tls.choose``), else the SNI's (``tls.by_names``), else the first."""
        parsed = _tls.client_hello(hello)
        if parsed is None:
            return self.first
        name, alpn = parsed
        if alpn == [ACME_ALPN] and name in self.acme:
            return self.acme[name]
        if name and self.pick is not None:
            found = self.pick(name)
            if found is not None:
                return self.contexts[id(found)][1]
        return self.first

    def connect(self, app, now: float, peer: str, refuse: bool) -> "TlsConnection":
        return TlsConnection(app, self, now, peer, refuse)


cdef class TlsConnection:
    """One TLS connection; the loop-body contract of ``orisha/loops/base.py``."""
    cdef SSL *ssl
    cdef BIO *rbio
    cdef BIO *wbio
    cdef Context context
    cdef object port  # the Tls, while the ClientHello may still choose the context
    cdef bytes hello
    cdef public object app, inner
    cdef const Calls *calls  # the inner connection's contract at C level, or NULL (seam.pxd)
    cdef public list cipher
    cdef public Py_ssize_t cipher_bytes, region_pos
    cdef public double began, since
    cdef public int state
    cdef public bint refuse, should_close, shut_write, notified, fresh, stopping, ended
    cdef bint started, eof_in, record_sni
    cdef readonly bytes inbuf  # received, for OpenSSL to read from ``inpos`` (_cipher_in)
    cdef Py_ssize_t inpos
    cdef H2Connection h2  # ``inner.proto`` once ALPN chose h2: its methods called in C

    def __init__(self, app, port, double now, peer, bint refuse):
        self.app, self.refuse = app, refuse
        self.inner = Sniffing(app, now, peer)  # counted in ``app.open`` by the core
        self.cipher = []
        self.cipher_bytes = 0
        self.began = self.since = now
        self.state = HANDSHAKE
        self.region_pos = 0
        self.fresh = True
        self.hello = self.inbuf = b""
        self.inpos = 0
        self.record_sni = port.record_sni
        if port.chooses:
            self.port = port  # SSL_new once the ClientHello is whole (``_chosen``)
        else:
            self._new(port.first)

    cdef inline Py_ssize_t in_left(self) noexcept:
        return len(self.inbuf) - self.inpos

    cdef inline void _read_all(self) noexcept:
        """OpenSSL has read all that came: the bytes go (an idle connection keeps none)."""
        if self.inpos and self.inpos >= len(self.inbuf):
            self.inbuf = b""
            self.inpos = 0

    def __dealloc__(self):
        if self.ssl != NULL:
            SSL_free(self.ssl)  # and its BIOs

    cdef _new(self, Context context):
        self.context = context
        self.ssl = SSL_new(context.ctx)
        self.rbio = BIO_new(_CIPHER_IN)
        self.wbio = BIO_new(_CIPHER_OUT)
        if self.ssl == NULL or self.rbio == NULL or self.wbio == NULL:
            raise MemoryError("SSL_new")
        BIO_set_data(self.rbio, <void *>self)  # both freed with the SSL*, in __dealloc__
        BIO_set_data(self.wbio, <void *>self)
        BIO_set_init(self.rbio, 1)
        BIO_set_init(self.wbio, 1)
        SSL_set_bio(self.ssl, self.rbio, self.wbio)
        SSL_set_accept_state(self.ssl)
        SSL_set_mode(self.ssl, SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER | SSL_MODE_AUTO_RETRY)

    # -- the loop body's side of the contract ---------------------------------
    @property
    def outgoing(self):
        return self.cipher

    @property
    def wants_read(self):
        return self.reading()

    cdef bint reading(self) except -1:
        if self.cipher or self.should_close:
            return False
        return self.state != OPEN or self._reading()

    cpdef receive(self, bytes data, double now):
        if self.should_close:
            return
        if self.state == PLAIN:  # answered in plain text: drain until the peer's EOF
            if not data:
                self.should_close = True
            return
        if data:
            if not self.started:
                self.started = True
                if self._plain(data, now):
                    return
            if self.ssl == NULL:
                data = self._chosen(data)
                if not data:  # the rest of the ClientHello is on its way
                    return
            if self.inpos < len(self.inbuf):  # bytes OpenSSL has not read yet: keep them
                self.inbuf = self.inbuf[self.inpos:] + data
            else:
                self.inbuf = data
            self.inpos = 0
        else:
            if self.ssl == NULL:  # EOF before a whole ClientHello: nothing to answer
                self.state = PLAIN
                self.should_close = True
                return
            self.eof_in = True  # ssl.MemoryBIO.write_eof: read to the end, then EOF
        self.since = now
        if self.state == HANDSHAKE:
            self._handshake(now)
            self._read_all()
        if self.state == OPEN:
            self._work(now)

    cpdef sent(self, Py_ssize_t n, double now):
        self.since = now
        if n >= self.cipher_bytes:  # all written, the common case: no Python call
            c_clear(self.cipher)
            self.cipher_bytes = 0
        else:
            self.cipher_bytes = consume(self.cipher, self.cipher_bytes, n)
        if not self.cipher:
            if self.state == OPEN:
                self._work(now)
            elif self.state == PLAIN:
                self.shut_write = True

    def tick(self, double now):
        limits = self.app.limits
        if self.state == HANDSHAKE:
            if now - self.began > limits.head_timeout:  # a slow or silent handshake
                self.should_close = True
        elif self.state == PLAIN:
            if now - self.since > (limits.send_timeout if self.cipher else LINGER):
                self.should_close = True
        else:
            if self.in_left() and now - self.since > limits.head_timeout:
                self.should_close = True  # a record that never completes
                return
            if not self.cipher and now - self.since >= _IDLE_BUFFERS:
                SSL_free_buffers(self.ssl)  # refused (0) while a record is half read
            self.inner.tick(now)
            self._work(now)

    def shutdown(self, double now):
        """Graceful stop: as ``tls.TlsConnection.shutdown`` (a first request is answered)."""
        if self.state == HANDSHAKE or (self.state == OPEN and self.fresh):
            self.stopping = True
        elif self.state == OPEN:
            self.inner.shutdown(now)
            self._work(now)
        elif not self.cipher:
            self.should_close = True

    def close(self):
        self.inner.app = self.app  # from its SNI view: the connection is counted here
        self.inner.close()

    # -- steps -----------------------------------------------------------------
    cdef bint _plain(self, bytes data, double now):
        """A first read that is no TLS record (0x16: handshake) but an HTTP request line."""
        if data[0] not in PLAIN_FIRST:
            return False
        tails = self.app.tails(now)
        self.cipher.extend((PLAIN_400_HEAD, tails[Tail.CLOSE], PLAIN_400_BODY))
        self.cipher_bytes = sum(len(b) for b in self.cipher)
        self.state = PLAIN
        return True

    cdef bytes _chosen(self, bytes data):
        """Hold the first bytes until the ClientHello record is whole (at most one record),
        then make the SSL* on the context the hello chooses and hand them all on."""
        cdef bytes hello = self.hello + data
        self.hello = hello
        if len(hello) < 5 or len(hello) < min(5 + int.from_bytes(hello[3:5], "big"), 16389):
            return b""
        self._new(self.port.choose(hello))
        self.port, self.hello = None, b""
        return hello

    cdef _handshake(self, double now):
        cdef int r
        cdef const unsigned char *proto
        cdef unsigned int size = 0
        cdef const char *name
        ERR_clear_error()
        r = SSL_do_handshake(self.ssl)
        if r != 1:
            if SSL_get_error(self.ssl, r) == SSL_ERROR_WANT_READ:  # the client's next flight
                return  # (what OpenSSL wrote is in ``cipher`` already: _cipher_out)
            ERR_clear_error()  # a failed handshake: OpenSSL's alert goes out, then we close
            self._broken()
            return
        self.state = OPEN
        if self.app.hosts is not None:  # several sites: the SNI's site answers (or 421)
            name = SSL_get_servername(self.ssl, TLSEXT_NAMETYPE_host_name) \
                if self.record_sni else NULL
            self.inner.app = self.app.view(
                None if name == NULL else name.decode("ascii", "replace"))
        SSL_get0_alpn_selected(self.ssl, &proto, &size)
        if size == 2 and memcmp(proto, <const char *>H2, 2) == 0:
            to_h2(self.inner, now, refuse=self.refuse)
            self.h2 = self.inner.proto
        elif self.refuse:
            self.inner.refuse(now)

    cdef _work(self, double now):
        """Encrypt what the inner connection has, feed it what it wants, until neither moves."""
        cdef object inner = self.inner
        cdef int r, err
        cdef bytes data
        while True:
            self._encrypt(now)
            if self.state != OPEN:  # the session broke while writing
                return
            if not self._reading() or self._closing() or self.ended:
                break
            if not self.in_left() and not self.eof_in and not SSL_pending(self.ssl):
                break  # nothing buffered: skip a read that could only want more
            # No ERR_clear_error() first (OpenSSL's advice; ~840 instructions a call): the
            # thread's error queue is kept empty instead — every failed call of this module
            # clears it before it returns (see _QUEUE).
            r = SSL_read(self.ssl, _plain_buf, <int>_CHUNK)
            if r > 0:
                data = PyBytes_FromStringAndSize(_plain_buf, r)
            else:
                err = SSL_get_error(self.ssl, r)
                if err == SSL_ERROR_WANT_READ:  # no complete record buffered
                    break
                if err == SSL_ERROR_ZERO_RETURN or err == SSL_ERROR_SYSCALL or (
                        err == SSL_ERROR_SSL and
                        ERR_GET_REASON(ERR_peek_error()) == SSL_R_UNEXPECTED_EOF_WHILE_READING):
                    data = b""  # close_notify, or a bare EOF (ssl.SSLEOFError)
                    ERR_clear_error()
                else:  # a corrupt record: OpenSSL queued its alert; nothing to save
                    ERR_clear_error()
                    self._broken()
                    return
            if self.h2 is not None:
                self.h2.receive(data, now)
            else:
                seam.receive(self.calls, inner, data, now)
                if self.calls == NULL:  # Sniffing chose its class on this first read
                    self.calls = calls_of(&_INNER, inner)
            if self.fresh:
                self.fresh = False
                if self.stopping:  # answer this first request, then the stop proceeds
                    inner.shutdown(now)
            if not data:
                self.ended = True  # the peer's EOF reached the inner connection once
                self._encrypt(now)
                break
        # What OpenSSL wrote while reading (the no_renegotiation alert to a TLS 1.2
        # renegotiation, TLS 1.3 tickets and KeyUpdate) is in ``cipher`` already: it leaves
        # now, not with the next response.
        self._read_all()
        self._settle(now)

    # The inner connection's side of the contract: the HTTP/2 layer's own fields and
    # methods where ALPN chose h2, the compiled core's HTTP/1.1 connection through its
    # table (orisha/loops/seam.pxd): C calls both; else Python calls.
    cdef inline list _outgoing(self):
        return self.h2.out if self.h2 is not None else seam.outgoing(self.calls, self.inner)

    cdef inline bint _reading(self) except -1:
        return self.h2.reading() if self.h2 is not None else seam.wants_read(self.calls, self.inner)

    cdef inline bint _closing(self) except -1:
        return self.h2.should_close if self.h2 is not None else seam.should_close(self.calls, self.inner)

    cdef inline bint _shut(self) except -1:
        return self.h2.shut_write if self.h2 is not None else seam.shut_write(self.calls, self.inner)

    cdef inline _sent(self, Py_ssize_t n, double now):
        if self.h2 is not None:
            self.h2.sent(n, now)
        else:
            seam.sent(self.calls, self.inner, n, now)

    cdef _encrypt(self, double now):
        """As ``tls.TlsConnection._encrypt``, in C: a FileRegion's map in ``_CHUNK`` slices; a
        large item alone, at most ``_CHUNK``; small items gathered into one record's
        plaintext (``_gather_buf``) — no slice, list or joined bytes per response."""
        cdef list out = self._outgoing()
        cdef Py_buffer view
        cdef Py_ssize_t pos, size, i, n
        cdef object first, item
        cdef bint ok, held, fits
        while out and self.cipher_bytes < _HIGH:
            first = out[0]
            if type(first) is FileRegion:  # encrypted from its map (no kTLS: see the
                pos = self.region_pos      # Strategy); reported whole, as the seam says
                PyObject_GetBuffer(first.view, &view, PyBUF_SIMPLE)
                size = min(view.len - pos, _CHUNK)
                ok = self._write(<char *>view.buf + pos, size)
                PyBuffer_Release(&view)
                if not ok:
                    return
                pos += size
                self.region_pos = 0 if pos >= first.length else pos
                self._sent(first.length if pos >= first.length else 0, now)
                out = self._outgoing()
                continue
            held = _span(first, &view)
            n = PyList_GET_SIZE(out)
            if view.len >= _CHUNK or n == 1:
                size = min(view.len, _CHUNK)
                ok = self._write(<char *>view.buf, size)
                if held:
                    PyBuffer_Release(&view)
            else:
                size = view.len
                memcpy(_gather_buf, view.buf, size)
                if held:
                    PyBuffer_Release(&view)
                for i in range(1, n):
                    item = <object>PyList_GET_ITEM(out, i)
                    if type(item) is FileRegion:
                        break
                    held = _span(item, &view)
                    fits = size + view.len <= _CHUNK
                    if fits:
                        memcpy(_gather_buf + size, view.buf, view.len)
                        size += view.len
                    if held:
                        PyBuffer_Release(&view)
                    if not fits:
                        break
                ok = self._write(_gather_buf, size)
            if not ok:
                return
            self._sent(size, now)
            out = self._outgoing()

    cdef bint _write(self, const char *buf, Py_ssize_t size) except -1:
        cdef int r
        if size == 0:
            return True
        r = SSL_write(self.ssl, buf, <int>size)  # no ERR_clear_error() first: see _QUEUE
        if r <= 0:  # the session is over (a peer's bare EOF, a fatal alert)
            ERR_clear_error()
            self._broken()
            return False
        return True

    cdef _broken(self):
        """The session can carry no more records: what is encrypted goes out (OpenSSL's
        alert, if any: in ``cipher`` already), then input drains until EOF and the
        connection closes."""
        self.state = PLAIN
        self.should_close = not self.cipher

    cdef _settle(self, double now):
        """The inner connection is done: close_notify, then close or linger once it is out."""
        if self._outgoing() or not (self._closing() or self._shut()):
            return
        if not self.notified:
            self.notified = True
            ERR_clear_error()
            SSL_shutdown(self.ssl)  # queues close_notify (RFC 8446 §6.1); the peer's is not awaited
            ERR_clear_error()
        if not self.cipher:
            if self._closing():
                self.should_close = True
            else:
                self.shut_write = True


# -- the contract at C level for the compiled loop bodies (orisha/loops/seam.pxd) -----------
cdef int _receive(object c, bytes data, double now) except -1:
    (<TlsConnection>c).receive(data, now)
    return 0

cdef int _sent(object c, Py_ssize_t n, double now) except -1:
    (<TlsConnection>c).sent(n, now)
    return 0

cdef list _outgoing(object c):
    return (<TlsConnection>c).cipher

cdef bint _wants_read(object c) except -1:
    return (<TlsConnection>c).reading()

cdef bint _should_close(object c) except -1:
    return (<TlsConnection>c).should_close

cdef bint _shut_write(object c) except -1:
    return (<TlsConnection>c).shut_write

cdef Calls _CALLS
_CALLS.receive, _CALLS.sent, _CALLS.outgoing = _receive, _sent, _outgoing
_CALLS.wants_read, _CALLS.should_close, _CALLS.shut_write = _wants_read, _should_close, _shut_write
# The compiled loop bodies call a TlsConnection's contract through this table; the pure
# bodies through its Python names.
Tls.calls = PyCapsule_New(&_CALLS, ORISHA_CALLS, NULL)
Tls.connection_type = TlsConnection
