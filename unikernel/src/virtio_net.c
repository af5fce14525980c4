/*
 * virtio-net: queue pairs (an RX and a TX queue each), polled.
 *
 * One pair (the device offers no VIRTIO_NET_F_MQ: QEMU's user networking, or one
 * core): only core 0 receives (net.c hands frames on), but any core transmits, so the
 * driver's state and buffers are mapped alike on every core (PLATFORM_SHARED, the
 * platform arena) and the TX queue is taken under a lock from tx_begin to tx_commit.
 *
 * A pair per core (the device offers MQ + CTRL_VQ, e.g. `-netdev tap,queues=N` with
 * `mq=on`, and more than one core was asked for): queues 2i and 2i+1 are core i's,
 * the control queue is 2 * max_virtqueue_pairs (virtio 1.1 §5.1.2), and
 * VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET turns the pairs on. The host's tap then steers each
 * flow to one queue (and keeps it on the queue the guest answers on), so every core
 * receives and transmits its own connections; the per-pair lock stays uncontended.
 *
 * TCP segmentation offload (the device offers VIRTIO_NET_F_CSUM + HOST_TSO4: a tap, whose
 * backend takes a virtio_net_hdr; QEMU's user networking does not): lwIP emits MSS-sized
 * segments one by one; a run of in-order full segments of one flow that lwIP emits in one
 * turn of the loop (same headers but for the sequence number, only ACK and PSH set) is
 * gathered into one frame of up to 64 KiB with GSO_TCPV4 and NEEDS_CSUM (its TCP checksum
 * field the pseudo-header's sum, the host folding in the rest), closed by a short segment,
 * any other frame of this pair, or the end of the turn (virtio_net_flush). The host's tap
 * hands such a frame to its stack as one packet (or segments it): one descriptor, one
 * copy into the host and one trip through its TCP for up to 44 segments.
 */
#include <string.h>
#include "virtio_net.h"
#include "virtio.h"
#include "platform.h"
#include "policy.h"
#include "io.h"

#define VIRTIO_ID_NET 1
#define VIRTIO_NET_F_CSUM 0
#define VIRTIO_NET_F_HOST_TSO4 11
#define VIRTIO_NET_F_MAC 5
#define VIRTIO_NET_F_CTRL_VQ 17
#define VIRTIO_NET_F_MQ 22
#define CONFIG_MAX_PAIRS 8   /* config: mac[6], status (le16), max_virtqueue_pairs (le16) */
#define CTRL_MQ 4
#define CTRL_MQ_VQ_PAIRS_SET 0
#define CTRL_TIMEOUT_NS 1000000000ull
#define QUEUE_MAX 256
#define BUF_SIZE 2048

#define VIRTIO_NET_PCI_ID 0x1000 /* transitional virtio-net-pci */

/* Gathered TCP frames (TSO): buffers of a 64 KiB IP packet, a few per pair. */
#define BIG_COUNT 16
#define BIG_SIZE (65536 + 64)
#define TSO_MAX_IP 65535u
#define HDR_F_NEEDS_CSUM 1
#define HDR_GSO_TCPV4 1

struct held { /* the gathered frame being built (id < 0: none) */
    int id;             /* its descriptor (and big_of[id]: its buffer) */
    uint8_t *frame;     /* the Ethernet frame in its big buffer, after the virtio header */
    uint32_t len;       /* bytes of the frame so far */
    uint32_t next_seq;  /* the sequence number a segment must carry to be appended */
    uint16_t mss, last, segs, thl;
};

struct pair {
    struct virtq rxq, txq;
    uint8_t *rx_bufs, *tx_bufs;
    uint16_t tx_free[QUEUE_MAX];
    uint16_t tx_free_count;
    int tx_pending; /* tx_begin handed out tx_pending_id */
    uint16_t tx_pending_id;
    int tx_lock;
    uint8_t *big_bufs;
    int8_t big_of[QUEUE_MAX];     /* descriptor id -> its big buffer, -1: a small one */
    uint8_t big_free[BIG_COUNT];
    uint8_t big_free_count;
    struct held held;
    struct virtio_net_stats stats;
} __attribute__((aligned(64)));

