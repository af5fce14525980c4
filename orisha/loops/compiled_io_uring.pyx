# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Loop body on Linux io_uring, compiled: the same contract as ``io_uring.py``, in C.

Strategy: the pure loop pays several Python calls into the wrapper's objects
per submission. Here every ring operation is a C call on liburing's inline
helpers (the header the ``liburing`` package ships; its Cython module supplies
the few non-inline calls: ring set-up, submit-and-wait, exit), so no Python
object is made per operation. What remains per request is the core's own work
and one ``bytes`` for what was read.

  - one multishot accept (single-shot on kernels before 5.19: EINVAL);
  - one multishot recv per connection into a ring of provided buffers (the
    kernel picks a buffer per completion; it is copied into ``bytes`` and given
    back at once). Kernels without provided-buffer rings (before 5.19) or
    without multishot recv (before 6.0) get single-shot recvs;
  - sends: one ``sendmsg`` of up to 64 iovecs pointing into ``outgoing`` (the
    core keeps those buffers alive until ``sent``); a ``FileRegion`` is spliced
    from the blob's file through a pipe to the socket (two linked SQEs), so
    large bodies never pass through the worker's memory;
  - the ring is set up with SINGLE_ISSUER | DEFER_TASKRUN (completion work runs
    only when this thread waits, in one batch) where the kernel has them,
    falling back to COOP_TASKRUN, then to no flags;
  - each loop iteration queues what the core asked for and makes one
    submit-and-wait call (1 s timeout for the tick), then drains the completions.

Backpressure: the multishot recv stays armed while the core is writing; data
that arrives meanwhile (a pipelining client) is kept and the recv is cancelled,
then both are resumed when the core wants input again, so a connection never
holds more than one read beyond the core's own limit.

The datagram side (HTTP/3, ``base.py``): a one-shot ring poll on the UDP socket
(user_data ``UDP``), re-armed after each completion, runs ``compiled_udp.Pump``: one
recvmmsg per readable turn and one sendmmsg per flush, so a burst costs the poll's
completion and one call each way. A multishot recvmsg would take the poll's place, but
with one datagram per completion (and a provided buffer each) it makes no fewer
transitions than one recvmmsg per burst, and the sends would still wait for their
completions while the pump's batch already went in one call. The wait is cut short by
the endpoint's timer.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.errno cimport EINVAL, EMFILE, ENFILE, ENOBUFS, ENOMEM, errno
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset
from posix.mman cimport MAP_ANONYMOUS, MAP_FAILED, MAP_PRIVATE, PROT_READ, PROT_WRITE, mmap, munmap
from posix.unistd cimport close as c_close

from liburing.queue cimport io_uring as Ring
from . cimport seam
from .seam cimport Calls, Kinds, calls_of, kinds_init
from liburing.queue cimport io_uring_cqe as Cqe
from liburing.queue cimport io_uring_queue_exit, io_uring_queue_init
from liburing.queue cimport io_uring_submit, io_uring_submit_and_wait_timeout
from liburing.time cimport timespec as Timespec

import select as _select
import socket as _socket

from ..blob import FileRegion, release as release_maps
from .base import last_accepts
try:
    from .compiled_udp import Pump
except ImportError:  # that module alone not compiled (its build failed): the pure pump
    from .udp import Pump

cdef enum:
    IOV_MAX = 64
    RECV = 16384          # bytes per provided buffer and per single-shot recv
    BUFS = 1024           # provided buffers in the ring (a power of two)
    BGID = 1
    PIPE = 1 << 20        # bytes a connection's splice pipe is asked to hold

cdef enum:
    ANSWERED = 0          # _Conn.first: base.py's graceful stop
    FRESH = 1
    LATE = 2

cdef enum:
    ACCEPT = 1
    RECV_OP = 2
    SEND = 3
    SPLICE_IN = 4
    IGNORE = 5
    SHUT = 6
    UDP = 7               # the datagram side's poll, as the whole user_data

