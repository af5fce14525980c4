/*
 * lwIP glue: a netif over virtio-net, DHCP, TCP's initial sequence numbers,
 * and one pass of the polling loop (frames in, lwIP's timers, frames out).
 * The loop itself is the application's (main.c); HTTP is http.c.
 *
 * More cores: every core runs its own lwIP (its state is per core, linker.ld) on
 * the same MAC and address. Core 0 alone drives the NIC and DHCP; each received
 * TCP segment goes to the core a hash of its addresses and ports names (so every
 * segment of a connection meets the same lwIP), through that core's frame ring:
 * single producer (core 0), single consumer, in memory mapped alike on every core,
 * and a wake IPI when the core sleeps; ARP goes to every core; anything else stays
 * on core 0. Transmits from any core share the one TX queue (virtio_net.c's lock).
 *
 * A queue pair per core (virtio_net_pairs() > 1: tap with queues=N): each core polls
 * its own RX queue and sends on its own TX queue; the host's tap keeps a flow on one
 * queue (the one its SYN hashed to, then the one the guest answers it on), so no
 * segment is handed on. ARP is replicated instead: a broadcast request reaches one
 * queue only, yet every core's lwIP needs the host's MAC for its own replies and must
 * not send ARP requests of its own whose replies the tap might steer to another
 * queue; so the core that receives an ARP frame answers it and copies it to every
 * other core's ring (now one per core, core 0's too, under a lock for its producers).
 * Every core then learns the same entry, and any one answer serves the host.
 *
 * The address: DHCP on core 0, or static from the command line (orisha.ip=A.B.C.D/NN,
 * orisha.gw=A.B.C.D, as `orisha boot --address/--gateway` write it; no DHCP then).
 */
#include <string.h>
#include "lwip/init.h"
#include "lwip/netif.h"
#include "lwip/dhcp.h"
#include "lwip/etharp.h"
#include "lwip/pbuf.h"
#include "lwip/timeouts.h"
#include "lwip/ip4_addr.h"
#include "lwip/prot/ip4.h"
#include "lwip/prot/tcp.h"
#include "lwip/priv/tcp_priv.h"
#include "netif/ethernet.h"
#include "lwiphooks.h"
#include "net.h"
#include "virtio_net.h"
#include "virtio_rng.h"
#include "platform.h"
#include "policy.h"
#include "io.h"

static struct netif nif;
static uint64_t rx_dropped, tx_dropped;

#define RING_SLOTS 256 /* a power of 2 */
#define SLOT_DATA (2048 - 4)
#define RX_BUDGET 64
struct frame_slot {
    uint32_t len;
    uint8_t data[SLOT_DATA];
};
struct frame_ring {
    int put_lock __attribute__((aligned(64)));  /* producers: core 0, or any core's ARP */
    uint32_t head __attribute__((aligned(64))); /* the producer writes it: frames put */
    uint32_t tail __attribute__((aligned(64))); /* the core writes it: frames taken */
    uint32_t sleeping __attribute__((aligned(64)));
    uint64_t full;                              /* waits for room (rx_frame), ARP copies dropped */
    struct frame_slot slot[RING_SLOTS] __attribute__((aligned(64)));
};
/* Shared by the cores: the rings, how many cores frames go to (0: core 0 keeps all,
 * until every core listens), and the address DHCP gave core 0. */
static struct frame_ring *rings[POLICY_CPUS_MAX] PLATFORM_SHARED;
static unsigned spread PLATFORM_SHARED;
static unsigned cores_up PLATFORM_SHARED;
static struct {
    int ready;
    ip4_addr_t ip, mask, gw;
} given PLATFORM_SHARED;
/* One queue pair: when core 0's poll last left the device's receive queue empty (every
 * frame for another core is in that core's ring by then). */
static uint64_t drained_ns PLATFORM_SHARED;
static int is_static; /* core 0: the address came from the command line */
static uint64_t arp_copied;

/* lwIP NO_SYS time base. */
u32_t sys_now(void)
{
    return platform_now_ms();
}

