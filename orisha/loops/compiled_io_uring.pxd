# The C declarations compiled_io_uring.pyx uses: libc and liburing's inline helpers
# (liburing.h as the liburing package ships it; only inline functions are called
# directly — the non-inline ones come through the package's own Cython module).
from libc.stdint cimport int64_t, uint64_t

cdef extern from "<errno.h>" nogil:
    int ECANCELED

cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len

cdef extern from "<sys/socket.h>" nogil:
    struct sockaddr:
        pass
    ctypedef unsigned int socklen_t
    struct msghdr:
        void *msg_name
        socklen_t msg_namelen
        iovec *msg_iov
        size_t msg_iovlen
        void *msg_control
        size_t msg_controllen
        int msg_flags
    int SOCK_CLOEXEC, SHUT_WR, MSG_NOSIGNAL, MSG_MORE
    int setsockopt(int, int, int, const void *, socklen_t)
    int getpeername(int, sockaddr *, socklen_t *)

cdef extern from "<netinet/in.h>" nogil:
    int IPPROTO_TCP

cdef extern from "<netinet/tcp.h>" nogil:
    int TCP_NODELAY

cdef extern from "<fcntl.h>" nogil:
    int O_CLOEXEC, F_SETPIPE_SZ, SPLICE_F_MOVE
    int pipe2(int *, int)
    int fcntl(int, int, ...)

cdef extern from "<time.h>" nogil:
    struct c_timespec "timespec":
        long tv_sec
        long tv_nsec
    int CLOCK_REALTIME
    int clock_gettime(int, c_timespec *)

cdef extern from "<sys/syscall.h>" nogil:
    long syscall(long, ...)
    long SYS_io_uring_register "__NR_io_uring_register"

cdef extern from "liburing.h" nogil:
    struct io_uring:
        int ring_fd
    struct io_uring_sqe:
        unsigned char flags
        unsigned short buf_group
    struct io_uring_cqe:
        uint64_t user_data
        int res
        unsigned int flags
    struct io_uring_buf_ring:
        pass
    struct io_uring_buf_reg:
        uint64_t ring_addr
        unsigned int ring_entries
        unsigned short bgid
    io_uring_sqe *io_uring_get_sqe(io_uring *)
    void io_uring_sqe_set_data64(io_uring_sqe *, uint64_t)
    void io_uring_prep_multishot_accept(io_uring_sqe *, int, sockaddr *, socklen_t *, int)
    void io_uring_prep_accept(io_uring_sqe *, int, sockaddr *, socklen_t *, int)
    void io_uring_prep_recv_multishot(io_uring_sqe *, int, void *, size_t, int)
    void io_uring_prep_recv(io_uring_sqe *, int, void *, size_t, int)
    void io_uring_prep_sendmsg(io_uring_sqe *, int, const msghdr *, unsigned int)
    void io_uring_prep_splice(io_uring_sqe *, int, int64_t, int, int64_t, unsigned int, unsigned int)
    void io_uring_prep_close(io_uring_sqe *, int)
    void io_uring_prep_poll_add(io_uring_sqe *, int, unsigned int)
    void io_uring_prep_shutdown(io_uring_sqe *, int, int)
    void io_uring_prep_cancel_fd(io_uring_sqe *, int, unsigned int)
    void io_uring_prep_cancel64(io_uring_sqe *, uint64_t, int)
    void io_uring_cqe_seen(io_uring *, io_uring_cqe *)
    void io_uring_buf_ring_init(io_uring_buf_ring *)
    void io_uring_buf_ring_add(io_uring_buf_ring *, void *, unsigned int, unsigned short, int, int)
    void io_uring_buf_ring_advance(io_uring_buf_ring *, int)
    int io_uring_buf_ring_mask(unsigned int)
    unsigned int IORING_SETUP_SINGLE_ISSUER, IORING_SETUP_DEFER_TASKRUN
    unsigned int IORING_SETUP_COOP_TASKRUN, IORING_SETUP_SUBMIT_ALL
    unsigned int IOSQE_BUFFER_SELECT, IOSQE_IO_LINK
    unsigned int IORING_CQE_F_MORE, IORING_CQE_F_BUFFER, IORING_CQE_BUFFER_SHIFT
    unsigned int IORING_REGISTER_PBUF_RING, IORING_ASYNC_CANCEL_ALL

cdef extern from *:
    """
    /* The next completion, or NULL: io_uring_peek_cqe would call into the library
       (not linked here) when the queue is empty; this reads the ring only. */
    static inline struct io_uring_cqe *orisha_peek_cqe(struct io_uring *ring) {
        unsigned head = *ring->cq.khead;
        if (head == io_uring_smp_load_acquire(ring->cq.ktail))
            return NULL;
        return &ring->cq.cqes[head & ring->cq.ring_mask];
    }
    """
    io_uring_cqe *orisha_peek_cqe(io_uring *) nogil
