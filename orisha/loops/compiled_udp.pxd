# The C declarations compiled_udp.pyx uses (libc: recvmmsg, sendmmsg, control messages,
# numeric address conversion).

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
        void *msg_name
        socklen_t msg_namelen
        iovec *msg_iov
        size_t msg_iovlen
        void *msg_control
        size_t msg_controllen
        int msg_flags
    struct mmsghdr:
        msghdr msg_hdr
        unsigned int msg_len
    struct cmsghdr:
        size_t cmsg_len
        int cmsg_level
        int cmsg_type
    int MSG_DONTWAIT, AF_INET6
    int recvmmsg(int, mmsghdr *, unsigned int, int, void *)
    int sendmmsg(int, mmsghdr *, unsigned int, int)
    int setsockopt(int, int, int, const void *, socklen_t)
    cmsghdr *CMSG_FIRSTHDR(msghdr *)
    cmsghdr *CMSG_NXTHDR(msghdr *, cmsghdr *)
    unsigned char *CMSG_DATA(cmsghdr *)
    size_t CMSG_SPACE(size_t)
    size_t CMSG_LEN(size_t)

cdef extern from "<netinet/in.h>" nogil:
    int IPPROTO_UDP
    struct in6_addr:
        pass
    struct sockaddr_in6:
        unsigned int sin6_flowinfo
        unsigned int sin6_scope_id

cdef extern from "<netdb.h>" nogil:
    struct addrinfo:
        int ai_flags
        int ai_family
        int ai_socktype
        int ai_protocol
        socklen_t ai_addrlen
        sockaddr *ai_addr
        addrinfo *ai_next
    int AI_NUMERICHOST, AI_NUMERICSERV, NI_NUMERICHOST, NI_NUMERICSERV, NI_MAXHOST, NI_DGRAM
    int getaddrinfo(const char *, const char *, const addrinfo *, addrinfo **)
    void freeaddrinfo(addrinfo *)
    int getnameinfo(const sockaddr *, socklen_t, char *, socklen_t, char *, socklen_t, int)
