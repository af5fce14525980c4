# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""HTTP/3 on ngtcp2: the endpoint of the datagram seam (``loops/base.py``) over h3_quic.c.

Strategy: ``h3_quic.c`` is QUIC (ngtcp2, GnuTLS) and HTTP/3's framing in plain C; this
wrapper is its host in a worker, the datagram side of the loop seam: a batch of datagrams
in, ``outgoing`` out, one timer, ``tick``, ``shutdown``. It routes a datagram to its
connection by the destination connection ID (a dict of the IDs each connection was given:
the C side draws none itself, ``_on_cid`` does, through the worker's ``Steer`` when there
is one, so every ID names its worker). A request is answered as h2.py answers one: its
fields become the synthetic HTTP/1.1 head (``fields.synthetic_head``), ``App.plans`` /
``App.plan`` give the Plan (the core's one answer), the build's QPACK section and a Date
literal make the HEADERS frame — never encoded anew: no dynamic table, so the same bytes on
every connection — and the body goes by reference, never copied; a 200 whose Link preloads
is preceded by a 103 Early Hints (RFC 8297; ``Sections.early``). It holds the time limits
HTTP/1.1 and HTTP/2 have. Python runs per request and per connection's start and end;
packets, acknowledgements, loss and pacing never leave C. Over ``--max-connections`` a
new Initial is dropped (the client keeps the TCP connection Alt-Svc came from). Retry
(``--quic-retry``, and past ``RETRY_ABOVE`` handshakes in progress) and its stateless
tokens are ngtcp2's, keyed per worker (the Retry's ID names the worker, so the token
comes back to it); session tickets and 0-RTT are GnuTLS's, sealed with a key every worker
shares (``tickets``), with 425 for an early request of an unsafe method. The certificate
is chosen by the ClientHello's server name with ``tls.by_server_name``, the rule TLS over
TCP uses, and the connection answers from ``App.view(sni)`` (421 for another site's
:authority). Graceful stop: GOAWAY on the control stream (RFC 9114 §5.2), then
CONNECTION_CLOSE with H3_NO_ERROR once every response is acknowledged.

Reloads (``quic_steer.py``): a datagram of an unknown connection whose ID names another
worker goes to ``forward`` instead of being dropped, so the draining generation, which
shares each UDP socket with the new one, keeps every datagram of its connections; a
stopping worker hands new clients' Initials to its successor. A datagram of a connection
no worker knows is dropped and counted (``strays``), never answered.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.ref cimport PyObject
from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy

import heapq
import itertools
import os
import sys
import traceback

from ..blob import FileRegion
from ..core.connection import log_line
from ..core.policy import TOO_EARLY, Stat
from ..errors import ServeError
from .fields import FRAME_HEADS, H3_HANDSHAKE_HOLD, H3_MAX_STREAMS, H3_RETRY_LIFETIME, \
    H3_WINDOW, RETRY_ABOVE, declared_length, error_plan, refused_early, request_fields_error, \
    synthetic_head
from .qpack_blocks import Sections, date_field
from .tls import by_server_name
from .fields import PerSecond

cdef extern from *:
    """
    #include <dlfcn.h>
    #include <stdio.h>
    /* ngtcp2 and nghttp3 are linked in from Debian's static archives (setup.py), built as
     * position-independent executables' code: their debug printers name libc's stderr
     * PC-relatively, which no shared object may do with another object's variable. This
     * module's own stderr, hidden, takes those references; it is libc's stream, copied when
     * the module is loaded. */
    __attribute__((visibility("hidden"))) FILE *stderr;
    __attribute__((constructor)) static void orisha_h3_stderr(void) {
        FILE **libc_stderr = dlsym(RTLD_DEFAULT, "stderr");
        stderr = libc_stderr ? *libc_stderr : NULL;
    }
    """

cdef extern from "<sys/socket.h>":
    ctypedef unsigned int socklen_t
    struct sockaddr:
        unsigned short sa_family
    struct sockaddr_storage:
        pass

