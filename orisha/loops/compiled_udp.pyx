# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The datagram side of the compiled bodies: ``udp.Pump`` with one system call per burst.

Strategy: ``udp.py`` is the specification and the pure fallback; this ``Pump`` is that
class with its two socket loops replaced, so steering, hand-over, the timer and the
contract with the endpoint (``base.py``) are the same code. Python has no recvmmsg or
sendmmsg, hence C:

  - receive: one ``recvmmsg`` of up to ``BATCH`` datagrams per readable turn, into one
    buffer of ``BATCH`` slots of 64 KiB (virtual memory; a slot's pages are touched only
    as far as datagrams fill it). On a socket with UDP GRO (``UDP_GRO``, Linux ≥ 5.0) the
    kernel may also coalesce a flow's datagrams of one size into one message, whose
    ``UDP_GRO`` control message gives that size: it is split here, so the endpoint sees
    datagrams as ``recvfrom`` would give them. A kernel that refuses ``UDP_GRO`` just
    gets plain messages.
  - send: one ``sendmmsg`` for the whole ``outgoing`` list (up to ``BATCH`` messages per
    call), each item a message of its own, with its own address and, for a GSO group,
    its own ``UDP_SEGMENT`` control message; where the kernel or the device refuses GSO
    (EIO, EINVAL, EOPNOTSUPP) the group's slices become messages of the same call.

Addresses are Python's own shapes (``(host, port)``, ``(host, port, flowinfo, scope_id)``,
as ``recvfrom`` makes them with ``inet_ntop``), each made once per peer and cached in
both directions (bounded: a flood of source addresses only empties the cache).

The counters ``reads``/``writes`` (system calls) and ``received`` (datagrams) are the
pure ``Pump``'s, so a test can tell a batched turn from a per-datagram one.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.errno cimport EAGAIN, ECONNREFUSED, EINTR, EINVAL, EIO, EOPNOTSUPP, errno
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

from . import udp
from .base import BATCH as _BATCH

cdef enum:
    N = 64                # messages per recvmmsg/sendmmsg: base.BATCH (checked below)
    SLOT = 65536          # bytes per received message: a datagram, or a GRO train, at most
    CTL = 64              # control bytes per message (one int-sized cmsg needs 20-24)
    NAME = 128            # sizeof(struct sockaddr_storage)
    SOL_UDP_ = 17
    UDP_SEGMENT_ = 103    # <linux/udp.h>
    UDP_GRO_ = 104
    PEERS = 4096          # cached addresses at most, each direction

assert _BATCH == N, "compiled_udp.N must be base.BATCH"

cdef extern from "<arpa/inet.h>" nogil:
    const char *inet_ntop(int, const void *, char *, socklen_t)
    unsigned short ntohs(unsigned short)
    unsigned int ntohl(unsigned int)
    unsigned int htonl(unsigned int)

cdef extern from *:
    """
    #include <netinet/in.h>
    /* Port and address of a sockaddr_in / sockaddr_in6, without declaring their layouts. */
    static inline const void *orisha_addr_of(const struct sockaddr *sa) {
        return sa->sa_family == AF_INET6 ? (const void *)&((const struct sockaddr_in6 *)sa)->sin6_addr
                                         : (const void *)&((const struct sockaddr_in *)sa)->sin_addr;
    }
    static inline unsigned short orisha_port_of(const struct sockaddr *sa) {
        return ntohs(sa->sa_family == AF_INET6 ? ((const struct sockaddr_in6 *)sa)->sin6_port
                                               : ((const struct sockaddr_in *)sa)->sin_port);
    }
    """
    const void *orisha_addr_of(const sockaddr *) nogil
    unsigned short orisha_port_of(const sockaddr *) nogil

_GSO_REFUSED = (EIO, EINVAL, EOPNOTSUPP)