static struct virtio_dev dev PLATFORM_SHARED;
static struct pair pairs[POLICY_CPUS_MAX] PLATFORM_SHARED;
static unsigned npairs PLATFORM_SHARED;
static size_t hdr_len PLATFORM_SHARED;
static uint8_t mac[6] PLATFORM_SHARED;
static char describe[160] PLATFORM_SHARED;
static int tso PLATFORM_SHARED; /* CSUM + HOST_TSO4 negotiated */
static int irq_wakes PLATFORM_SHARED; /* one pair and the device's GSI known: it wakes core 0 */

static void lock_tx(struct pair *q)
{
    while (__atomic_exchange_n(&q->tx_lock, 1, __ATOMIC_ACQUIRE))
        cpu_relax();
}

static void unlock_tx(struct pair *q)
{
    __atomic_store_n(&q->tx_lock, 0, __ATOMIC_RELEASE);
}

/* The pair this core transmits on: its own with a pair per core, else the one. */
static struct pair *my_pair(void)
{
    return &pairs[npairs > 1 ? platform_cpu() : 0];
}

static void rx_post(struct pair *q, uint16_t id)
{
    volatile struct virtq_desc *d = &q->rxq.desc[id];
    d->addr = (uintptr_t)(q->rx_bufs + (size_t)id * BUF_SIZE);
    d->len = BUF_SIZE;
    d->flags = VIRTQ_DESC_F_WRITE;
    d->next = 0;
    virtio_queue_push(&q->rxq, id);
}

/* Buffers for pair i: pair 0's from the platform arena (as with one queue), the
 * others' from the RAM above the image, which core 0 allocates before the other cores
 * take their shares and which is mapped alike (virtual = physical) on every core. */
static void *dma_alloc(unsigned i, size_t size)
{
    void *p = i ? platform_ram_alloc(size, 4096) : platform_arena_alloc(size, 4096);
    ASSERT(platform_is_shared(p, size)); /* DMA: virtual = physical */
    return p;
}

static void pair_setup(unsigned i)
{
    struct pair *q = &pairs[i];
    virtio_queue_setup(&dev, &q->rxq, (uint16_t)(2 * i), QUEUE_MAX);
    virtio_queue_setup(&dev, &q->txq, (uint16_t)(2 * i + 1), QUEUE_MAX);
    ASSERT(q->txq.size <= QUEUE_MAX);
    q->rx_bufs = dma_alloc(i, (size_t)q->rxq.size * BUF_SIZE);
    q->tx_bufs = dma_alloc(i, (size_t)q->txq.size * BUF_SIZE);
    for (uint16_t k = 0; k < q->txq.size; k++)
        q->tx_free[k] = (uint16_t)(q->txq.size - 1 - k);
    q->tx_free_count = q->txq.size;
    for (uint16_t k = 0; k < q->rxq.size; k++)
        rx_post(q, k);
    q->held.id = -1;
    for (unsigned k = 0; k < QUEUE_MAX; k++)
        q->big_of[k] = -1;
    if (tso) { /* from the RAM above the image, mapped alike on every core */
        q->big_bufs = platform_ram_alloc((size_t)BIG_COUNT * BIG_SIZE, 4096);
        ASSERT(platform_is_shared(q->big_bufs, (size_t)BIG_COUNT * BIG_SIZE));
        for (unsigned k = 0; k < BIG_COUNT; k++)
            q->big_free[k] = (uint8_t)k;
        q->big_free_count = BIG_COUNT;
    }
}

/* VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET (virtio 1.1 §5.1.6.5.5): a chain of the command's
 * header and data (device-readable) and its ack byte (device-writable), polled. */