cdef extern from *:
    """
    #include <arpa/inet.h>
    #include <netinet/in.h>
    #include <string.h>
    /* A numeric address and port as a sockaddr (IPv6 when the text has a colon). */
    static socklen_t orisha_h3_sockaddr(const char *host, unsigned port, unsigned flow,
                                        unsigned scope, struct sockaddr_storage *out) {
        memset(out, 0, sizeof(*out));
        if (strchr(host, ':')) {
            struct sockaddr_in6 *a = (struct sockaddr_in6 *)out;
            a->sin6_family = AF_INET6;
            a->sin6_port = htons((unsigned short)port);
            a->sin6_flowinfo = htonl(flow);
            a->sin6_scope_id = scope;
            return inet_pton(AF_INET6, host, &a->sin6_addr) == 1 ? sizeof(*a) : 0;
        }
        struct sockaddr_in *a = (struct sockaddr_in *)out;
        a->sin_family = AF_INET;
        a->sin_port = htons((unsigned short)port);
        return inet_pton(AF_INET, host, &a->sin_addr) == 1 ? sizeof(*a) : 0;
    }
    /* The local half of every path: this worker has one socket, so one address stands
     * for it (ngtcp2 tells paths apart by both halves; only the remote one moves). */
    static socklen_t orisha_h3_local(int family, struct sockaddr_storage *out) {
        memset(out, 0, sizeof(*out));
        out->ss_family = (sa_family_t)family;
        return family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
    }
    static int orisha_h3_text(const struct sockaddr *sa, char *text, socklen_t len,
                              unsigned *port, unsigned *flow, unsigned *scope) {
        if (sa->sa_family == AF_INET6) {
            const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)sa;
            *port = ntohs(a->sin6_port); *flow = ntohl(a->sin6_flowinfo); *scope = a->sin6_scope_id;
            return inet_ntop(AF_INET6, &a->sin6_addr, text, len) != NULL;
        }
        const struct sockaddr_in *a = (const struct sockaddr_in *)sa;
        *port = ntohs(a->sin_port);
        return inet_ntop(AF_INET, &a->sin_addr, text, len) != NULL;
    }
    """
    socklen_t orisha_h3_sockaddr(const char *, unsigned, unsigned, unsigned, sockaddr_storage *)
    socklen_t orisha_h3_local(int, sockaddr_storage *)
    int orisha_h3_text(const sockaddr *, char *, socklen_t, unsigned *, unsigned *, unsigned *)

cdef extern from "h3_quic.h":
    ctypedef struct h3q_server:
        pass
    ctypedef struct h3q_conn:
        pass
    ctypedef struct h3q_field:
        const uint8_t *name
        const uint8_t *value
        size_t namelen
        size_t valuelen
    ctypedef struct h3q_calls:
        void (*request)(void *, h3q_conn *, int64_t, const uint8_t *, size_t, const h3q_field *,
                        size_t, unsigned)
        void (*release)(void *, void *)
        void (*cid)(void *, h3q_conn *, uint8_t *, size_t)
        void (*route)(void *, h3q_conn *, const uint8_t *, size_t, int)
        size_t (*credential)(void *, const char *)
    ctypedef struct h3q_pem:
        const uint8_t *cert
        size_t cert_len
        const uint8_t *key
        size_t key_len
    ctypedef struct h3q_limits:
        uint64_t idle_timeout
        uint64_t handshake_timeout
        uint64_t stream_window
        size_t max_section
        uint64_t max_streams
        size_t cid_len
        uint64_t retry_lifetime
    enum:
        H3Q_ENDED, H3Q_EARLY
        H3Q_DROP, H3Q_NEW, H3Q_ANSWERED
        H3Q_HANDSHAKING, H3Q_OPEN, H3Q_CLOSING, H3Q_GONE
    h3q_server *h3q_server_new(const h3q_calls *, void *, const h3q_limits *, const h3q_pem *,
                               size_t, const uint8_t *, char *, size_t)
    void h3q_server_del(h3q_server *)
    int h3q_classify(h3q_server *, const uint8_t *, size_t, uint8_t *, size_t *)
    h3q_conn *h3q_accept(h3q_server *, const uint8_t *, size_t, const sockaddr *, socklen_t,
                         const sockaddr *, socklen_t, uint64_t, void *, int, uint8_t *, size_t *)
    void h3q_conn_del(h3q_conn *)
    void *h3q_conn_host(h3q_conn *)
    void h3q_read(h3q_conn *, const uint8_t *, size_t, const sockaddr *, socklen_t,
                  const sockaddr *, socklen_t, uint64_t)
    size_t h3q_write(h3q_conn *, uint8_t *, size_t, size_t *, size_t, sockaddr_storage *,
                     socklen_t *, uint64_t)
    uint64_t h3q_expiry(h3q_conn *)
    void h3q_expire(h3q_conn *, uint64_t)
    int h3q_state(h3q_conn *)
    const char *h3q_server_name(h3q_conn *)
    int h3q_respond(h3q_conn *, int64_t, const uint8_t *, size_t, const uint8_t *, size_t, void *)
    void h3q_reset(h3q_conn *, int64_t, uint64_t)
    void h3q_stop_reading(h3q_conn *, int64_t, uint64_t)
    void h3q_goaway(h3q_conn *)
    int h3q_drained(h3q_conn *)
    void h3q_close(h3q_conn *, uint64_t)
    size_t h3q_open_streams(h3q_conn *)

