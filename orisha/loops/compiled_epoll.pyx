# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Loop body on Linux epoll, compiled: the same contract and behaviour as
``readiness.py`` + ``epoll.py`` (the specification and the pure fallback), in C.

Strategy: everything but the core's own calls is C — epoll_wait into a fixed
array, accept4, recv into one reusable buffer (copied into the ``bytes`` the
core takes), sendmsg with iovecs pointing straight into ``outgoing``, sendfile
for a ``FileRegion`` (the head before it goes with MSG_MORE), and the
per-socket state in a typed object — so what is left per request is the
interpreter running the core.

The datagram side (HTTP/3, ``base.py``) is one more descriptor in the epoll set,
moved by ``compiled_udp.Pump``: one recvmmsg per readable turn (UDP GRO trains split)
and one sendmmsg per flush (GSO groups and single datagrams to any address together).
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.errno cimport EAGAIN, ECONNABORTED, EINTR, EMFILE, ENFILE, ENOBUFS, ENOMEM, errno
from libc.string cimport memset
from posix.unistd cimport close as c_close

from . cimport seam
from .seam cimport Calls, Kinds, calls_of, kinds_init
from ..blob import FileRegion, release as release_maps
try:
    from .compiled_udp import Pump
except ImportError:  # that module alone not compiled (its build failed): the pure pump
    from .udp import Pump

cdef enum:
    READ = 1
    WRITE = 2
    ANSWERED = 0          # _Conn.first: base.py's graceful stop
    FRESH = 1
    LATE = 2
    EVENTS = 512
    IOV_MAX = 64
    RECV = 65536

cdef char _recv_buf[RECV]