_EXHAUSTED = (EMFILE, ENFILE, ENOBUFS, ENOMEM)
# False: behave as on a kernel without provided-buffer rings (before 5.19). The tests set
# it, and ``multishot_accept``/``multishot_recv`` on a Loop, to run the older kernels' paths.
PROVIDED_BUFFERS = True


cdef inline double _now() noexcept nogil:
    cdef c_timespec ts
    clock_gettime(CLOCK_REALTIME, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef class _Conn:
    cdef object conn
    cdef const Calls *calls      # its contract at C level, or NULL: through Python (loops/seam.pxd)
    cdef long id
    cdef int fd
    cdef bint recv_armed, sending, closing, cancelled, shut, shutting
    cdef int first               # its first answer: FRESH, LATE, ANSWERED (base.py)
    cdef object pending          # bytes read while the core wanted none (see Backpressure)
    cdef char *buf               # single-shot recv buffer when there is no buffer ring
    cdef object region           # the FileRegion being spliced, or None
    cdef Py_ssize_t done         # its bytes already on the socket
    cdef Py_ssize_t piped        # its bytes in the pipe
    cdef int pipe_r, pipe_w
    cdef msghdr msg
    cdef iovec iov[IOV_MAX]

    def __cinit__(self):
        self.pipe_r = self.pipe_w = -1
        self.region = None
        self.pending = None

    def __dealloc__(self):
        free(self.buf)
        if self.pipe_r >= 0:
            c_close(self.pipe_r)
            c_close(self.pipe_w)


cdef class Loop:
    cdef readonly str name
    cdef object listener, app
    cdef dict conns  # id → _Conn: looked up per completion at C level
    cdef Ring ring_obj
    cdef io_uring *ring
    cdef int lfd
    cdef long next_id
    cdef public bint multishot_accept, multishot_recv
    cdef bint accepting, stopped, paused
    cdef object deadline
    cdef io_uring_buf_ring *br
    cdef char *slab
    cdef size_t br_size
    cdef object pump
    cdef bint udp_armed, udp_blocked
    cdef Kinds kinds

    def __init__(self, listener, app, datagrams=None):
        self.pump = Pump(datagrams) if datagrams is not None else None
        self.udp_armed = self.udp_blocked = False
        self.name = "io-uring"
        self.listener, self.app = listener, app
        self.lfd = listener.fileno()
        self.conns = {}
        kinds_init(&self.kinds, app.protocols)
        self.next_id = 1
        self.multishot_accept = True
        self._setup_ring()
        self._setup_buffers()

    cdef _setup_ring(self):
        # SINGLE_ISSUER (6.0) and DEFER_TASKRUN (6.1), else COOP_TASKRUN (5.19), else none:
        # each older kernel answers EINVAL to flags it does not know.
        cdef Ring ring
        for flags in (IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_SUBMIT_ALL,
                      IORING_SETUP_COOP_TASKRUN | IORING_SETUP_SUBMIT_ALL, 0):
            ring = Ring()  # a fresh one per try: the package marks a ring used even when set-up fails
            try:
                io_uring_queue_init(4096, ring, flags)
            except OSError as e:
                if e.errno == EINVAL and flags:
                    continue
                raise
            self.ring_obj = ring
            self.ring = <io_uring *>&ring.ptr
            return

    cdef _setup_buffers(self):
        """Register a ring of BUFS provided buffers (5.19); without it, single-shot recvs."""
        cdef io_uring_buf_reg reg
        cdef int i
        if not PROVIDED_BUFFERS:
            self.multishot_recv = False
            return
        self.br_size = BUFS * 16  # sizeof(struct io_uring_buf)
        cdef void *mem = mmap(NULL, self.br_size, PROT_READ | PROT_WRITE, MAP_ANONYMOUS | MAP_PRIVATE, -1, 0)
        if mem == MAP_FAILED:
            raise MemoryError("io_uring buffer ring")
        memset(&reg, 0, sizeof(reg))
        reg.ring_addr = <uint64_t>mem
        reg.ring_entries = BUFS
        reg.bgid = BGID
        if syscall(SYS_io_uring_register, self.ring.ring_fd, IORING_REGISTER_PBUF_RING, &reg, 1) < 0:
            munmap(mem, self.br_size)  # EINVAL: a kernel before 5.19
            self.multishot_recv = False
            return
        self.br = <io_uring_buf_ring *>mem
        io_uring_buf_ring_init(self.br)
        self.slab = <char *>malloc(BUFS * RECV)
        if self.slab == NULL:
            raise MemoryError("io_uring receive buffers")
        for i in range(BUFS):
            io_uring_buf_ring_add(self.br, self.slab + i * RECV, RECV, i, io_uring_buf_ring_mask(BUFS), i)
        io_uring_buf_ring_advance(self.br, BUFS)
        self.multishot_recv = True

    cdef io_uring_sqe *_sqe(self, uint64_t user_data) except NULL:
        cdef io_uring_sqe *sqe = io_uring_get_sqe(self.ring)
        if sqe == NULL:  # submission queue full: flush early (the only extra submit)
            io_uring_submit(self.ring_obj)
            sqe = io_uring_get_sqe(self.ring)
            if sqe == NULL:
                raise MemoryError("io_uring submission queue")
        io_uring_sqe_set_data64(sqe, user_data)
        return sqe

    cdef _arm_accept(self):
        if self.multishot_accept:
            io_uring_prep_multishot_accept(self._sqe(ACCEPT), self.lfd, NULL, NULL, SOCK_CLOEXEC)
        else:
            io_uring_prep_accept(self._sqe(ACCEPT), self.lfd, NULL, NULL, SOCK_CLOEXEC)
        self.accepting = True

    cdef _arm_recv(self, _Conn c):
        cdef io_uring_sqe *sqe
        if self.br != NULL:
            sqe = self._sqe(c.id << 3 | RECV_OP)
            if self.multishot_recv:
                io_uring_prep_recv_multishot(sqe, c.fd, NULL, 0, 0)
            else:
                io_uring_prep_recv(sqe, c.fd, NULL, RECV, 0)
            sqe.flags |= IOSQE_BUFFER_SELECT
            sqe.buf_group = BGID
        else:
            if c.buf == NULL:
                c.buf = <char *>malloc(RECV)
                if c.buf == NULL:
                    raise MemoryError("receive buffer")
            io_uring_prep_recv(self._sqe(c.id << 3 | RECV_OP), c.fd, c.buf, RECV, 0)
        c.recv_armed = True

    cdef _service(self, _Conn c):
        """Queue what the core wants for this connection: a close, a send, a recv."""
        cdef object conn = c.conn, data
        cdef list out
        cdef const Calls *calls
        while True:
            if c.calls == NULL:  # Sniffing: its class is chosen by its first read
                c.calls = calls_of(&self.kinds, conn)
            calls = c.calls
            if not c.closing and seam.should_close(calls, conn):
                c.closing = True
            if c.closing:
                self._close(c)
                return
            out = seam.outgoing(calls, conn)
            if out and not c.sending:
                self._send(c, out)
            elif not out and not c.shut and not c.sending and seam.shut_write(calls, conn):
                c.shut = c.shutting = True
                io_uring_prep_shutdown(self._sqe(c.id << 3 | SHUT), c.fd, SHUT_WR)
            if not seam.wants_read(calls, conn):
                return
            if c.pending is None:
                if not c.recv_armed:
                    self._arm_recv(c)
                return
            data, c.pending = c.pending, None
            self._receive(c, data, _now())

    cdef _receive(self, _Conn c, bytes data, double now):
        seam.receive(c.calls, c.conn, data, now)
        if c.calls == NULL:
            c.calls = calls_of(&self.kinds, c.conn)
        if c.first and seam.outgoing(c.calls, c.conn):  # its first response (see _stop)
            if c.first == LATE:
                c.conn.shutdown(now)
            c.first = ANSWERED

    cdef _close(self, _Conn c):
        if c.recv_armed or c.sending:  # in-flight operations end first (ECANCELED)
            if not c.cancelled:
                c.cancelled = True
                io_uring_prep_cancel_fd(self._sqe(IGNORE), c.fd, IORING_ASYNC_CANCEL_ALL)
            return
        if c.shutting:  # a shutdown runs in io-wq: a close before it completes frees the fd
            return      # number for the next accept, and the late SHUT_WR hits that connection
        io_uring_prep_close(self._sqe(IGNORE), c.fd)
        del self.conns[c.id]
        c.conn.close()

    cdef _send(self, _Conn c, list out):
        cdef Py_ssize_t i = 0, n = 0, size = len(out)
        cdef Py_buffer view
        cdef object item
        cdef io_uring_sqe *sqe
        item = out[0]
        if type(item) is FileRegion:
            self._splice(c, item)
            return
        for i in range(min(size, IOV_MAX)):
            item = out[i]
            if type(item) is FileRegion:
                break
            # The pointer outlives the buffer request: the core keeps ``item`` alive until
            # ``sent`` reports it, and bytes and blob views never move.
            PyObject_GetBuffer(item, &view, PyBUF_SIMPLE)
            c.iov[n].iov_base = view.buf
            c.iov[n].iov_len = view.len
            PyBuffer_Release(&view)
            if c.iov[n].iov_len:
                n += 1
        memset(&c.msg, 0, sizeof(msghdr))
        c.msg.msg_iov = c.iov
        c.msg.msg_iovlen = n
        io_uring_prep_sendmsg(self._sqe(c.id << 3 | SEND), c.fd, &c.msg,
                              MSG_NOSIGNAL | (MSG_MORE if i < size and type(out[i]) is FileRegion else 0))
        c.sending = True

    cdef _splice(self, _Conn c, region):
        """Blob file → pipe → socket: two linked splices (the pipe is the connection's own).
        Measured against one sendmsg from the blob's map: 113 vs 168 µs of CPU per 1 MB
        response (nginx's sendfile: 94; epoll's sendfile: 114; 5 interleaved rounds)."""
        cdef int fds[2]
        cdef Py_ssize_t n
        cdef io_uring_sqe *sqe
        if c.pipe_r < 0:
            if pipe2(fds, O_CLOEXEC) < 0:
                raise OSError(errno, "pipe2")
            c.pipe_r, c.pipe_w = fds[0], fds[1]
            fcntl(c.pipe_w, F_SETPIPE_SZ, <int>PIPE)  # may be refused (pipe-max-size): 64 KiB then
        c.region = region
        if not c.piped:
            n = min(<Py_ssize_t>region.length - c.done, PIPE)
            sqe = self._sqe(c.id << 3 | SPLICE_IN)
            io_uring_prep_splice(sqe, region.fd, <int64_t>region.offset + c.done, c.pipe_w, -1, n, SPLICE_F_MOVE)
            sqe.flags |= IOSQE_IO_LINK
        else:
            n = c.piped
        io_uring_prep_splice(self._sqe(c.id << 3 | SEND), c.pipe_r, -1, c.fd, -1, n, SPLICE_F_MOVE)
        c.sending = True

    cdef _accepted(self, int fd, double now, bint late):
        cdef int one = 1
        cdef _Conn c
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one))
        s = _socket.socket(fileno=fd)  # only to read the peer's address: the ring keeps the fd
        try:
            peer = s.getpeername()[0]
        except OSError:  # already reset by the peer: the first recv will say so
            peer = "-"
        s.detach()
        c = _Conn()
        c.id, c.fd, c.first = self.next_id, fd, LATE if late else FRESH
        self.next_id += 1
        c.conn = self.app.connect(now, peer)
        c.calls = calls_of(&self.kinds, c.conn)
        self.conns[c.id] = c
        self._service(c)

    def run(self, stopping):
        cdef Timespec ts = Timespec(1.0)
        cdef Cqe cqe = Cqe()
        cdef io_uring_cqe *e
        cdef double now, next_tick
        cdef uint64_t ud
        cdef int res
        cdef unsigned int flags
        cdef object pump = self.pump
        self._arm_accept()
        self._arm_udp()
        self.stopped, self.paused, self.deadline = False, False, None
        next_tick = _now() + 1
        while True:
            if pump is not None:
                ts = Timespec(pump.wait(_now()))
            try:
                io_uring_submit_and_wait_timeout(self.ring_obj, cqe, 1, ts)
            except OSError:  # ETIME after 1 s, or EINTR (a signal): both just go round
                pass
            now = _now()
            if not self.stopped and stopping():  # before this turn's completions (base.py)
                self._stop(now)
            while True:
                e = orisha_peek_cqe(self.ring)
                if e == NULL:
                    break
                ud, res, flags = e.user_data, e.res, e.flags
                io_uring_cqe_seen(self.ring, e)
                if ud == UDP:
                    self._udp_ready(res, now)
                elif ud & 7 == ACCEPT:
                    self._accept_done(res, flags, now)
                elif ud & 7 != IGNORE:
                    self._done(ud, res, flags, now)
            if pump is not None:
                self.udp_blocked = not pump.due(now)
                self._arm_udp()
            if now >= next_tick:
                next_tick = now + 1
                self._tick(now)
            if self.stopped and not self.conns and not self.accepting and not (
                    pump is not None and pump.ep.busy):
                io_uring_submit(self.ring_obj)  # the queued closes run at submit
                break
        if pump is not None:
            pump.sock.close()  # an armed poll on it ends with the ring
            pump.ep.close()
        self.app.tick(_now())  # last counters and log lines
        io_uring_queue_exit(self.ring_obj)
        free(self.slab)
        self.slab = NULL
        if self.br != NULL:
            munmap(self.br, self.br_size)
            self.br = NULL

    cdef _arm_udp(self):
        """Poll the UDP socket through the ring: readable, and writable while sends wait."""
        if self.pump is not None and not self.udp_armed:
            io_uring_prep_poll_add(self._sqe(UDP), self.pump.fd,
                                   _select.POLLIN | (_select.POLLOUT if self.udp_blocked else 0))
            self.udp_armed = True

    cdef _udp_ready(self, int res, double now):
        self.udp_armed = False
        if res < 0:  # ECANCELED at the end; anything else: poll again next turn
            return
        if res & _select.POLLIN:
            self.udp_blocked = not self.pump.readable(now)
        elif res & _select.POLLOUT:
            self.udp_blocked = not self.pump.flush(now)

    cdef _stop(self, double now):
        """Stop accepting; every connection finishes what it is sending within the grace,
        except the late ones, which first answer the request on its way (base.py)."""
        cdef _Conn c
        self.stopped, self.deadline = True, now + self.app.limits.grace
        if self.pump is not None:
            self.pump.ep.shutdown(now)
            self.udp_blocked = not self.pump.flush(now)
        if self.accepting:
            io_uring_prep_cancel64(self._sqe(IGNORE), ACCEPT, 0)
        else:
            self._last_accepts(now)  # our descriptor closes there: then, with the supervisor's
        #                              closed too, the port refuses instead of queueing for nobody
        for c in list(self.conns.values()):
            if c.first:
                c.first = LATE
            else:
                c.conn.shutdown(now)
                self._service(c)

    cdef _tick(self, double now):
        cdef _Conn c
        self.app.tick(now)
        release_maps()
        if self.pump is not None:
            if self.deadline is not None and now > self.deadline:
                self.pump.ep.close()  # connections past the grace: no longer busy
            self.pump.ep.tick(now)
            self.udp_blocked = not self.pump.flush(now)
        if self.paused and not self.stopped:  # out of descriptors last time: try again now
            self.paused = False
            self._arm_accept()
        for c in list(self.conns.values()):
            if self.deadline is not None and now > self.deadline:
                c.closing = True
            c.conn.tick(now)
            self._service(c)

    cdef _accept_done(self, int res, unsigned int flags, double now):
        if not flags & IORING_CQE_F_MORE:
            self.accepting = False
        if res >= 0:
            # Multishot accept takes connections from the backlog eagerly, so some arrive
            # after the stop: they are late (base.py), answered once (closing them would
            # reset a client whose request the next generation would otherwise have served).
            self._accepted(res, now, self.stopped)
        elif -res in _EXHAUSTED:
            self.paused = True  # re-armed at the next tick: no spinning on EMFILE
        elif res == -EINVAL and self.multishot_accept:
            self.multishot_accept = False  # a kernel before 5.19: single-shot accepts
        if not self.accepting and self.stopped:
            self._last_accepts(now)
        elif not self.accepting and not self.paused and res != -ECANCELED:
            self._arm_accept()

    cdef _last_accepts(self, double now):
        """After the stop, once our accept has ended: what is still queued is served late
        (base.last_accepts says why), then our descriptor is closed."""
        for fd in last_accepts(self.listener):
            self._accepted(fd, now, True)

    cdef _done(self, uint64_t ud, int res, unsigned int flags, double now):
        """A recv, send or splice completed for connection ``ud >> 3``."""
        cdef _Conn c = self.conns.get(<long>(ud >> 3))
        cdef int op = ud & 7
        if c is None:
            return
        if op == RECV_OP:
            self._received(c, res, flags, now)
        elif op == SHUT:
            c.shutting = False
        elif op == SPLICE_IN:
            if res > 0:
                c.piped += res
            elif res != -ECANCELED:
                c.closing = True  # the blob file cannot be read: nothing sensible to send
            return  # the linked splice to the socket completes next
        else:
            c.sending = False
            if res < 0:
                if res != -ECANCELED:
                    c.closing = True  # EPIPE/ECONNRESET: the client left mid-response
            elif c.region is not None:
                self._region_sent(c, res, now)
            else:
                seam.sent(c.calls, c.conn, res, now)
        self._service(c)

    cdef _region_sent(self, _Conn c, int res, double now):
        region, c.region = c.region, None
        c.piped -= res
        c.done += res
        if c.done < region.length:
            seam.sent(c.calls, c.conn, 0, now)  # progress within the region (base.py: whole)
        else:
            c.done = 0
            seam.sent(c.calls, c.conn, region.length, now)

    cdef _received(self, _Conn c, int res, unsigned int flags, double now):
        cdef bytes data
        cdef unsigned short bid
        if not flags & IORING_CQE_F_MORE:
            c.recv_armed = False
        if res < 0:
            if res == -EINVAL and self.multishot_recv and self.br != NULL:
                self.multishot_recv = False  # a kernel before 6.0: single-shot recvs
            elif res != -ECANCELED and res != -ENOBUFS:  # ENOBUFS: re-armed in _service
                c.closing = True  # ECONNRESET and friends end this connection only
            return
        if flags & IORING_CQE_F_BUFFER:
            bid = flags >> IORING_CQE_BUFFER_SHIFT
            data = PyBytes_FromStringAndSize(self.slab + bid * RECV, res)
            io_uring_buf_ring_add(self.br, self.slab + bid * RECV, RECV, bid, io_uring_buf_ring_mask(BUFS), 0)
            io_uring_buf_ring_advance(self.br, 1)
        else:
            data = PyBytes_FromStringAndSize(c.buf, res)
        if c.closing:
            return
        if c.pending is not None:
            c.pending += data
        elif seam.wants_read(c.calls, c.conn):
            self._receive(c, data, now)
            return
        else:
            c.pending = data
        if c.recv_armed:  # the core is writing: stop reading until it wants input again
            io_uring_prep_cancel64(self._sqe(IGNORE), c.id << 3 | RECV_OP, 0)