/*
 * RFC 6528 §3: ISN = M + F(localip, localport, remoteip, remoteport, key), M a
 * 4 us timer and F a pseudorandom function keyed once at boot (from every
 * entropy source there is, see isn_keygen). F is
 * SipHash-2-4 (Linux's choice for the same job): an off-path attacker who
 * sees the ISNs of its own connections learns nothing of anyone else's.
 */
static uint64_t isn_key[2];

#define ROTL(x, b) (((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                              \
    do {                                                                      \
        v0 += v1; v1 = ROTL(v1, 13); v1 ^= v0; v0 = ROTL(v0, 32);             \
        v2 += v3; v3 = ROTL(v3, 16); v3 ^= v2;                                \
        v0 += v3; v3 = ROTL(v3, 21); v3 ^= v0;                                \
        v2 += v1; v1 = ROTL(v1, 17); v1 ^= v2; v2 = ROTL(v2, 32);             \
    } while (0)

static uint64_t siphash24(const uint64_t k[2], const uint8_t *m, size_t len)
{
    uint64_t v0 = k[0] ^ 0x736f6d6570736575ull, v1 = k[1] ^ 0x646f72616e646f6dull;
    uint64_t v2 = k[0] ^ 0x6c7967656e657261ull, v3 = k[1] ^ 0x7465646279746573ull;
    uint64_t b = (uint64_t)len << 56, w;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        memcpy(&w, m + i, 8); /* little-endian, as the reference */
        v3 ^= w;
        SIPROUND;
        SIPROUND;
        v0 ^= w;
    }
    for (size_t j = 0; i + j < len; j++)
        b |= (uint64_t)m[i + j] << (8 * j);
    v3 ^= b;
    SIPROUND;
    SIPROUND;
    v0 ^= b;
    v2 ^= 0xff;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

u32_t net_tcp_isn(const ip_addr_t *local_ip, u16_t local_port,
                  const ip_addr_t *remote_ip, u16_t remote_port)
{
    uint8_t m[12];
    uint32_t la = ip4_addr_get_u32(ip_2_ip4(local_ip)), ra = ip4_addr_get_u32(ip_2_ip4(remote_ip));
    memcpy(m, &la, 4);
    memcpy(m + 4, &ra, 4);
    memcpy(m + 8, &local_port, 2);
    memcpy(m + 10, &remote_port, 2);
    uint32_t clock = (uint32_t)(platform_now_ns() / 4000u);
    return clock + (uint32_t)siphash24(isn_key, m, sizeof m);
}

/* The key is the XOR of what each entropy source gives (RDSEED/RDRAND,
 * virtio-rng): as unpredictable as the better of the two, and either alone
 * is enough. */
static void isn_keygen(void)
{
    uint64_t cpu[2] = { 0, 0 }, dev[2] = { 0, 0 };
    int have_cpu = platform_entropy(cpu, sizeof cpu) == 0;
    int have_dev = virtio_rng_read(dev, sizeof dev) == 0;
    isn_key[0] = cpu[0] ^ dev[0];
    isn_key[1] = cpu[1] ^ dev[1];
    if (have_cpu || have_dev)
        return;
    /* Neither (an old CPU model, no virtio-rng): the boot's clock readings are
     * all there is. Still per-boot and per-connection, but guessable: say so. */
    platform_printf("orisha: no hardware random numbers: TCP sequence numbers keyed from the clock\n");
    isn_key[0] = platform_now_ns() ^ ((uint64_t)platform_random() << 32);
    isn_key[1] = ((uint64_t)platform_random() << 32) ^ platform_unix_time();
}

/*
 * A SYN for a connection still in TIME_WAIT here starts a new one, as on Linux
 * and the BSDs (RFC 1122 §4.2.2.13: when its sequence number is past the old
 * connection's). lwIP instead answers such a SYN with an ACK (or a RST when it
 * falls in the old window) and ignores the peer's RST for the whole 2*MSL. Under
 * QEMU's user networking that is a real case: every forwarded connection comes
 * from 10.0.2.2 and the client's own port, and the host reuses a client port as
 * soon as its own side is closed, so a connection that reuses the port of one
 * this kernel closed first waited up to two minutes for its handshake (the rare
 * 10 s time-outs of the socket tests). Called by ip4_input for every packet
 * (LWIP_HOOK_IP4_INPUT); it never eats one: the SYN goes on to the listener.
 */