static int set_pairs(struct virtq *ctrl, unsigned n)
{
    struct { uint8_t class, cmd; uint16_t pairs; uint8_t ack; } *c = platform_arena_alloc(8, 8);
    ASSERT(platform_is_shared(c, 8));
    c->class = CTRL_MQ;
    c->cmd = CTRL_MQ_VQ_PAIRS_SET;
    c->pairs = (uint16_t)n;
    c->ack = 0xff;
    uintptr_t pa = (uintptr_t)c;
    ctrl->desc[0] = (struct virtq_desc){ pa, 2, VIRTQ_DESC_F_NEXT, 1 };
    ctrl->desc[1] = (struct virtq_desc){ pa + 2, 2, VIRTQ_DESC_F_NEXT, 2 };
    ctrl->desc[2] = (struct virtq_desc){ pa + 4, 1, VIRTQ_DESC_F_WRITE, 0 };
    virtio_queue_push(ctrl, 0);
    virtio_queue_kick(ctrl);
    uint32_t id, len;
    uint64_t deadline = platform_now_ns() + CTRL_TIMEOUT_NS;
    while (!virtio_queue_pop(ctrl, &id, &len)) {
        if (platform_now_ns() > deadline)
            return 0;
        cpu_relax();
    }
    return __atomic_load_n(&c->ack, __ATOMIC_ACQUIRE) == 0; /* VIRTIO_NET_OK */
}

int virtio_net_init(void)
{
    int found = virtio_find(VIRTIO_ID_NET, VIRTIO_NET_PCI_ID, &dev);
    if (found < 0)
        PANIC("virtio-net-pci: no legacy I/O BAR0 (modern-only device? use disable-legacy=off)");
    if (!found)
        return 0;

    virtio_set_status(&dev, 0); /* reset */
    virtio_set_status(&dev, VIRTIO_STATUS_ACK);
    virtio_set_status(&dev, VIRTIO_STATUS_ACK | VIRTIO_STATUS_DRIVER);
    uint64_t offered = virtio_get_features(&dev);
    uint64_t want = (1ull << VIRTIO_NET_F_MAC);
    uint64_t mq = (1ull << VIRTIO_NET_F_MQ) | (1ull << VIRTIO_NET_F_CTRL_VQ);
    if (platform_cpus_asked() > 1 && (offered & mq) == mq)
        want |= mq;
    uint64_t offload = (1ull << VIRTIO_NET_F_CSUM) | (1ull << VIRTIO_NET_F_HOST_TSO4);
    if ((offered & offload) == offload && !platform_cmdline_has("orisha.tso=off"))
        want |= offload;
    if (dev.transport == VIRTIO_MMIO_MODERN) {
        if (!(offered & (1ull << VIRTIO_F_VERSION_1)))
            PANIC("virtio-net: modern mmio device without VERSION_1");
        want |= 1ull << VIRTIO_F_VERSION_1;
    }
    want &= offered;
    tso = (want & offload) == offload;
    virtio_set_features(&dev, want);
    uint8_t st = VIRTIO_STATUS_ACK | VIRTIO_STATUS_DRIVER;
    if (dev.modern) {
        st |= VIRTIO_STATUS_FEATURES_OK;
        virtio_set_status(&dev, st);
        if (!(virtio_get_status(&dev) & VIRTIO_STATUS_FEATURES_OK))
            PANIC("virtio-net: device rejected features %#lx", (unsigned long)want);
    }
    /* struct virtio_net_hdr: 10 bytes, +2 (num_buffers) with VERSION_1. */
    hdr_len = dev.modern ? 12 : 10;

    if (want & (1ull << VIRTIO_NET_F_MAC)) {
        for (int i = 0; i < 6; i++)
            mac[i] = virtio_config_read8(&dev, (unsigned)i);
    } else {
        static const uint8_t fallback[6] = { 0x52, 0x54, 0x00, 0x12, 0x34, 0x56 };
        memcpy(mac, fallback, 6);
    }

    /* A pair per core asked for, if the device has as many (else one: core 0 hands on). */
    unsigned max_pairs = (want & mq) ? virtio_config_read16(&dev, CONFIG_MAX_PAIRS) : 1;
    npairs = platform_cpus_asked() <= max_pairs ? platform_cpus_asked() : 1;
    static struct virtq ctrl PLATFORM_SHARED;
    for (unsigned i = 0; i < npairs; i++)
        pair_setup(i);
    if (want & mq)
        virtio_queue_setup(&dev, &ctrl, (uint16_t)(2 * max_pairs), 64);

    /* Polled: no notifications (virtio_net_rx_arm turns the receive queue's on for a nap). */
    for (unsigned i = 0; i < npairs; i++) {
        virtio_queue_interrupts(&pairs[i].rxq, 0);
        virtio_queue_interrupts(&pairs[i].txq, 0);
    }
    irq_wakes = npairs == 1 && dev.irq && platform_irq_to_core0(dev.irq);
    virtio_set_status(&dev, st | VIRTIO_STATUS_DRIVER_OK);
    if (npairs > 1 && !set_pairs(&ctrl, npairs))
        PANIC("virtio-net: the device refused %u queue pairs (VQ_PAIRS_SET)", npairs);
    for (unsigned i = 0; i < npairs; i++)
        virtio_queue_kick(&pairs[i].rxq);

    char wakes[24] = ", polled";
    if (irq_wakes)
        platform_snprintf(wakes, sizeof wakes, ", irq %u", (unsigned)dev.irq);
    platform_snprintf(describe, sizeof describe, "%s @%#lx, %s, %u queue pair%s of %u, rxq %u txq %u%s%s",
                      dev.how, (unsigned long)dev.base, dev.modern ? "modern" : "legacy",
                      npairs, npairs == 1 ? "" : "s", max_pairs, pairs[0].rxq.size,
                      pairs[0].txq.size, tso ? ", tso" : "", wakes);
    return 1;
}

