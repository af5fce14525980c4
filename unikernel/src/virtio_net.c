/*
 * virtio-net: one RX and one TX queue, polled. More cores (smp.c): only core 0
 * receives (net.c hands frames on), but any core transmits, so the driver's state
 * and buffers are mapped alike on every core (PLATFORM_SHARED, the platform arena)
 * and the TX queue is taken under a lock from tx_begin to tx_commit.
 */
#include <string.h>
#include "virtio_net.h"
#include "virtio.h"
#include "platform.h"
#include "io.h"

#define VIRTIO_ID_NET 1
#define VIRTIO_NET_F_MAC 5
#define QUEUE_MAX 256
#define BUF_SIZE 2048
#define RXQ 0
#define TXQ 1

#define VIRTIO_NET_PCI_ID 0x1000 /* transitional virtio-net-pci */

static struct virtio_dev dev PLATFORM_SHARED;
static struct virtq rxq PLATFORM_SHARED, txq PLATFORM_SHARED;
static uint8_t *rx_bufs PLATFORM_SHARED, *tx_bufs PLATFORM_SHARED;
static uint16_t tx_free[QUEUE_MAX] PLATFORM_SHARED;
static uint16_t tx_free_count PLATFORM_SHARED;
static int tx_pending PLATFORM_SHARED; /* tx_begin handed out tx_pending_id */
static uint16_t tx_pending_id PLATFORM_SHARED;
static int tx_lock PLATFORM_SHARED;
static size_t hdr_len PLATFORM_SHARED;
static uint8_t mac[6] PLATFORM_SHARED;
static struct virtio_net_stats stats PLATFORM_SHARED;
static char describe[96] PLATFORM_SHARED;

static void lock_tx(void)
{
    while (__atomic_exchange_n(&tx_lock, 1, __ATOMIC_ACQUIRE))
        cpu_relax();
}

static void unlock_tx(void)
{
    __atomic_store_n(&tx_lock, 0, __ATOMIC_RELEASE);
}

static void rx_post(uint16_t id)
{
    volatile struct virtq_desc *d = &rxq.desc[id];
    d->addr = (uintptr_t)(rx_bufs + (size_t)id * BUF_SIZE);
    d->len = BUF_SIZE;
    d->flags = VIRTQ_DESC_F_WRITE;
    d->next = 0;
    virtio_queue_push(&rxq, id);
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

    virtio_queue_setup(&dev, &rxq, RXQ, QUEUE_MAX);
    virtio_queue_setup(&dev, &txq, TXQ, QUEUE_MAX);
    rx_bufs = platform_arena_alloc((size_t)rxq.size * BUF_SIZE, 4096);
    tx_bufs = platform_arena_alloc((size_t)txq.size * BUF_SIZE, 4096);
    ASSERT(platform_is_shared(rx_bufs, (size_t)rxq.size * BUF_SIZE)); /* DMA: virtual = physical */
    ASSERT(platform_is_shared(tx_bufs, (size_t)txq.size * BUF_SIZE));
    for (uint16_t i = 0; i < txq.size; i++)
        tx_free[i] = (uint16_t)(txq.size - 1 - i);
    tx_free_count = txq.size;
    for (uint16_t i = 0; i < rxq.size; i++)
        rx_post(i);

    virtio_set_status(&dev, st | VIRTIO_STATUS_DRIVER_OK);
    virtio_queue_kick(&rxq);

    platform_snprintf(describe, sizeof describe, "%s @%#lx, %s, rxq %u txq %u",
                      dev.how, (unsigned long)dev.base, dev.modern ? "modern" : "legacy",
                      rxq.size, txq.size);
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

int virtio_net_rx_poll(virtio_net_rx_fn fn, void *arg, int budget)
{
    int n = 0;
    uint32_t id, len;
    while (n < budget && virtio_queue_pop(&rxq, &id, &len)) {
        ASSERT(id < rxq.size);
        if (len > hdr_len && len <= BUF_SIZE)
            fn(rx_bufs + (size_t)id * BUF_SIZE + hdr_len, len - hdr_len, arg);
        rx_post((uint16_t)id);
        stats.rx_frames++;
        n++;
    }
    if (n)
        virtio_queue_kick(&rxq);
    return n;
}

static void tx_reclaim(void)
{
    uint32_t id, len;
    while (virtio_queue_pop(&txq, &id, &len)) {
        ASSERT(id < txq.size && tx_free_count < txq.size);
        tx_free[tx_free_count++] = (uint16_t)id;
    }
}

uint8_t *virtio_net_tx_begin(void)
{
    lock_tx();
    ASSERT(!tx_pending);
    tx_reclaim();
    if (!tx_free_count) {
        /* Ring full: make sure the device knows, then wait a bounded time. */
        stats.tx_full++;
        virtio_queue_kick(&txq);
        uint64_t deadline = platform_now_ns() + 50000000ull; /* 50 ms */
        while (!tx_free_count && platform_now_ns() < deadline) {
            cpu_relax();
            tx_reclaim();
        }
        if (!tx_free_count) {
            unlock_tx();
            return NULL;
        }
    }
    tx_pending = 1;
    tx_pending_id = tx_free[--tx_free_count];
    uint8_t *buf = tx_bufs + (size_t)tx_pending_id * BUF_SIZE;
    memset(buf, 0, hdr_len); /* no offloads: flags 0, gso NONE */
    return buf + hdr_len;
}

void virtio_net_tx_commit(size_t len)
{
    ASSERT(tx_pending && len <= VIRTIO_NET_MAX_FRAME);
    uint16_t id = tx_pending_id;
    tx_pending = 0;
    volatile struct virtq_desc *d = &txq.desc[id];
    d->addr = (uintptr_t)(tx_bufs + (size_t)id * BUF_SIZE);
    d->len = (uint32_t)(hdr_len + len);
    d->flags = 0;
    d->next = 0;
    virtio_queue_push(&txq, id);
    stats.tx_frames++;
    /* Kick early when a batch builds up so the device can work in parallel. */
    if (txq.unkicked >= 32)
        virtio_queue_kick(&txq);
    unlock_tx();
}

void virtio_net_flush(void)
{
    /* Nothing queued to kick, nothing used to reclaim: leave the lock alone (core 0
     * passes here on every turn of its loop; the others must get the lock fast). */
    if (!__atomic_load_n(&txq.unkicked, __ATOMIC_RELAXED) && txq.last_used == txq.used->idx)
        goto rx;
    lock_tx();
    virtio_queue_kick(&txq);
    tx_reclaim();
    unlock_tx();
rx:
    if (platform_cpu() == 0) /* the receiving core's queue */
        virtio_queue_kick(&rxq);
}

const struct virtio_net_stats *virtio_net_stats(void)
{
    return &stats;
}