cdef class Mmsg:
    """The buffers and calls of one UDP socket's batches."""
    cdef int fd, family
    cdef public bint gso, gro
    cdef char *buf                     # N receive slots of SLOT bytes
    cdef mmsghdr rm[N]
    cdef iovec riov[N]
    cdef char rname[N][NAME]
    cdef char rctl[N][CTL]
    cdef mmsghdr sm[N]
    cdef iovec siov[N]
    cdef char sctl[N][CTL]
    cdef Py_ssize_t owner[N]           # the ``outgoing`` item each send message belongs to
    cdef dict peers                    # raw sockaddr bytes → address tuple
    cdef dict names                    # address tuple → raw sockaddr bytes

    def __cinit__(self, int fd, int family, bint gso):
        cdef int one = 1
        self.fd, self.family, self.gso = fd, family, gso
        self.buf = <char *>malloc(N * SLOT)
        if self.buf == NULL:
            raise MemoryError("datagram receive buffers")
        self.peers, self.names = {}, {}
        # ENOPROTOOPT (before 5.0): no coalesced messages will come; nothing else changes.
        self.gro = setsockopt(fd, SOL_UDP_, UDP_GRO_, &one, sizeof(one)) == 0

    def __dealloc__(self):
        free(self.buf)

    cdef object _peer(self, int i):
        """The address tuple of received message ``i`` (cached by its raw bytes)."""
        cdef const sockaddr *sa = <const sockaddr *>self.rname[i]
        cdef char text[64]
        cdef bytes key = PyBytes_FromStringAndSize(self.rname[i], self.rm[i].msg_hdr.msg_namelen)
        addr = self.peers.get(key)
        if addr is not None:
            return addr
        if inet_ntop(sa.sa_family, orisha_addr_of(sa), text, sizeof(text)) == NULL:
            return None
        host = text.decode("ascii")
        if sa.sa_family == AF_INET6:
            addr = (host, orisha_port_of(sa), ntohl((<const sockaddr_in6 *>sa).sin6_flowinfo),
                    (<const sockaddr_in6 *>sa).sin6_scope_id)
        else:
            addr = (host, orisha_port_of(sa))
        if len(self.peers) >= PEERS:
            self.peers.clear()
        self.peers[key] = addr
        return addr

    cdef bytes _name(self, addr):
        """The raw sockaddr for an address tuple, or None when it is none of this family's."""
        cdef addrinfo hints
        cdef addrinfo *res
        cdef bytes name = self.names.get(addr)
        if name is not None:
            return name
        memset(&hints, 0, sizeof(hints))
        hints.ai_family = self.family
        hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV
        host, port = str(addr[0]).encode(), str(addr[1]).encode()
        if getaddrinfo(host, port, &hints, &res) != 0:
            return None
        name = PyBytes_FromStringAndSize(<char *>res.ai_addr, res.ai_addrlen)
        freeaddrinfo(res)
        if self.family == AF_INET6 and len(addr) >= 4:
            (<sockaddr_in6 *>PyBytes_AS_STRING(name)).sin6_flowinfo = htonl(addr[2])
            (<sockaddr_in6 *>PyBytes_AS_STRING(name)).sin6_scope_id = addr[3]
        if len(self.names) >= PEERS:
            self.names.clear()
        self.names[addr] = name
        return name

    def receive(self, list batch):
        """Append this turn's (data, address) pairs to ``batch``; the system calls made."""
        cdef int i, n, calls = 0
        cdef unsigned int size, seg, off
        cdef cmsghdr *cm
        cdef char *data
        for i in range(N):
            self.riov[i].iov_base = self.buf + <size_t>i * SLOT
            self.riov[i].iov_len = SLOT
            memset(&self.rm[i], 0, sizeof(mmsghdr))
            self.rm[i].msg_hdr.msg_iov = &self.riov[i]
            self.rm[i].msg_hdr.msg_iovlen = 1
            self.rm[i].msg_hdr.msg_name = self.rname[i]
        while True:
            for i in range(N):  # the kernel wrote these back on the last call
                self.rm[i].msg_hdr.msg_namelen = NAME
                self.rm[i].msg_hdr.msg_control = self.rctl[i] if self.gro else NULL
                self.rm[i].msg_hdr.msg_controllen = CTL if self.gro else 0
            n = recvmmsg(self.fd, self.rm, N, MSG_DONTWAIT, NULL)
            calls += 1
            if n >= 0:
                break
            # ECONNREFUSED: an ICMP error for an earlier send, reported once: read again.
            # EAGAIN: drained; anything else ends the turn (the next readiness retries).
            if (errno != ECONNREFUSED and errno != EINTR) or calls >= N:
                return calls
        for i in range(n):
            addr = self._peer(i)
            if addr is None:
                continue
            size, data, seg = self.rm[i].msg_len, self.buf + <size_t>i * SLOT, 0
            if self.gro:
                cm = CMSG_FIRSTHDR(&self.rm[i].msg_hdr)
                while cm != NULL:
                    if cm.cmsg_level == SOL_UDP_ and cm.cmsg_type == UDP_GRO_:
                        memcpy(&seg, CMSG_DATA(cm), sizeof(int))
                    cm = CMSG_NXTHDR(&self.rm[i].msg_hdr, cm)
            if seg == 0 or seg >= size:
                batch.append((PyBytes_FromStringAndSize(data, size), addr))
                continue
            off = 0
            while off < size:  # a GRO train: datagrams of ``seg`` bytes, the last maybe shorter
                batch.append((PyBytes_FromStringAndSize(data + off, min(seg, size - off)), addr))
                off += seg
        return calls

    cdef int _fill(self, list out, Py_ssize_t start, Py_ssize_t *stop):
        """Messages for the items of ``out`` from ``start``: their count; ``stop``: the item
        after the last one taken. An item with no usable address is taken as a lost datagram."""
        cdef Py_ssize_t j = start, size = len(out)
        cdef int m = 0, k, slices
        cdef unsigned int seg
        cdef Py_buffer view
        cdef char *p
        cdef size_t length
        cdef bytes name
        cdef cmsghdr *cm
        cdef msghdr *h
        while j < size and m < N:
            payload, addr, segment = out[j]
            seg = segment
            name = self._name(addr)
            if name is None:
                j += 1
                continue
            # The pointer outlives the buffer request: ``out`` keeps the payload alive
            # until after the call, and bytes never move.
            PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
            p, length = <char *>view.buf, view.len
            PyBuffer_Release(&view)
            slices = 1 if seg == 0 or length <= seg or self.gso else (length + seg - 1) // seg
            if m + slices > N:
                if m:
                    break  # the next call takes this group whole
                slices = N  # more slices than one call carries: the rest is lost
            for k in range(slices):
                h = &self.sm[m].msg_hdr
                memset(&self.sm[m], 0, sizeof(mmsghdr))
                h.msg_name = PyBytes_AS_STRING(name)
                h.msg_namelen = len(name)
                if slices > 1:
                    self.siov[m].iov_base = p + k * seg
                    self.siov[m].iov_len = min(seg, length - k * seg)
                else:
                    self.siov[m].iov_base = p
                    self.siov[m].iov_len = length
                h.msg_iov = &self.siov[m]
                h.msg_iovlen = 1
                if slices == 1 and seg and length > seg:  # a GSO group: the kernel splits it
                    h.msg_control = self.sctl[m]
                    h.msg_controllen = CMSG_SPACE(sizeof(unsigned short))
                    memset(self.sctl[m], 0, CTL)
                    cm = CMSG_FIRSTHDR(h)
                    cm.cmsg_level, cm.cmsg_type = SOL_UDP_, UDP_SEGMENT_
                    cm.cmsg_len = CMSG_LEN(sizeof(unsigned short))
                    (<unsigned short *>CMSG_DATA(cm))[0] = <unsigned short>seg
                self.owner[m] = j
                m += 1
            j += 1
        stop[0] = j
        return m

    def send(self, list out):
        """Send ``out`` (``base.py``'s ``outgoing``) from its start: (items sent, system
        calls, whether the socket buffer filled first). A refused item counts as sent."""
        cdef Py_ssize_t i = 0, stop, size = len(out)
        cdef int m, r, calls = 0
        while i < size:
            m = self._fill(out, i, &stop)
            if m == 0:  # only items without an address: lost
                i = stop
                continue
            r = sendmmsg(self.fd, self.sm, m, MSG_DONTWAIT)
            calls += 1
            if r > 0:
                # Every message up to r went; an item whose slices went only in part
                # counts as sent as well (the rest is lost, and QUIC recovers it).
                i = stop if r == m else self.owner[r - 1] + 1
                continue
            if errno == EAGAIN:  # the socket buffer is full: wait until writable
                return i, calls, True
            if errno == EINTR:
                continue
            if errno in _GSO_REFUSED and self.gso and self.sm[0].msg_hdr.msg_controllen:
                self.gso = False  # this device or kernel refuses GSO: slices from now on
                continue
            # EMSGSIZE, EHOSTUNREACH, ECONNREFUSED…: the first message is a lost datagram.
            i = self.owner[0] + 1
        return i, calls, False


class Pump(udp.Pump):
    """``udp.Pump`` with one recvmmsg per readable turn and one sendmmsg per flush."""

    __slots__ = ("mm",)

    def __init__(self, datagrams) -> None:
        super().__init__(datagrams)
        self.mm = Mmsg(self.sock.fileno(), self.sock.family, self.gso)

    def _read(self) -> list:
        batch = []
        self.reads += self.mm.receive(batch)
        self.received += len(batch)
        return batch

    def _write(self, now: float) -> bool:
        done, calls, blocked = self.mm.send(self.ep.outgoing)
        self.writes += calls
        self.gso = self.mm.gso
        if done:
            self.ep.sent(done, now)
        return not blocked

