# The C declarations compiled_epoll.pyx uses (libc: sockets, epoll, sendfile, clock).

cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len

cdef extern from "<sys/socket.h>" nogil:
    struct sockaddr:
        unsigned short sa_family
    struct sockaddr_storage:
        pass
    ctypedef unsigned int socklen_t
    struct msghdr:
        iovec *msg_iov
        size_t msg_iovlen
    int SOCK_CLOEXEC, SOCK_NONBLOCK, SHUT_WR, MSG_NOSIGNAL, MSG_MORE, AF_INET, AF_INET6
    int accept4(int, sockaddr *, socklen_t *, int)
    ssize_t recv(int, void *, size_t, int)
    ssize_t sendmsg(int, const msghdr *, int)
    int shutdown(int, int)
    int setsockopt(int, int, int, const void *, socklen_t)

cdef extern from "<netinet/in.h>" nogil:
    int IPPROTO_TCP
    struct in_addr:
        pass
    struct in6_addr:
        pass
    struct sockaddr_in:
        in_addr sin_addr
    struct sockaddr_in6:
        in6_addr sin6_addr

cdef extern from "<netinet/tcp.h>" nogil:
    int TCP_NODELAY

cdef extern from "<arpa/inet.h>" nogil:
    const char *inet_ntop(int, const void *, char *, socklen_t)

cdef extern from "<sys/sendfile.h>" nogil:
    ssize_t sendfile(int, int, long *, size_t)

cdef extern from "<sys/epoll.h>" nogil:
    union epoll_data_t:
        int fd
    struct epoll_event:
        unsigned int events
        epoll_data_t data
    int EPOLLIN, EPOLLOUT, EPOLLHUP, EPOLLERR, EPOLL_CLOEXEC, EPOLL_CTL_ADD, EPOLL_CTL_MOD, EPOLL_CTL_DEL
    int epoll_create1(int)
    int epoll_ctl(int, int, int, epoll_event *)
    int epoll_wait(int, epoll_event *, int, int)

cdef extern from "<time.h>" nogil:
    struct c_timespec "timespec":
        long tv_sec
        long tv_nsec
    int CLOCK_REALTIME
    int clock_gettime(int, c_timespec *)