cdef enum:
    CID_LEN = 8            # the IDs this server issues (quic_steer's tag fits in them)
    PACKETS = 64           # per write: a GSO group's packets at most (UDP_MAX_SEGMENTS)
    BUF = 65000            # room for them: a GSO send is one UDP payload (< 64 KiB)
    PEERS = 4096           # cached addresses at most, each direction

cdef uint64_t NO_EXPIRY = 0xffffffffffffffff
H3_NO_ERROR, H3_INTERNAL_ERROR, H3_EXCESSIVE_LOAD = 0x100, 0x102, 0x107
H3_MESSAGE_ERROR, H3_REQUEST_REJECTED = 0x10e, 0x10b

_SECTIONS = Sections()
_DATE = PerSecond(date_field)
cdef Py_ssize_t REQUESTS = Stat.REQUESTS, RESPONSE_BYTES = Stat.RESPONSE_BYTES
cdef enum:
    MEMO_SECTION = 1024    # request sections memoised (``heads``) at most this long…
    _MEMO_MAX = 1024       # …and this many of them per worker (then the memo starts again)


MEMO_MAX = _MEMO_MAX  # for the tests


cdef size_t _put_varint(uint8_t *p, uint64_t n) noexcept:
    """QUIC's variable-length integer (RFC 9000 §16) at ``p``; its length."""
    cdef size_t k, i
    if n < 64:
        p[0] = <uint8_t>n
        return 1
    k = 2 if n < 16384 else 4 if n < (1 << 30) else 8
    for i in range(k):
        p[k - 1 - i] = <uint8_t>(n >> (8 * i))
    p[0] |= (0x40 if k == 2 else 0x80 if k == 4 else 0xc0)
    return k


cdef bytes _frames(bytes early, bytes section, bytes date, size_t bodylen):
    """An answer's frames before its body (RFC 9114 §7.1): ``early`` (a 103's HEADERS
    frame, or empty), HEADERS of the build's ``section`` and the ``date`` literal, then a DATA
    frame's header for ``bodylen`` bytes (none for an empty body), in one allocation."""
    cdef uint8_t head[24]
    cdef size_t el = len(early), sl = len(section), dl = len(date), k, d = 0
    k = _put_varint(head, 1)
    k += _put_varint(head + k, sl + dl)
    if bodylen:
        d = _put_varint(head + k, 0)
        d += _put_varint(head + k + d, bodylen)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, el + k + sl + dl + d)
    cdef char *o = PyBytes_AS_STRING(out)
    memcpy(o, PyBytes_AS_STRING(early), el)
    memcpy(o + el, head, k)
    memcpy(o + el + k, PyBytes_AS_STRING(section), sl)
    memcpy(o + el + k + sl, PyBytes_AS_STRING(date), dl)
    memcpy(o + el + k + sl + dl, head + k, d)
    return out


def tickets() -> bytes:
    """The session-ticket key of every worker of every generation (made before the first
    fork): a ticket any worker issued resumes on any other, with 0-RTT (GnuTLS seals
    tickets statelessly; h3_quic.c draws each certificate's own key from this one)."""
    return os.urandom(64)


class Configuration:
    """What a worker generation's endpoints are made from: (DNS names, certificate file,
    key file) in command-line order (``tls.by_server_name`` picks one by the client's server
    name, the first for none or an unknown one), the files' contents (``pems``: read here,
    in the supervisor, so every worker of the generation — one restarted later too — serves
    what was checked, whatever the files hold by then), the idle timeout, ``tickets``
    (``tickets()``, or None: no resumption) and ``retry`` (``--quic-retry``: every new
    client proves its address first, not only past ``RETRY_ABOVE`` handshakes in progress)."""

    def __init__(self, pairs, idle_timeout: float, tickets=None, retry: bool = False) -> None:
        self.pairs, self.idle_timeout, self.tickets, self.retry = list(pairs), idle_timeout, \
            tickets, retry
        self.connection_id_length = CID_LEN
        self.pems = [(_read(cert), _read(key)) for _, cert, key in self.pairs]


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ServeError(f"{path}: cannot read it for QUIC ({e.strerror or e})") from None