const uint8_t *virtio_net_mac(void)
{
    return mac;
}

const char *virtio_net_describe(void)
{
    return describe;
}

unsigned virtio_net_pairs(void)
{
    return npairs;
}

int virtio_net_rx_poll(virtio_net_rx_fn fn, void *arg, int budget)
{
    struct pair *q = my_pair();
    int n = 0;
    uint32_t id, len;
    while (n < budget && virtio_queue_peek(&q->rxq, &id, &len)) {
        ASSERT(id < q->rxq.size);
        if (len > hdr_len && len <= BUF_SIZE &&
            fn(q->rx_bufs + (size_t)id * BUF_SIZE + hdr_len, len - hdr_len, arg))
            break; /* kept: the device holds the rest meanwhile (QEMU queues behind it) */
        virtio_queue_pop(&q->rxq, &id, &len);
        rx_post(q, (uint16_t)id);
        q->stats.rx_frames++;
        n++;
    }
    if (n)
        virtio_queue_kick(&q->rxq);
    return n;
}

int virtio_net_rx_arm(void)
{
    if (!irq_wakes)
        return -1;
    struct pair *q = &pairs[0];
    uint32_t id, len;
    /* Notifications on, the line lowered, then a last look: a frame the device puts
     * after that raises the line again, and the interrupt ends the nap. */
    virtio_queue_interrupts(&q->rxq, 1);
    virtio_irq_ack(&dev);
    if (!virtio_queue_peek(&q->rxq, &id, &len))
        return 1;
    virtio_queue_interrupts(&q->rxq, 0);
    return 0;
}

void virtio_net_rx_disarm(void)
{
    if (irq_wakes)
        virtio_queue_interrupts(&pairs[0].rxq, 0);
}

static void tx_reclaim(struct pair *q)
{
    uint32_t id, len;
    while (virtio_queue_pop(&q->txq, &id, &len)) {
        ASSERT(id < q->txq.size && q->tx_free_count < q->txq.size);
        if (q->big_of[id] >= 0) {
            q->big_free[q->big_free_count++] = (uint8_t)q->big_of[id];
            q->big_of[id] = -1;
        }
        q->tx_free[q->tx_free_count++] = (uint16_t)id;
    }
}