int net_ip4_input(struct pbuf *p, struct netif *inp)
{
    (void)inp;
    const uint8_t *ip = p->payload;
    size_t hl = (size_t)(ip[0] & 0x0f) * 4;
    if (p->len < hl + TCP_HLEN || hl < IP_HLEN || ip[9] != IP_PROTO_TCP)
        return 0;
    if ((ip[6] & 0x3f) | ip[7]) /* a fragment: not a whole SYN */
        return 0;
    const struct tcp_hdr *th = (const struct tcp_hdr *)(ip + hl);
    if ((TCPH_FLAGS(th) & (TCP_SYN | TCP_ACK | TCP_RST)) != TCP_SYN)
        return 0;
    ip4_addr_t src, dst;
    memcpy(&src, ip + 12, 4);
    memcpy(&dst, ip + 16, 4);
    u16_t sport = lwip_ntohs(th->src), dport = lwip_ntohs(th->dest);
    u32_t seq = lwip_ntohl(th->seqno);
    for (struct tcp_pcb *pcb = tcp_tw_pcbs; pcb; pcb = pcb->next) {
        if (pcb->remote_port == sport && pcb->local_port == dport &&
            ip4_addr_cmp(ip_2_ip4(&pcb->remote_ip), &src) &&
            ip4_addr_cmp(ip_2_ip4(&pcb->local_ip), &dst)) {
            if (TCP_SEQ_GT(seq, pcb->rcv_nxt))
                tcp_abort(pcb); /* TIME_WAIT: freed without a RST */
            break;
        }
    }
    return 0;
}

/* The core a received frame is for (0..n-1), or -1: every core (ARP). A TCP segment
 * by its source address and both ports (the destination is this machine's). */
static int frame_core(const uint8_t *f, size_t len, unsigned n)
{
    uint16_t type = (uint16_t)(f[12] << 8 | f[13]);
    if (type == 0x0806)
        return -1;
    if (type != 0x0800 || len < 14 + IP_HLEN)
        return 0;
    const uint8_t *ip = f + 14;
    size_t hl = (size_t)(ip[0] & 0x0f) * 4;
    if (ip[9] != IP_PROTO_TCP || hl < IP_HLEN || len < 14 + hl + 4 || ((ip[6] & 0x3f) | ip[7]))
        return 0; /* not TCP, or a fragment (no ports in it): core 0 */
    uint32_t src, ports;
    memcpy(&src, ip + 12, 4);
    memcpy(&ports, ip + hl, 4);
    uint64_t h = (uint64_t)src << 32 | ports; /* MurmurHash3's fmix64: every bit counts */
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return (int)(h % n);
}

/* A copy of the frame into core `to`'s ring, and a wake if it sleeps; 0: the ring is
 * full. The producer: core 0 (one queue pair), or with a pair per core whichever core
 * received an ARP. */
static int hand_on(unsigned to, const uint8_t *frame, size_t len)
{
    struct frame_ring *r = rings[to];
    if (len > SLOT_DATA)
        return 1; /* no frame of this MTU is larger: dropped */
    while (__atomic_exchange_n(&r->put_lock, 1, __ATOMIC_ACQUIRE))
        cpu_relax();
    uint32_t head = r->head;
    if (head - __atomic_load_n(&r->tail, __ATOMIC_ACQUIRE) >= RING_SLOTS) {
        __atomic_store_n(&r->put_lock, 0, __ATOMIC_RELEASE);
        return 0;
    }
    struct frame_slot *s = &r->slot[head % RING_SLOTS];
    s->len = (uint32_t)len;
    memcpy(s->data, frame, len);
    __atomic_store_n(&r->head, head + 1, __ATOMIC_SEQ_CST);
    __atomic_store_n(&r->put_lock, 0, __ATOMIC_RELEASE);
    if (__atomic_exchange_n(&r->sleeping, 0, __ATOMIC_SEQ_CST))
        platform_wake(to);
    return 1;
}