def configuration(cert: str, key: str, idle_timeout: float) -> Configuration:
    """One certificate's configuration, checked now."""
    config = Configuration([((), cert, key)], idle_timeout)
    _Server(config, None).close()
    return config


def configurations(pairs, idle_timeout: float, tickets=None, retry: bool = False):
    """Every certificate's configuration: None for no certificate (ACME before its first
    one); the files are loaded once here so a bad one is a clear error at start-up."""
    pairs = list(pairs)
    if not pairs:
        return None
    config = Configuration(pairs, idle_timeout, tickets, retry)
    cdef _Server probe = _Server(config, None)
    probe.close()
    return config


ctypedef struct _Body:
    Py_buffer view


cdef void _on_request(void *host, h3q_conn *c, int64_t sid, const uint8_t *section,
                      size_t length, const h3q_field *f, size_t n, unsigned flags) noexcept:
    """A request: its synthetic head and request line, from ``Endpoint.heads`` when the
    same section was seen before (no dynamic table: the same bytes, the same fields), else
    from its decoded fields."""
    cdef Endpoint ep = <Endpoint>host
    cdef _Conn conn = <_Conn>h3q_conn_host(c)
    cdef size_t i
    cdef tuple got = None
    cdef bytes key = None
    try:
        if length <= MEMO_SECTION:
            key = PyBytes_FromStringAndSize(<char *>section, length)
            got = ep.heads.get(key)
        if got is None:
            fields = [(PyBytes_FromStringAndSize(<char *>f[i].name, f[i].namelen),
                       PyBytes_FromStringAndSize(<char *>f[i].value, f[i].valuelen))
                      for i in range(n)]
            head, line = synthetic_head(fields) if request_fields_error(fields) is None \
                else (None, b"")
            got = (head, line[:len(line) - 8] + b"HTTP/3.0")
            if key is not None:
                if len(ep.heads) >= _MEMO_MAX:
                    ep.heads.clear()
                ep.heads[key] = got
        ep._request(conn, sid, got[0], got[1], flags & H3Q_ENDED, flags & H3Q_EARLY)
    except BaseException as e:
        ep._failed(conn, e)


cdef void _on_release(void *host, void *owner) noexcept:
    cdef _Body *b = <_Body *>owner
    PyBuffer_Release(&b.view)
    free(b)


cdef void _on_cid(void *host, h3q_conn *c, uint8_t *cid, size_t length) noexcept:
    cdef Endpoint ep = <Endpoint>host
    cdef bytes got
    try:
        got = ep.steer.cid(length) if ep.steer is not None else os.urandom(length)
    except BaseException:
        got = os.urandom(length)
    memcpy(cid, PyBytes_AS_STRING(got), length)


cdef void _on_route(void *host, h3q_conn *c, const uint8_t *cid, size_t length, int added) noexcept:
    cdef Endpoint ep = <Endpoint>host
    cdef _Conn conn = <_Conn>h3q_conn_host(c)
    key = PyBytes_FromStringAndSize(<char *>cid, length)
    if added:
        conn.cids.add(key)
        ep.conns[key] = conn
    else:
        conn.cids.discard(key)
        if ep.conns.get(key) is conn:
            del ep.conns[key]


cdef size_t _on_credential(void *host, const char *name) noexcept:
    if host == NULL:
        return 0
    try:
        found = (<Endpoint>host).server.pick(name.decode("ascii", "replace"))
    except BaseException:
        return 0
    return 0 if found is None else found