cdef inline double _now() noexcept nogil:
    cdef c_timespec ts
    clock_gettime(CLOCK_REALTIME, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef class _Conn:
    cdef object conn
    cdef const Calls *calls       # its contract at C level, or NULL: through Python (loops/seam.pxd)
    cdef int fd, watched
    cdef int first                # its first answer: FRESH, LATE, ANSWERED (base.py)
    cdef bint may_shut
    cdef Py_ssize_t region_done   # bytes of the first FileRegion already sent (base.py)


cdef class Loop:
    cdef readonly str name
    cdef object listener, app, pump
    cdef dict conns  # fd → _Conn: looked up per event at C level
    cdef int lfd, ep, ufd, uwant
    cdef Kinds kinds

    def __init__(self, listener, app, datagrams=None):
        self.pump = Pump(datagrams) if datagrams is not None else None
        self.ufd = self.pump.fd if datagrams is not None else -1
        self.name = "epoll"
        self.listener, self.app = listener, app
        self.lfd = listener.fileno()
        self.conns = {}
        kinds_init(&self.kinds, app.protocols)
        self.ep = epoll_create1(EPOLL_CLOEXEC)
        if self.ep < 0:
            raise OSError(errno, "epoll_create1")

    cdef _watch(self, int fd, int want, bint known):
        cdef epoll_event ev
        ev.events = (EPOLLIN if want & READ else 0) | (EPOLLOUT if want & WRITE else 0)
        ev.data.fd = fd
        if epoll_ctl(self.ep, EPOLL_CTL_MOD if known else EPOLL_CTL_ADD, fd, &ev) < 0:
            raise OSError(errno, "epoll_ctl")

    cdef _forget(self, int fd):
        epoll_ctl(self.ep, EPOLL_CTL_DEL, fd, NULL)

    def run(self, stopping):
        cdef epoll_event events[EVENTS]
        cdef int i, n, fd
        cdef unsigned int ev
        cdef double now, next_tick
        cdef bint accepting = True, paused = False
        cdef _Conn c
        cdef object deadline = None, pump = self.pump
        cdef dict conns = self.conns
        self._watch(self.lfd, READ, False)
        if pump is not None:
            self._watch(self.ufd, READ, False)
            self.uwant = READ
        next_tick = _now() + 1
        while conns or accepting or (pump is not None and pump.ep.busy):
            n = epoll_wait(self.ep, events, EVENTS,
                           1000 if pump is None else <int>(pump.wait(_now()) * 1000 + 0.999))
            if n < 0 and errno != EINTR:
                raise OSError(errno, "epoll_wait")
            now = _now()
            if accepting and stopping():  # before this turn's events (base.py: graceful stop)
                accepting = False
                deadline = now + self.app.limits.grace
                self._stop(paused, now)
            for i in range(n if n > 0 else 0):
                fd, ev = events[i].data.fd, events[i].events
                if fd == self.ufd:
                    self._udp(pump.readable(now) if ev & (EPOLLIN | EPOLLERR) else pump.flush(now))
                    continue
                if fd == self.lfd:
                    if accepting and not paused and not self._accept(now):
                        paused = True  # out of descriptors: leave the backlog until the next tick
                        self._forget(self.lfd)
                    continue
                c = conns.get(fd)
                if c is not None:
                    self._ready(c, ev, now)
            if pump is not None:
                self._udp(pump.due(now))
            if now >= next_tick:
                next_tick = now + 1
                self._second(now)
                if paused and accepting:
                    self._watch(self.lfd, READ, False)
                    paused = False
            if deadline is not None and now > deadline:
                for c in list(conns.values()):
                    self._close(c)
                if pump is not None:
                    pump.ep.close()  # connections past the grace: no longer busy
        if pump is not None:
            self._forget(self.ufd)
            pump.sock.close()
            pump.ep.close()
        self.app.tick(_now())  # last counters and log lines
        c_close(self.ep)

    cdef _ready(self, _Conn c, unsigned int ev, double now):
        """A connection's readiness: what its socket holds, handed to its layer; then what
        the layer has to send. A hang-up or error is surfaced as readable: recv returns 0
        or fails."""
        cdef ssize_t got
        if c.calls == NULL:  # Sniffing: its class is chosen by its first read
            c.calls = calls_of(&self.kinds, c.conn)
        if ev & (EPOLLIN | EPOLLHUP | EPOLLERR) and seam.wants_read(c.calls, c.conn):
            got = recv(c.fd, _recv_buf, RECV, 0)
            if got < 0:
                if errno != EAGAIN and errno != EINTR:  # else spurious readiness
                    self._close(c)  # ECONNRESET and friends end this connection only
                return
            seam.receive(c.calls, c.conn, PyBytes_FromStringAndSize(_recv_buf, got), now)
            if c.calls == NULL:
                c.calls = calls_of(&self.kinds, c.conn)
            if c.first and seam.outgoing(c.calls, c.conn):  # its first response (_stop)
                if c.first == LATE:
                    c.conn.shutdown(now)
                c.first = ANSWERED
        self._flush(c, now)

    cdef _second(self, double now):
        """Once a second: the datagram side's and the app's ticks, and every connection's
        time limits."""
        cdef _Conn c
        pump = self.pump
        if pump is not None:
            pump.ep.tick(now)
            self._udp(pump.flush(now))
        self.app.tick(now)
        release_maps()
        for c in list(self.conns.values()):
            c.conn.tick(now)
            self._flush(c, now)

    cdef _udp(self, bint flushed):
        """Watch the UDP socket for writing too while its sends wait for buffer space."""
        cdef int want = READ if flushed else READ | WRITE
        if want != self.uwant:
            self._watch(self.ufd, want, True)
            self.uwant = want

    cdef _stop(self, bint paused, double now):
        """Stop accepting (what is queued stays for the next generation, or is refused), then
        shut down every connection but the late ones: those still awaiting their first answer."""
        cdef _Conn c
        if not paused:
            self._forget(self.lfd)
        self.listener.close()
        if self.pump is not None:
            self.pump.ep.shutdown(now)
            self._udp(self.pump.flush(now))
        for c in list(self.conns.values()):
            if c.first:
                c.first = LATE
            else:
                c.conn.shutdown(now)
                self._flush(c, now)

    cdef bint _accept(self, double now) except -1:
        """Accept all pending connections; False when out of descriptors or memory."""
        cdef sockaddr_storage addr
        cdef socklen_t alen
        cdef int fd, one = 1
        cdef char text[64]
        cdef const void *ip
        cdef _Conn c
        while True:
            alen = sizeof(addr)
            fd = accept4(self.lfd, <sockaddr *>&addr, &alen, SOCK_NONBLOCK | SOCK_CLOEXEC)
            if fd < 0:
                if errno == EAGAIN:  # backlog drained
                    return True
                if errno == EMFILE or errno == ENFILE or errno == ENOBUFS or errno == ENOMEM:
                    return False
                if errno == ECONNABORTED or errno == EINTR:  # the client gave up while queued
                    continue
                raise OSError(errno, "accept4")
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one))
            if (<sockaddr *>&addr).sa_family == AF_INET6:
                ip = &(<sockaddr_in6 *>&addr).sin6_addr
            else:
                ip = &(<sockaddr_in *>&addr).sin_addr
            if inet_ntop((<sockaddr *>&addr).sa_family, ip, text, sizeof(text)) == NULL:
                text[0] = b"-"
                text[1] = 0
            c = _Conn()
            c.fd, c.watched, c.may_shut, c.first = fd, READ, True, FRESH
            c.conn = self.app.connect(now, text.decode("ascii"))
            c.calls = calls_of(&self.kinds, c.conn)
            self.conns[fd] = c
            self._watch(fd, READ, False)
            self._flush(c, now)

    cdef _flush(self, _Conn c, double now):
        cdef object conn = c.conn
        cdef const Calls *calls = c.calls
        cdef list out = seam.outgoing(calls, conn)
        cdef Py_ssize_t n
        cdef int want
        while out:
            n = self._send(c, out)
            if n < 0:
                if errno == EAGAIN:  # socket buffer full: wait until writable
                    break
                self._close(c)  # EPIPE/ECONNRESET: the peer is gone
                return
            seam.sent(calls, conn, n, now)
        if seam.should_close(calls, conn):
            self._close(c)
            return
        if c.may_shut and seam.shut_write(calls, conn):
            c.may_shut = False
            shutdown(c.fd, SHUT_WR)  # ENOTCONN: the peer is already gone; the next read says so
        want = WRITE if out else (READ if seam.wants_read(calls, conn) else 0)
        if want != c.watched:
            self._watch(c.fd, want, True)
            c.watched = want

    cdef Py_ssize_t _send(self, _Conn c, list out) except? -2:
        """One sendmsg of the items before the first FileRegion, or one sendfile from it.
        The count for ``sent`` (a region only whole: 0 while part of it is out); -1 with errno."""
        cdef iovec iov[IOV_MAX]
        cdef msghdr msg
        cdef Py_buffer view
        cdef Py_ssize_t i, k = 0, size = len(out), got
        cdef long offset
        cdef object item = out[0]
        if type(item) is FileRegion:
            offset = item.offset + c.region_done
            got = sendfile(c.fd, item.fd, &offset, item.length - c.region_done)
            if got < 0:
                return -1
            c.region_done += got
            if c.region_done < item.length:
                return 0
            c.region_done = 0
            return item.length
        for i in range(min(size, IOV_MAX)):
            item = out[i]
            if type(item) is FileRegion:
                break
            # The pointer outlives the buffer request: ``out`` keeps the object alive until
            # after the call, and bytes and blob views never move.
            PyObject_GetBuffer(item, &view, PyBUF_SIMPLE)
            iov[k].iov_base = view.buf
            iov[k].iov_len = view.len
            PyBuffer_Release(&view)
            k += 1
        # One sendmsg of the iovecs: copying head, Date tail and body into one buffer for a
        # single send() measured no better (1 KB: 8.2 vs 7.5 µs/req, 13 KB: 7.6 vs 8.0; noise ±0.5).
        memset(&msg, 0, sizeof(msg))
        msg.msg_iov = iov
        msg.msg_iovlen = k
        return sendmsg(c.fd, &msg, MSG_NOSIGNAL | (MSG_MORE if type(item) is FileRegion else 0))

    cdef _close(self, _Conn c):
        del self.conns[c.fd]
        self._forget(c.fd)
        c_close(c.fd)
        c.conn.close()