static void input(const uint8_t *frame, size_t len)
{
    /* Heap-backed (PBUF_RAM): pages are only touched once traffic needs them. */
    struct pbuf *p = pbuf_alloc(PBUF_RAW, (u16_t)len, PBUF_RAM);
    if (!p) {
        rx_dropped++; /* out of memory: drop, TCP will retransmit */
        return;
    }
    pbuf_take(p, frame, (u16_t)len);
    if (nif.input(p, &nif) != ERR_OK)
        pbuf_free(p);
}

/* A received frame into lwIP, or on to its core. 1: it stays in the device's queue
 * (with one queue pair, its core's ring is full: the device and QEMU hold it and what
 * comes after until that core catches up, where a drop would cost the client a
 * retransmission timeout; an ARP copy to a full ring is dropped: ARP asks again). */
static int held, was_held; /* this poll, the one before, stopped at a frame kept */

static int rx_frame(const uint8_t *frame, size_t len, void *arg)
{
    (void)arg;
    unsigned n = __atomic_load_n(&spread, __ATOMIC_ACQUIRE);
    if (virtio_net_pairs() > 1) { /* this core's own queue: only ARP goes on */
        unsigned me = platform_cpu();
        if (n > 1 && len >= 14 && frame[12] == 0x08 && frame[13] == 0x06) /* ARP */
            for (unsigned k = 0; k < n; k++)
                if (k != me) {
                    if (!hand_on(k, frame, len)) /* any core may copy an ARP to k */
                        __atomic_fetch_add(&rings[k]->full, 1, __ATOMIC_RELAXED);
                    arp_copied++;
                }
        input(frame, len);
        return 0;
    }
    if (n > 1) {
        int to = frame_core(frame, len, n);
        for (unsigned k = 1; to < 0 && k < n; k++)
            if (!hand_on(k, frame, len))
                rings[k]->full++; /* an ARP copy dropped */
        if (to > 0 && !hand_on((unsigned)to, frame, len)) {
            if (!was_held)
                rings[to]->full++; /* once a wait, not once a poll */
            return held = 1;
        }
        if (to > 0)
            return 0;
    }
    input(frame, len);
    return 0;
}

static err_t linkoutput(struct netif *n, struct pbuf *p)
{
    (void)n;
    if (p->tot_len > VIRTIO_NET_MAX_FRAME) {
        tx_dropped++;
        return ERR_BUF;
    }
    uint8_t *buf = virtio_net_tx_begin();
    if (!buf) {
        tx_dropped++;
        return ERR_MEM;
    }
    pbuf_copy_partial(p, buf, p->tot_len, 0);
    virtio_net_tx_commit(p->tot_len);
    return ERR_OK;
}

static err_t netif_setup(struct netif *n)
{
    n->name[0] = 'v';
    n->name[1] = 'n';
    n->hwaddr_len = 6;
    memcpy(n->hwaddr, virtio_net_mac(), 6);
    n->mtu = 1500;
    n->flags = NETIF_FLAG_BROADCAST | NETIF_FLAG_ETHARP | NETIF_FLAG_ETHERNET;
    n->output = etharp_output;
    n->linkoutput = linkoutput;
    return ERR_OK;
}

static void status_changed(struct netif *n)
{
    if (!is_static && !ip4_addr_isany_val(*netif_ip4_addr(n))) {
        char ip[16], mask[16], gw[16];
        const uint8_t *m = n->hwaddr;
        ip4addr_ntoa_r(netif_ip4_addr(n), ip, sizeof ip);
        ip4addr_ntoa_r(netif_ip4_netmask(n), mask, sizeof mask);
        ip4addr_ntoa_r(netif_ip4_gw(n), gw, sizeof gw);
        platform_printf("orisha: dhcp address %s netmask %s gateway %s "
                        "mac %02x:%02x:%02x:%02x:%02x:%02x\n",
                        ip, mask, gw, m[0], m[1], m[2], m[3], m[4], m[5]);
    }
}

/* The value of command-line option `key` (e.g. "orisha.ip=") into buf; 0 if absent. */
static int option(const char *key, char *buf, size_t size)
{
    const char *c = platform_cmdline();
    size_t klen = strlen(key);
    for (const char *p = c; *p; p++) {
        if ((p != c && p[-1] != ' ') || strncmp(p, key, klen) != 0)
            continue;
        size_t n = 0;
        for (p += klen; *p && *p != ' ' && n + 1 < size; p++)
            buf[n++] = *p;
        buf[n] = 0;
        return 1;
    }
    return 0;
}