uint8_t *virtio_net_tx_begin(void)
{
    struct pair *q = my_pair();
    lock_tx(q);
    ASSERT(!q->tx_pending);
    tx_reclaim(q);
    if (!q->tx_free_count) {
        /* Ring full: make sure the device knows, then wait a bounded time. */
        q->stats.tx_full++;
        virtio_queue_kick(&q->txq);
        uint64_t deadline = platform_now_ns() + 50000000ull; /* 50 ms */
        while (!q->tx_free_count && platform_now_ns() < deadline) {
            cpu_relax();
            tx_reclaim(q);
        }
        if (!q->tx_free_count) {
            unlock_tx(q);
            return NULL;
        }
    }
    q->tx_pending = 1;
    q->tx_pending_id = q->tx_free[--q->tx_free_count];
    uint8_t *buf = q->tx_bufs + (size_t)q->tx_pending_id * BUF_SIZE;
    memset(buf, 0, hdr_len); /* no offloads: flags 0, gso NONE */
    return buf + hdr_len;
}

static uint16_t be16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }
static uint32_t be32(const uint8_t *p) { return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3]; }
static void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)(v >> 8); p[1] = (uint8_t)v; }

static void push(struct pair *q, uint16_t id, uintptr_t addr, uint32_t len)
{
    volatile struct virtq_desc *d = &q->txq.desc[id];
    d->addr = addr;
    d->len = len;
    d->flags = 0;
    d->next = 0;
    virtio_queue_push(&q->txq, id);
    q->stats.tx_frames++;
    /* Kick early when a batch builds up so the device can work in parallel. */
    if (q->txq.unkicked >= 32)
        virtio_queue_kick(&q->txq);
}

/* A TCP/IPv4 segment with data that may be gathered: no IP options or fragments, no
 * padding, flags ACK (and PSH) only. Its TCP header length and payload bytes, else 0. */
static uint32_t gatherable(const uint8_t *f, size_t len, uint16_t *thl)
{
    if (len < 54 || be16(f + 12) != 0x0800 || f[14] != 0x45 || f[23] != 6)
        return 0;
    const uint8_t *ip = f + 14, *tcp = f + 34;
    if ((be16(ip + 6) & 0x3fff) || 14u + be16(ip + 2) != len)
        return 0;
    *thl = (uint16_t)((tcp[12] >> 4) * 4);
    if (*thl < 20 || 34u + *thl >= len || (tcp[13] & ~0x08) != 0x10)
        return 0;
    return (uint32_t)len - 34u - *thl;
}

/* Send the gathered frame: as it is if it holds one segment (lwIP's checksums stand),
 * else with its IP length and checksum made anew and the GSO header. */
static void close_held(struct pair *q)
{
    struct held *h = &q->held;
    if (h->id < 0)
        return;
    uint8_t *vh = h->frame - hdr_len, *ip = h->frame + 14, *tcp = h->frame + 34;
    if (h->segs > 1) {
        uint32_t ip_len = h->len - 14u;
        put16(ip + 2, (uint16_t)ip_len);
        put16(ip + 10, 0);
        uint32_t sum = 0;
        for (int i = 0; i < 20; i += 2)
            sum += be16(ip + i);
        while (sum >> 16)
            sum = (sum & 0xffff) + (sum >> 16);
        put16(ip + 10, (uint16_t)~sum);
        /* NEEDS_CSUM: the field holds the pseudo-header's sum, not complemented. */
        sum = be16(ip + 12) + be16(ip + 14) + be16(ip + 16) + be16(ip + 18) + 6u + (ip_len - 20u);
        while (sum >> 16)
            sum = (sum & 0xffff) + (sum >> 16);
        put16(tcp + 16, (uint16_t)sum);
        vh[0] = HDR_F_NEEDS_CSUM;
        vh[1] = HDR_GSO_TCPV4;
        uint16_t hl = (uint16_t)(34u + h->thl), start = 34, off = 16;
        memcpy(vh + 2, &hl, 2); /* little-endian fields (legacy on x86, VERSION_1 LE) */
        memcpy(vh + 4, &h->mss, 2);
        memcpy(vh + 6, &start, 2);
        memcpy(vh + 8, &off, 2);
        q->stats.tso_frames++;
        q->stats.tso_segments += h->segs;
    }
    push(q, (uint16_t)h->id, (uintptr_t)vh, (uint32_t)(hdr_len + h->len));
    h->id = -1;
}