cdef class _Server:
    """The certificates (GnuTLS credentials, one per pair) and the C server over them."""
    cdef h3q_server *s
    cdef public object pick  # server name → the index of its certificate, or None: the first

    def __cinit__(self, config, Endpoint ep):
        cdef h3q_calls calls
        cdef h3q_limits limits
        cdef char err[512]
        cdef size_t i, n = len(config.pems)
        cdef h3q_pem *pems = <h3q_pem *>malloc(sizeof(h3q_pem) * (n + 1))
        cdef bytes cert, key
        for i in range(n):
            cert, key = config.pems[i]
            pems[i].cert, pems[i].cert_len = <const uint8_t *>PyBytes_AS_STRING(cert), len(cert)
            pems[i].key, pems[i].key_len = <const uint8_t *>PyBytes_AS_STRING(key), len(key)
        self.pick = by_server_name([(dns, i) for i, (dns, _, _) in enumerate(config.pairs)])
        calls.request, calls.release, calls.cid, calls.route, calls.credential = \
            _on_request, _on_release, _on_cid, _on_route, _on_credential
        limits.idle_timeout = <uint64_t>(config.idle_timeout * 1e9)
        limits.handshake_timeout = <uint64_t>(H3_HANDSHAKE_HOLD * 1e9)
        limits.stream_window = H3_WINDOW
        limits.max_streams = H3_MAX_STREAMS
        limits.cid_len = CID_LEN
        limits.retry_lifetime = <uint64_t>(H3_RETRY_LIFETIME * 1e9)
        limits.max_section = FRAME_HEADS * (ep.app.limits.head if ep is not None else 8192)
        ticket = config.tickets
        if ticket is not None and len(ticket) != 64:
            raise ValueError("a ticket key is 64 bytes")
        self.s = h3q_server_new(&calls, <void *>ep if ep is not None else NULL, &limits, pems,
                                n, <const uint8_t *>PyBytes_AS_STRING(ticket)
                                if ticket is not None else NULL, err, sizeof(err))
        free(pems)
        if self.s == NULL:
            why = err.decode(errors="replace")
            if why.startswith("certificate "):  # "certificate I: why": name its files
                index, _, why = why[12:].partition(": ")
                _, c, k = config.pairs[int(index)]
                why = f"{c}, {k}: {why}"
            raise ServeError(f"cannot load them for QUIC ({why})")

    def close(self):
        h3q_server_del(self.s)
        self.s = NULL

    def __dealloc__(self):
        h3q_server_del(self.s)


cdef class _Conn:
    cdef h3q_conn *c
    cdef public object peer, app
    cdef bytes peer_name
    cdef public set cids
    cdef public double timer, since, heard
    cdef public bint handshaking, counted, goaway
    cdef public long seq
    cdef public size_t progress

    def __cinit__(self):
        self.cids = set()
        self.timer = -1.0
        self.handshaking = True
        self.counted = True