/* orisha.ip=A.B.C.D/NN [orisha.gw=A.B.C.D]: returns 1 and fills `given`, 0 without
 * orisha.ip. `orisha boot` checks both; a bad one here is a PANIC that names it. */
static int static_address(void)
{
    char v[24];
    if (!option("orisha.ip=", v, sizeof v))
        return 0;
    char *slash = strchr(v, '/');
    unsigned prefix = 0;
    if (slash) {
        *slash = 0;
        for (const char *d = slash + 1; *d >= '0' && *d <= '9'; d++)
            prefix = prefix * 10 + (unsigned)(*d - '0');
    }
    if (!slash || prefix < 1 || prefix > 30 || !ip4addr_aton(v, &given.ip))
        PANIC("orisha.ip=%s: expected A.B.C.D/NN (NN 1 to 30)", v);
    ip4_addr_set_u32(&given.mask, lwip_htonl(0xffffffffu << (32 - prefix)));
    ip4_addr_set_zero(&given.gw);
    if (option("orisha.gw=", v, sizeof v) && !ip4addr_aton(v, &given.gw))
        PANIC("orisha.gw=%s: expected A.B.C.D", v);
    return 1;
}

static uint64_t started_ns; /* when this core's network came up (net_busy_ns) */

void net_init(void)
{
    started_ns = platform_now_ns();
    if (!virtio_net_init())
        PANIC("no virtio-net device found");
    if (platform_verbose())
        platform_printf("orisha: nic %s\n", virtio_net_describe());
    isn_keygen();
    lwip_init();
    if (!netif_add(&nif, NULL, NULL, NULL, NULL, netif_setup, ethernet_input))
        PANIC("netif_add failed");
    netif_set_default(&nif);
    netif_set_status_callback(&nif, status_changed);
    is_static = static_address();
    if (is_static) {
        char ip[16], mask[16], gw[16];
        const uint8_t *m = virtio_net_mac();
        netif_set_addr(&nif, &given.ip, &given.mask, &given.gw);
        platform_printf("orisha: static address %s netmask %s gateway %s "
                        "mac %02x:%02x:%02x:%02x:%02x:%02x\n",
                        ip4addr_ntoa_r(&given.ip, ip, sizeof ip),
                        ip4addr_ntoa_r(&given.mask, mask, sizeof mask),
                        ip4addr_ntoa_r(&given.gw, gw, sizeof gw), m[0], m[1], m[2], m[3], m[4], m[5]);
    }
    netif_set_up(&nif);
    netif_set_link_up(&nif);
    if (!is_static && dhcp_start(&nif) != ERR_OK)
        PANIC("dhcp_start failed");
}

/* Another core's frames: its ring, oldest first. */
static int ring_poll(struct frame_ring *r)
{
    int n = 0;
    uint32_t tail = r->tail;
    while (n < RX_BUDGET && tail != __atomic_load_n(&r->head, __ATOMIC_ACQUIRE)) {
        const struct frame_slot *s = &r->slot[tail % RING_SLOTS];
        input(s->data, s->len);
        __atomic_store_n(&r->tail, ++tail, __ATOMIC_RELEASE);
        n++;
    }
    return n;
}

#define MQ_SPIN_NS 50000ull
#define MQ_NAP_US 200
#define SPIN_NS 1000000ull /* core 0 with one queue pair: a client's next request under load
                            * comes within this (50 µs cost the 1 KB cell 24-42 % of its req/s) */
#define NAP_MAX_US 2000
static uint64_t last_frame_ns; /* this core's last received frame (net_wait) */
static uint64_t napped_ns;     /* this core's time in HLT (net_wait; its net line's napped_ms) */

uint64_t net_busy_ns(void)
{
    return platform_now_ns() - started_ns - napped_ns;
}

static void nap(uint32_t us)
{
    uint64_t t0 = platform_now_ns();
    platform_idle(us);
    napped_ns += platform_now_ns() - t0;
}

