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
 */
#include <string.h>
#include "virtio_net.h"
#include "virtio.h"
#include "platform.h"
#include "policy.h"
#include "io.h"

#define VIRTIO_ID_NET 1
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

struct pair {
    struct virtq rxq, txq;
    uint8_t *rx_bufs, *tx_bufs;
    uint16_t tx_free[QUEUE_MAX];
    uint16_t tx_free_count;
    int tx_pending; /* tx_begin handed out tx_pending_id */
    uint16_t tx_pending_id;
    int tx_lock;
    struct virtio_net_stats stats;
} __attribute__((aligned(64)));

static struct virtio_dev dev PLATFORM_SHARED;
static struct pair pairs[POLICY_CPUS_MAX] PLATFORM_SHARED;
static unsigned npairs PLATFORM_SHARED;
static size_t hdr_len PLATFORM_SHARED;
static uint8_t mac[6] PLATFORM_SHARED;
static char describe[128] PLATFORM_SHARED;

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
    if (dev.transport == VIRTIO_MMIO_MODERN) {
        if (!(offered & (1ull << VIRTIO_F_VERSION_1)))
            PANIC("virtio-net: modern mmio device without VERSION_1");
        want |= 1ull << VIRTIO_F_VERSION_1;
    }
    want &= offered;
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

    virtio_set_status(&dev, st | VIRTIO_STATUS_DRIVER_OK);
    if (npairs > 1 && !set_pairs(&ctrl, npairs))
        PANIC("virtio-net: the device refused %u queue pairs (VQ_PAIRS_SET)", npairs);
    for (unsigned i = 0; i < npairs; i++)
        virtio_queue_kick(&pairs[i].rxq);

    platform_snprintf(describe, sizeof describe, "%s @%#lx, %s, %u queue pair%s of %u, rxq %u txq %u",
                      dev.how, (unsigned long)dev.base, dev.modern ? "modern" : "legacy",
                      npairs, npairs == 1 ? "" : "s", max_pairs, pairs[0].rxq.size,
                      pairs[0].txq.size);
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
    while (n < budget && virtio_queue_pop(&q->rxq, &id, &len)) {
        ASSERT(id < q->rxq.size);
        if (len > hdr_len && len <= BUF_SIZE)
            fn(q->rx_bufs + (size_t)id * BUF_SIZE + hdr_len, len - hdr_len, arg);
        rx_post(q, (uint16_t)id);
        q->stats.rx_frames++;
        n++;
    }
    if (n)
        virtio_queue_kick(&q->rxq);
    return n;
}

static void tx_reclaim(struct pair *q)
{
    uint32_t id, len;
    while (virtio_queue_pop(&q->txq, &id, &len)) {
        ASSERT(id < q->txq.size && q->tx_free_count < q->txq.size);
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

void virtio_net_tx_commit(size_t len)
{
    struct pair *q = my_pair();
    ASSERT(q->tx_pending && len <= VIRTIO_NET_MAX_FRAME);
    uint16_t id = q->tx_pending_id;
    q->tx_pending = 0;
    volatile struct virtq_desc *d = &q->txq.desc[id];
    d->addr = (uintptr_t)(q->tx_bufs + (size_t)id * BUF_SIZE);
    d->len = (uint32_t)(hdr_len + len);
    d->flags = 0;
    d->next = 0;
    virtio_queue_push(&q->txq, id);
    q->stats.tx_frames++;
    /* Kick early when a batch builds up so the device can work in parallel. */
    if (q->txq.unkicked >= 32)
        virtio_queue_kick(&q->txq);
    unlock_tx(q);
}

void virtio_net_flush(void)
{
    struct pair *q = my_pair();
    /* Nothing queued to kick, nothing used to reclaim: leave the lock alone (core 0
     * passes here on every turn of its loop; the others must get the lock fast). */
    if (!__atomic_load_n(&q->txq.unkicked, __ATOMIC_RELAXED) && q->txq.last_used == q->txq.used->idx)
        goto rx;
    lock_tx(q);
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