/* Append the segment in f to the gathered frame if it continues it; 1 if taken. */
static int append(struct pair *q, const uint8_t *f, uint32_t n, uint16_t thl)
{
    struct held *h = &q->held;
    const uint8_t *g = h->frame;
    if (h->id < 0 || thl != h->thl || h->last != h->mss || n > h->mss
        || be32(f + 38) != h->next_seq || h->len + n - 14u > TSO_MAX_IP
        || memcmp(f, g, 16) || memcmp(f + 22, g + 22, 2) || memcmp(f + 26, g + 26, 12)
        || memcmp(f + 42, g + 42, 5) || memcmp(f + 48, g + 48, 2)
        || memcmp(f + 52, g + 52, 2 + (thl - 20u)))
        return 0; /* MACs, type, IP ver/TOS, TTL/proto, addresses, ports, ACK and data
                   * offset, window, urgent pointer and options */
    if (q->big_of[h->id] < 0) { /* its second segment: from the small buffer to a big one */
        if (!q->big_free_count)
            return 0;
        int big = q->big_free[--q->big_free_count];
        q->big_of[h->id] = (int8_t)big;
        uint8_t *vh = q->big_bufs + (size_t)big * BIG_SIZE;
        memcpy(vh + hdr_len, h->frame, h->len); /* the small buffer's header is all zeros */
        memset(vh, 0, hdr_len);
        h->frame = vh + hdr_len;
    }
    memcpy(h->frame + h->len, f + 34 + thl, n);
    h->len += n;
    h->next_seq += n;
    h->last = (uint16_t)n;
    h->segs++;
    h->frame[47] |= f[47]; /* PSH */
    return 1;
}

/* Start gathering at the segment in descriptor id's small buffer, where it stays until
 * a second one comes (a single segment leaves as it is, uncopied). */
static void start_held(struct pair *q, uint16_t id, uint8_t *f, uint32_t len, uint32_t n,
                       uint16_t thl)
{
    struct held *h = &q->held;
    h->frame = f;
    h->id = id;
    h->len = len;
    h->mss = h->last = (uint16_t)n;
    h->next_seq = be32(f + 38) + n;
    h->segs = 1;
    h->thl = thl;
}

void virtio_net_tx_commit(size_t len)
{
    struct pair *q = my_pair();
    ASSERT(q->tx_pending && len <= VIRTIO_NET_MAX_FRAME);
    uint16_t id = q->tx_pending_id;
    q->tx_pending = 0;
    uint8_t *buf = q->tx_bufs + (size_t)id * BUF_SIZE;
    if (tso) {
        uint16_t thl = 0;
        uint32_t n = gatherable(buf + hdr_len, len, &thl);
        if (n && append(q, buf + hdr_len, n, thl)) {
            q->tx_free[q->tx_free_count++] = id; /* its bytes are in the gathered frame */
            if (n < q->held.mss)
                close_held(q);
            unlock_tx(q);
            return;
        }
        close_held(q); /* anything else of this pair goes after it */
        if (n >= 536 && q->big_free_count) {
            start_held(q, id, buf + hdr_len, (uint32_t)len, n, thl);
            unlock_tx(q);
            return;
        }
    }
    push(q, id, (uintptr_t)buf, (uint32_t)(hdr_len + len));
    unlock_tx(q);
}

void virtio_net_flush(void)
{
    struct pair *q = my_pair();
    /* Nothing queued to kick, nothing used to reclaim: leave the lock alone (core 0
     * passes here on every turn of its loop; the others must get the lock fast). */
    if (!__atomic_load_n(&q->txq.unkicked, __ATOMIC_RELAXED) && q->txq.last_used == q->txq.used->idx
        && __atomic_load_n(&q->held.id, __ATOMIC_RELAXED) < 0)
        goto rx;
    lock_tx(q);
    close_held(q); /* the end of the turn: what was gathered goes */
    virtio_queue_kick(&q->txq);
    tx_reclaim(q);
    unlock_tx(q);
rx:
    if (npairs > 1 || platform_cpu() == 0) /* the receiving core's queue */
        virtio_queue_kick(&q->rxq);
}

const struct virtio_net_stats *virtio_net_stats(void)
{
    return &my_pair()->stats;
}