int net_poll(void)
{
    unsigned me = platform_cpu();
    int n;
    if (virtio_net_pairs() > 1) /* its own queue, and the ARP other cores copied it */
        n = virtio_net_rx_poll(rx_frame, NULL, RX_BUDGET) + ring_poll(rings[me]);
    else if (me)
        n = ring_poll(rings[me]);
    else {
        was_held = held;
        held = 0;
        if ((n = virtio_net_rx_poll(rx_frame, NULL, RX_BUDGET)) < RX_BUDGET && !held)
            __atomic_store_n(&drained_ns, platform_now_ns(), __ATOMIC_RELEASE);
    }
    sys_check_timeouts();
    virtio_net_flush();
    if (n)
        last_frame_ns = platform_now_ns();
    return n;
}

uint64_t net_caught_up_ns(void)
{
    uint64_t now = platform_now_ns();
    if (virtio_net_pairs() > 1)
        return now;
    uint64_t d = __atomic_load_n(&drained_ns, __ATOMIC_ACQUIRE);
    return d < now ? d : now;
}

int net_has_address(void)
{
    return platform_cpu() ? given.ready : is_static || dhcp_supplied_address(&nif);
}

/* The first core net_share gives a ring: core 0 too with a pair per core (the ARP
 * copies), else the cores core 0 feeds. */
static unsigned first_ring(void)
{
    return virtio_net_pairs() > 1 ? 0 : 1;
}

size_t net_share_bytes(unsigned cpus)
{
    return cpus > first_ring() ? (cpus - first_ring()) * (sizeof *rings[0] + 64) : 0;
}

void net_share(unsigned cpus)
{
    for (unsigned k = first_ring(); k < cpus; k++) {
        rings[k] = platform_ram_alloc(sizeof *rings[k], 64); /* above the image: alike */
        ASSERT(platform_is_shared(rings[k], sizeof *rings[k]));
    }
}

int net_spread(unsigned cpus, uint32_t wait_ms)
{
    given.ip = *netif_ip4_addr(&nif);
    given.mask = *netif_ip4_netmask(&nif);
    given.gw = *netif_ip4_gw(&nif);
    __atomic_store_n(&given.ready, 1, __ATOMIC_RELEASE);
    uint32_t t0 = platform_now_ms();
    while (__atomic_load_n(&cores_up, __ATOMIC_ACQUIRE) < cpus - 1) {
        if (platform_now_ms() - t0 > wait_ms)
            return 0;
        net_poll();
    }
    __atomic_store_n(&spread, cpus, __ATOMIC_RELEASE);
    return 1;
}

void net_init_secondary(void)
{
    while (!__atomic_load_n(&given.ready, __ATOMIC_ACQUIRE))
        platform_idle(1000);
    started_ns = platform_now_ns();
    isn_keygen(); /* RDSEED/RDRAND: the virtio-rng is core 0's */
    lwip_init();
    if (!netif_add(&nif, &given.ip, &given.mask, &given.gw, NULL, netif_setup, ethernet_input))
        PANIC("netif_add failed");
    netif_set_default(&nif);
    netif_set_up(&nif);
    netif_set_link_up(&nif);
}

void net_up(void)
{
    __atomic_fetch_add(&cores_up, 1, __ATOMIC_RELEASE);
}

