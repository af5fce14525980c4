/*
 * lwIP configuration for the Orisha unikernel: raw API only, NO_SYS=1,
 * single-threaded polling loop, static pools (no libc malloc underneath).
 */
#ifndef ORISHA_LWIPOPTS_H
#define ORISHA_LWIPOPTS_H

#define NO_SYS                      1
#define SYS_LIGHTWEIGHT_PROT        0
#define LWIP_SOCKET                 0
#define LWIP_NETCONN                0
#define LWIP_NETIF_API              0

/* Memory: lwIP's own heap (ram_heap in .bss) and memp pools. */
#define MEM_LIBC_MALLOC             0
#define MEMP_MEM_MALLOC             0
#define MEM_ALIGNMENT               8
/*
 * The heap's budget (http.c keeps each part bounded; see "Memory" in
 * unikernel/README.md): input held for the core, at most a receive window per
 * served connection (ORISHA_CONN_TABLE x TCP_WND, 4 MiB, plus frame overhead);
 * input of the connections waiting for the table (WAIT_INPUT_ALL, 1.5 MiB); TLS
 * records queued for sending (TLS_QUEUE_ALL in http.c, 1.5 MiB); segment
 * headers of queued data (~100 bytes each); the rest for frames in flight.
 * Touched lazily: it costs guest RAM only as far as it is used.
 */
#ifndef MEM_SIZE /* overridable (EXTRA_CFLAGS) for starvation tests */
#define MEM_SIZE                    (8 * 1024 * 1024)
#endif
/*
 * Every memp element is linked at lwip_init(), touching all pool pages; under
 * KVM each first touch is an EPT fault, so pools stay small and bulk data
 * (received frames, copied TCP data) comes from the heap, touched lazily.
 */
#ifndef MEMP_NUM_PBUF
#define MEMP_NUM_PBUF               8192   /* PBUF_ROM/REF: zero-copy body segments */
#endif
/*
 * The connection table (http.c), sized at boot from the guest's RAM up to these
 * bounds: up to ORISHA_CONN_TABLE connections are served at once (each with a
 * TLS session when the port is TLS), up to ORISHA_CONN_SLOTS are held (the rest
 * wait for the table, unread: the accept backlog, or get a 503), and lwIP's PCB
 * pool has ORISHA_CONN_RESERVE more for closes in progress and TIME_WAIT. A
 * full table displaces a connection only once it has waited on its client for
 * a while (http.c admit); a SYN beyond the slots is dropped (the peer retries).
 */
#define ORISHA_CONN_TABLE           256
#define ORISHA_CONN_SLOTS           1024
#define ORISHA_CONN_RESERVE         64
#define MEMP_NUM_TCP_PCB            (ORISHA_CONN_SLOTS + ORISHA_CONN_RESERVE)
#define MEMP_NUM_TCP_PCB_LISTEN     4
#ifndef MEMP_NUM_TCP_SEG
#define MEMP_NUM_TCP_SEG            8192   /* send queues: a floor per connection, the rest shared (http.c) */
#endif
#define MEMP_NUM_UDP_PCB            4
#define MEMP_NUM_ARP_QUEUE          64
#define PBUF_POOL_SIZE              48     /* unused by our driver (RX uses PBUF_RAM); >= TCP_WND for lwIP sanity checks */
#define PBUF_POOL_BUFSIZE           LWIP_MEM_ALIGN_SIZE(1536 + PBUF_LINK_HLEN)

/* Protocols. */
#define LWIP_ARP                    1
#define LWIP_ETHERNET               1
#define LWIP_IPV4                   1
#define LWIP_IPV6                   0
#define LWIP_ICMP                   1
#define LWIP_RAW                    0
#define LWIP_UDP                    1
#define LWIP_TCP                    1
#define LWIP_DHCP                   1
#define DHCP_DOES_ARP_CHECK         0   /* saves ~1 s at boot; slirp owns the subnet */
#define LWIP_AUTOIP                 0
#define LWIP_IGMP                   0
#define LWIP_DNS                    0
#define IP_REASSEMBLY               0
#define IP_FRAG                     0
#define ARP_TABLE_SIZE              16
#define ETHARP_SUPPORT_STATIC_ENTRIES 0

/* TCP tuning: large send buffer with window scaling for big bodies. */
#define TCP_MSS                     1460
#define LWIP_WND_SCALE              1
#define TCP_RCV_SCALE               2
/* The receive window is also what a connection may hold unread in the heap
 * (http.c counts bytes received only once the core takes them): 16 KiB keeps
 * a full table of pipelining clients within the heap; a static server
 * receives little more than request heads. */
#define TCP_WND                     (16 * 1024)
#define TCP_SND_BUF                 (256 * 1024)
#define TCP_SND_QUEUELEN            (4 * TCP_SND_BUF / TCP_MSS)
#define TCP_SNDLOWAT                (32 * 1024)     /* must stay < 0xffff - 4*MSS */
#define TCP_SNDQUEUELOWAT           (TCP_SND_QUEUELEN / 2)
#define TCP_QUEUE_OOSEQ             1
#define TCP_LISTEN_BACKLOG          0
#define LWIP_TCP_TIMESTAMPS         0
#define TCP_OVERSIZE                TCP_MSS
#define LWIP_TCP_SACK_OUT           0

/* Callbacks and hooks. */
#define LWIP_NETIF_STATUS_CALLBACK  1
#define LWIP_NETIF_LINK_CALLBACK    0
#define LWIP_NETIF_HOSTNAME         0
#define LWIP_SINGLE_NETIF           1
/* lwIP's own ISN is a counter stepped by its 500 ms tick: every connection of
 * the first half second started at 6510, later ones predictably (RFC 6528 §1).
 * net.c answers with a keyed hash of the 4-tuple plus a 4 us clock. */
#define LWIP_HOOK_FILENAME          "lwiphooks.h"
#define LWIP_HOOK_TCP_ISN           net_tcp_isn
#define LWIP_HOOK_IP4_INPUT(p, inp) (net_ip4_input(p, inp) || http_ip4_input(p, inp))

/* Checksums in software (no offload negotiated with virtio-net yet). */
#define CHECKSUM_GEN_IP             1
#define CHECKSUM_GEN_TCP            1
#define CHECKSUM_GEN_UDP            1
#define CHECKSUM_CHECK_IP           1
#define CHECKSUM_CHECK_TCP          1
#define CHECKSUM_CHECK_UDP          1
#define LWIP_CHKSUM_ALGORITHM       3

/* Heap and pool counters only (used, peak, failed allocations): the serial
 * log's stats line (http.c). */
#define LWIP_STATS                  1
#define LINK_STATS                  0
#define ETHARP_STATS                0
#define IP_STATS                    0
#define ICMP_STATS                  0
#define UDP_STATS                   0
#define TCP_STATS                   0
#define MEM_STATS                   1
#define MEMP_STATS                  1
#define SYS_STATS                   0
/* lwIP's own timers and http.c's stats tick. */
#define MEMP_NUM_SYS_TIMEOUT        (LWIP_NUM_SYS_TIMEOUT_INTERNAL + 3)  /* + http.c: stats, admissions, the stale retry */
#define LWIP_DEBUG                  0

#endif