cdef class Endpoint:
    """Every HTTP/3 connection of one worker over ngtcp2 (the contract of ``base.py``)."""
    cdef public object app, config, steer, timers
    cdef public dict conns, heads  # heads: request section → (synthetic head, request line)
    cdef public set live
    cdef public list out, forward
    cdef public bint stopping
    cdef public int handshaking, strays, errors, retry_above
    cdef _Server server
    cdef dict names, peers
    cdef uint8_t *buf
    cdef size_t sizes[PACKETS]
    cdef object seq
    cdef uint64_t last_ns

    def __cinit__(self, app, config):
        self.buf = <uint8_t *>malloc(BUF)
        if self.buf == NULL:
            raise MemoryError("HTTP/3 send buffer")

    def __init__(self, app, config) -> None:
        self.app, self.config = app, config
        _SECTIONS.take(app.site, app.hosts)
        self.conns, self.live, self.out, self.forward = {}, set(), [], []
        self.timers = []
        self.seq = itertools.count()
        self.names, self.peers, self.heads = {}, {}, {}
        self.steer = None
        self.retry_above = 0 if config is not None and config.retry else RETRY_ABOVE
        self.server = _Server(config, self) if config is not None else None

    def __dealloc__(self):
        free(self.buf)

    cdef uint64_t _ns(self, double now):
        """``now`` (the body's clock: wall time) in ngtcp2's nanoseconds, never going back:
        ngtcp2 takes timestamps from a monotonic clock."""
        cdef uint64_t ns = <uint64_t>(now * 1e9)
        if ns < self.last_ns:
            return self.last_ns
        self.last_ns = ns
        return ns

    def steer_with(self, steer) -> None:
        self.steer = steer

    # -- the loop body's side of the contract -------------------------------------
    @property
    def outgoing(self) -> list:
        return self.out

    def sent(self, n: int, now: float) -> None:
        del self.out[:n]

    @property
    def busy(self) -> bool:
        return bool(self.live)

    @property
    def timer(self):
        heap = self.timers
        while heap and heap[0][0] != (<_Conn>heap[0][2]).timer:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    cdef bytes _name(self, addr):
        cdef sockaddr_storage ss
        cdef socklen_t n
        cdef bytes name = self.names.get(addr)
        if name is not None:
            return name
        host = str(addr[0]).encode()
        n = orisha_h3_sockaddr(host, addr[1], addr[2] if len(addr) > 3 else 0,
                               addr[3] if len(addr) > 3 else 0, &ss)
        if n == 0:
            return None
        name = PyBytes_FromStringAndSize(<char *>&ss, n)
        if len(self.names) >= PEERS:
            self.names.clear()
        self.names[addr] = name
        return name

    cdef object _addr(self, const sockaddr *sa, socklen_t n):
        cdef char text[64]
        cdef unsigned port = 0, flow = 0, scope = 0
        key = PyBytes_FromStringAndSize(<char *>sa, n)
        addr = self.peers.get(key)
        if addr is not None:
            return addr
        if not orisha_h3_text(sa, text, sizeof(text), &port, &flow, &scope):
            return None
        host = text.decode("ascii")
        addr = (host, port, flow, scope) if sa.sa_family != 2 else (host, port)
        if len(self.peers) >= PEERS:
            self.peers.clear()
        self.peers[key] = addr
        return addr

    def receive(self, list batch, double now, bint handed=False) -> None:
        cdef _Conn c
        cdef bytes data, name
        cdef sockaddr_storage local
        cdef socklen_t locallen
        cdef uint64_t ns = self._ns(now)
        cdef const uint8_t *p
        cdef Py_ssize_t n
        if self.server is None:  # no certificate yet (ACME): nothing to answer with
            return
        touched = {}
        for data, addr in batch:
            n = len(data)
            if n < 7:
                continue
            p = <const uint8_t *>PyBytes_AS_STRING(data)
            if p[0] & 0x80:
                key = data[6:6 + p[5]]
            else:
                key = data[1:1 + CID_LEN]
            c = self.conns.get(key)
            if c is not None and c.peer is addr:  # the pump's cached tuple: its sockaddr kept
                name = c.peer_name
            else:
                name = self._name(addr)
                if name is None:
                    continue
            locallen = orisha_h3_local((<const sockaddr *>PyBytes_AS_STRING(name)).sa_family, &local)
            if c is None:
                c = self._accept(data, addr, name, now, handed)
                if c is None:
                    continue
            c.heard = now
            if c.peer != addr:
                c.peer, c.peer_name = addr, name
            h3q_read(c.c, p, n, <const sockaddr *>&local, locallen,
                     <const sockaddr *>PyBytes_AS_STRING(name), len(name), ns)
            touched[c] = None
        for c in touched:
            self._process(c, now)

    cdef _Conn _accept(self, bytes data, addr, bytes name, double now, bint handed):
        cdef uint8_t answer[1500]  # a version negotiation, a Retry or a CONNECTION_CLOSE
        cdef size_t alen = sizeof(answer)
        cdef sockaddr_storage local
        cdef socklen_t locallen
        cdef const uint8_t *p = <const uint8_t *>PyBytes_AS_STRING(data)
        kind = h3q_classify(self.server.s, p, len(data), answer, &alen)
        if kind == H3Q_ANSWERED:
            self.out.append((PyBytes_FromStringAndSize(<char *>answer, alen), addr, 0))
            return None
        if self._elsewhere(data, addr, handed):  # another worker's ID (any packet type)
            return None
        if kind != H3Q_NEW:
            self.strays += 1
            return None
        app = self.app
        if self.stopping or app.open >= app.limits.connections:
            if self.stopping and self.steer is not None and not handed:
                self.forward.append((self.steer.successor, data, addr))
            return None
        cdef _Conn c = _Conn()
        c.peer, c.peer_name, c.app = addr, name, app
        c.seq = next(self.seq)
        c.since = c.heard = now
        locallen = orisha_h3_local((<const sockaddr *>PyBytes_AS_STRING(name)).sa_family, &local)
        alen = sizeof(answer)
        c.c = h3q_accept(self.server.s, p, len(data), <const sockaddr *>&local, locallen,
                         <const sockaddr *>PyBytes_AS_STRING(name), len(name),
                         self._ns(now), <void *>c, self.handshaking >= self.retry_above,
                         answer, &alen)
        if c.c == NULL:
            self._unroute(c)
            if alen:
                self.out.append((PyBytes_FromStringAndSize(<char *>answer, alen), addr, 0))
            return None
        self.live.add(c)
        self.handshaking += 1
        app.open += 1
        app.stats[Stat.CONNECTIONS] += 1
        return c

    cdef bint _elsewhere(self, bytes data, addr, bint handed):
        """A datagram of no connection here whose ID names another worker: handed over."""
        steer = self.steer
        if steer is None or handed:
            return False
        p = data[0]
        cid = data[6:6 + data[5]] if p & 0x80 else data[1:1 + CID_LEN]
        if len(cid) != CID_LEN:
            return False
        owner = steer.owner(cid)
        if owner != steer.tag and steer.lives(owner):
            self.forward.append((owner, data, addr))
            return True
        return False

    def expire(self, double now) -> None:
        cdef _Conn c
        heap, due = self.timers, []
        while heap and heap[0][0] <= now:
            t, _, c = heapq.heappop(heap)
            if t == c.timer:
                c.timer = -1.0
                due.append(c)
        for c in due:
            if c.c != NULL:
                h3q_expire(c.c, self._ns(now))
                self._process(c, now)

    def tick(self, double now) -> None:
        """The time limits of HTTP/1.1 and HTTP/2 on what QUIC keeps alive: a connection
        with no request for ``idle_timeout`` gets GOAWAY (closed once drained); streams
        that move nothing for ``send_timeout`` (answered) or ``head_timeout`` (waiting for
        their HEADERS) end the connection with H3_EXCESSIVE_LOAD."""
        cdef _Conn c
        for c in list(self.live):
            if c.c == NULL:
                continue
            if self.stopping:
                self._process(c, now)
                continue
            if c.handshaking or c.goaway or h3q_state(c.c) != H3Q_OPEN:
                continue
            limits, waited = c.app.limits, now - c.since
            if h3q_open_streams(c.c):
                if waited > max(limits.send_timeout, limits.head_timeout):
                    h3q_close(c.c, H3_EXCESSIVE_LOAD)
                    self._process(c, now)
            elif waited > limits.idle_timeout:
                c.goaway = True
                h3q_goaway(c.c)
                self._process(c, now)

    def shutdown(self, double now) -> None:
        """GOAWAY on every connection (RFC 9114 §5.2); each closes once drained."""
        cdef _Conn c
        self.stopping = True
        for c in list(self.live):
            if c.c == NULL:
                continue
            if c.handshaking:
                h3q_close(c.c, H3_NO_ERROR)
            else:
                c.goaway = True
                h3q_goaway(c.c)
            self._process(c, now)

    def close(self) -> None:
        cdef _Conn c
        if self.strays and self.steer is not None:
            print(f"orisha: HTTP/3 worker {self.steer.tag.hex()}: {self.strays} datagrams of "
                  "connections no worker knew were dropped", file=sys.stderr)
            self.strays = 0
        for c in list(self.live):
            self._forget(c)
        self.conns.clear()
        self.timers.clear()
        self.out.clear()
        if self.server is not None:
            self.server.close()

    # -- per connection ---------------------------------------------------------------
    cdef _process(self, _Conn c, double now):
        """After input, a timer or a decision: what it sends, its timer, or its end."""
        cdef size_t k, i, j, total, size, off
        cdef sockaddr_storage to
        cdef socklen_t tolen
        cdef uint64_t ns = self._ns(now), t
        if c.c == NULL:
            return
        state = h3q_state(c.c)
        if c.handshaking and state != H3Q_HANDSHAKING:
            self._opened(c)
        if c.goaway and h3q_drained(c.c) and state == H3Q_OPEN:
            h3q_close(c.c, H3_NO_ERROR)  # §5.2: every response delivered
        while True:
            k = h3q_write(c.c, self.buf, BUF, self.sizes, PACKETS, &to, &tolen, ns)
            if k == 0:
                break
            addr = c.peer
            if tolen != len(c.peer_name) or memcmp(&to, PyBytes_AS_STRING(c.peer_name), tolen):
                addr = self._addr(<const sockaddr *>&to, tolen)
                if addr is None:
                    continue
            # GSO groups (base.py): runs of one size, each ended by at most one shorter packet
            # (a larger one, a path MTU probe, starts a group of its own)
            i = off = 0
            while i < k:
                size = self.sizes[i]
                total = size
                j = i + 1
                while j < k and self.sizes[j] == size:
                    total += size
                    j += 1
                if j < k and self.sizes[j] < size:
                    total += self.sizes[j]
                    j += 1
                self.out.append((PyBytes_FromStringAndSize(<char *>self.buf + off, total), addr,
                                 size if j - i > 1 else 0))
                off += total
                i = j
        if h3q_state(c.c) == H3Q_GONE:
            self._forget(c)
            return
        t = h3q_expiry(c.c)
        # 1 µs late: a double of today's clock holds 240 ns steps, and a timer read back into
        # fewer nanoseconds than ngtcp2's expiry would find nothing due (and be set again)
        when = -1.0 if t == NO_EXPIRY else t / 1e9 + 1e-6
        if when != c.timer:
            c.timer = when
            if when >= 0:
                heapq.heappush(self.timers, (when, c.seq, c))
                if len(self.timers) > 4 * len(self.live) + 1024:
                    self.timers[:] = [e for e in self.timers if e[0] == (<_Conn>e[2]).timer]
                    heapq.heapify(self.timers)

    cdef _opened(self, _Conn c):
        c.handshaking = False
        c.since = c.heard
        self.handshaking -= 1
        self._site(c)

    cdef _site(self, _Conn c):
        """Several sites: the connection answers from its SNI's (another's :authority: 421)."""
        if self.app.hosts is not None:
            c.app = self.app.view(h3q_server_name(c.c).decode("ascii", "replace") or None)

    cdef _unroute(self, _Conn c):
        for cid in c.cids:
            if self.conns.get(cid) is c:
                del self.conns[cid]
        c.cids.clear()

    cdef _forget(self, _Conn c):
        self._unroute(c)
        c.timer = -1.0
        if c.handshaking:
            c.handshaking = False
            self.handshaking -= 1
        if c in self.live:
            self.live.discard(c)
            self.app.open -= 1
        if c.c != NULL:
            h3q_conn_del(c.c)
            c.c = NULL

    cdef _failed(self, _Conn c, e):
        self.errors += 1
        if self.errors == 1:
            print(f"orisha: HTTP/3 connection closed on an internal error: {e!r}\n"
                  + traceback.format_exc(), file=sys.stderr, end="")
        if c.c != NULL:
            h3q_close(c.c, H3_INTERNAL_ERROR)

    cdef _request(self, _Conn c, int64_t sid, bytes head, bytes line, bint ended, bint early):
        """A request's synthetic head (None: malformed) and line: its answer. ``early``: it
        came as 0-RTT, before the handshake completed."""
        cdef double now = c.heard
        if c.handshaking and not early:
            self._opened(c)
        elif early and c.app is self.app:  # 0-RTT: the ticket's site already
            self._site(c)
        c.since = now
        app = c.app
        if head is None or (ended and declared_length(head) > 0):
            h3q_reset(c.c, sid, H3_MESSAGE_ERROR)  # RFC 9114 §4.1.2: a stream error
            return
        if len(head) > app.limits.head:
            plan = error_plan(431)
        elif early and refused_early(head):
            plan = error_plan(TOO_EARLY)
        else:
            plan = app.plans.get(head)
            if plan is None:
                plan = app.plan(head)
        self._respond(c, sid, plan, line, now, head)
        if not ended:  # §4.1: answered before the request ended; it need not go on
            h3q_stop_reading(c.c, sid, H3_NO_ERROR)

    cdef _respond(self, _Conn c, int64_t sid, plan, bytes line, double now, bytes request):
        cdef _Body *b
        head, _, body, _, _, status, stats = plan
        app = c.app
        if stats is None:
            stats = app.counts
        stats[REQUESTS] += 1
        stats[RESPONSE_BYTES] += len(body)
        if status >= 400:
            stats[Stat.ERROR[status]] += 1
        if app.log_lines is not None:
            app.log_lines.append(log_line(c.peer[0], now, line, status, len(body),
                                          b"" if app.hosts is None else app.hosts.label(request)))
        date = _DATE.field if <long>now == _DATE.second else _DATE(now)
        frames = _frames(_SECTIONS.early.get(head, b"") if _SECTIONS.early else b"",
                         _SECTIONS.get(head), date, len(body))
        if body:
            b = <_Body *>malloc(sizeof(_Body))
            if b == NULL:
                raise MemoryError()
            src = body.view if body.__class__ is FileRegion else body
            if PyObject_GetBuffer(src, &b.view, PyBUF_SIMPLE) != 0:
                free(b)
                raise BufferError()
            if h3q_respond(c.c, sid, <const uint8_t *>PyBytes_AS_STRING(frames), len(frames),
                           <const uint8_t *>b.view.buf, b.view.len, b) != 0:
                PyBuffer_Release(&b.view)
                free(b)
        else:
            h3q_respond(c.c, sid, <const uint8_t *>PyBytes_AS_STRING(frames), len(frames),
                        NULL, 0, NULL)