void net_wait(uint32_t us)
{
    virtio_net_flush(); /* nothing sent since the last poll waits out the nap (TSO) */
    struct frame_ring *r = rings[platform_cpu()];
    if (!r) {
        /* Core 0 with one queue pair: it polls the device for every core. It polls on
         * for SPIN_NS after the last frame, and while it holds a frame for a core whose
         * ring is full; then naps in HLT until the device's interrupt (microvm, whose
         * command line names its GSI: virtio_net_rx_arm), lwIP's next timer or the
         * caller's bound. A device without an interrupt here is noticed by a poll
         * only: then the naps are an eighth of the quiet so far, from MQ_NAP_US up to
         * NAP_MAX_US (the most a frame after a long quiet waits; KVM halt-polls a
         * vCPU's HLT for up to 200 µs, so naps that short would spin in the host
         * instead). A vCPU that spins while the site is idle takes a host core for
         * good, from QEMU's I/O thread, the clients and every other process (until
         * 2026-12-06 it spun: a whole host core for an idle image). */
        uint32_t next = sys_timeouts_sleeptime(); /* ms to lwIP's next timer */
        if (held || platform_now_ns() - last_frame_ns < SPIN_NS || !next) {
            cpu_relax();
            return;
        }
        int armed = virtio_net_rx_arm();
        if (armed >= 0) { /* the device's interrupt ends the nap: as long as the caller's */
            if (armed) {
                if (next * 1000ull < us)
                    us = next * 1000;
                nap(us);
                virtio_net_rx_disarm();
            }
            return;
        }
        uint64_t quiet_us = (platform_now_ns() - last_frame_ns) / 1000;
        uint32_t nap_us = quiet_us / 8 > NAP_MAX_US ? NAP_MAX_US
                          : quiet_us / 8 < MQ_NAP_US ? MQ_NAP_US : (uint32_t)(quiet_us / 8);
        if (us > nap_us)
            us = nap_us;
        if (next * 1000ull < us)
            us = next * 1000;
        nap(us);
        return;
    }
    /* A pair per core: frames arrive on this core's own queue, which nothing but a poll
     * notices (the device's one interrupt is not per queue). Polling on for MQ_SPIN_NS
     * after the last frame, then naps of MQ_NAP_US: on a host with as many cores as
     * vCPUs, vCPUs that spin take the CPU QEMU's I/O thread and the client need
     * (bench/unikernel_cores.py). */
    if (virtio_net_pairs() > 1) {
        if (platform_now_ns() - last_frame_ns < MQ_SPIN_NS) {
            cpu_relax();
            return;
        }
        if (us > MQ_NAP_US)
            us = MQ_NAP_US;
    }
    uint32_t next = sys_timeouts_sleeptime(); /* ms to lwIP's next timer */
    if (next * 1000ull < us)
        us = next * 1000;
    __atomic_store_n(&r->sleeping, 1, __ATOMIC_SEQ_CST);
    if (us && r->tail == __atomic_load_n(&r->head, __ATOMIC_SEQ_CST))
        nap(us); /* a frame put meanwhile has sent the wake: returns at once */
    __atomic_store_n(&r->sleeping, 0, __ATOMIC_RELAXED);
}

void net_log_stats(void)
{
    const struct virtio_net_stats *st = virtio_net_stats();
    unsigned me = platform_cpu();
    if (virtio_net_pairs() > 1) {
        platform_printf("orisha: net cpu %u queue %u rx %lu tx %lu tx_ring_full %lu arp_copied %lu "
                        "ring_full %lu rx_dropped %lu tx_dropped %lu tso_frames %lu tso_segments %lu "
                        "napped_ms %lu\n",
                        me, me, (unsigned long)st->rx_frames, (unsigned long)st->tx_frames,
                        (unsigned long)st->tx_full, (unsigned long)arp_copied,
                        (unsigned long)rings[me]->full, (unsigned long)rx_dropped,
                        (unsigned long)tx_dropped, (unsigned long)st->tso_frames,
                        (unsigned long)st->tso_segments, (unsigned long)(napped_ns / 1000000u));
        return;
    }
    if (me) {
        platform_printf("orisha: net cpu %u rx %lu ring_full %lu rx_dropped %lu tx_dropped %lu "
                        "napped_ms %lu\n",
                        me, (unsigned long)rings[me]->tail, (unsigned long)rings[me]->full,
                        (unsigned long)rx_dropped, (unsigned long)tx_dropped,
                        (unsigned long)(napped_ns / 1000000u));
        return;
    }
    platform_printf("orisha: net rx %lu tx %lu tx_ring_full %lu rx_dropped %lu tx_dropped %lu "
                    "tso_frames %lu tso_segments %lu napped_ms %lu irqs %lu\n",
                    (unsigned long)st->rx_frames, (unsigned long)st->tx_frames,
                    (unsigned long)st->tx_full, (unsigned long)rx_dropped,
                    (unsigned long)tx_dropped, (unsigned long)st->tso_frames,
                    (unsigned long)st->tso_segments, (unsigned long)(napped_ns / 1000000u),
                    (unsigned long)platform_irqs());
}
