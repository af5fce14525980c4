/*
 * virtio-rng driver (virtio 1.2 §5.4): one queue, the driver posts a
 * device-writable buffer and the device returns it with up to its length in
 * random bytes. One 256-byte buffer, one request in flight, polled: reads are
 * rare (the TCP ISN key at boot, mbedTLS's seed and its reseeds, 128 bytes a
 * time), so a request's round trip through QEMU's main loop is all they cost.
 */
#include <string.h>
#include "virtio_rng.h"
#include "virtio.h"
#include "platform.h"
#include "io.h"

#define VIRTIO_ID_RNG 4
#define VIRTIO_RNG_PCI_ID 0x1005  /* transitional virtio-rng-pci */
#define QUEUE_MAX 8
#define BUF_SIZE 256
#define WAIT_NS 1000000000ull    /* a device that has not answered in 1 s is gone */

static struct virtio_dev dev;
static struct virtq q;
static uint8_t *buf;
static int usable;
static char describe[64];

int virtio_rng_init(void)
{
    int found = virtio_find(VIRTIO_ID_RNG, VIRTIO_RNG_PCI_ID, &dev);
    if (found < 0) /* optional: say why it is not used, and go on without it */
        platform_printf("orisha: virtio-rng-pci without its legacy interface: not used "
                        "(disable-legacy=off)\n");
    if (found <= 0)
        return 0;
    virtio_set_status(&dev, 0); /* reset */
    virtio_set_status(&dev, VIRTIO_STATUS_ACK);
    virtio_set_status(&dev, VIRTIO_STATUS_ACK | VIRTIO_STATUS_DRIVER);
    uint64_t want = 0; /* the entropy device has no feature bits of its own */
    if (dev.transport == VIRTIO_MMIO_MODERN) {
        if (!(virtio_get_features(&dev) & (1ull << VIRTIO_F_VERSION_1)))
            return 0;
        want = 1ull << VIRTIO_F_VERSION_1;
    }
    virtio_set_features(&dev, want);
    uint8_t st = VIRTIO_STATUS_ACK | VIRTIO_STATUS_DRIVER;
    if (dev.modern) {
        st |= VIRTIO_STATUS_FEATURES_OK;
        virtio_set_status(&dev, st);
        if (!(virtio_get_status(&dev) & VIRTIO_STATUS_FEATURES_OK)) {
            virtio_set_status(&dev, VIRTIO_STATUS_FAILED);
            return 0;
        }
    }
    virtio_queue_setup(&dev, &q, 0, QUEUE_MAX);
    buf = platform_arena_alloc(BUF_SIZE, 64);
    virtio_set_status(&dev, st | VIRTIO_STATUS_DRIVER_OK);
    usable = 1;
    platform_snprintf(describe, sizeof describe, "%s @%#lx", dev.how, (unsigned long)dev.base);
    return 1;
}

const char *virtio_rng_describe(void)
{
    return usable ? describe : "none";
}

/* One request of up to BUF_SIZE bytes: how many came back (0: an empty answer),
 * or -1 if none came before the deadline. */
static long request(size_t want, uint64_t deadline)
{
    volatile struct virtq_desc *d = &q.desc[0];
    d->addr = (uintptr_t)buf;
    d->len = (uint32_t)want;
    d->flags = VIRTQ_DESC_F_WRITE;
    d->next = 0;
    virtio_queue_push(&q, 0);
    virtio_queue_kick(&q);
    uint32_t id, len;
    while (!virtio_queue_pop(&q, &id, &len)) {
        if (platform_now_ns() > deadline)
            return -1;
        cpu_relax();
    }
    compiler_barrier(); /* the device wrote buf before it published the used entry */
    ASSERT(id == 0);
    return (long)(len < want ? len : want);
}

int virtio_rng_read(void *out, size_t len)
{
    uint8_t *p = out;
    uint64_t deadline = platform_now_ns() + WAIT_NS;
    while (usable && len) {
        long n = request(len < BUF_SIZE ? len : BUF_SIZE, deadline);
        if (n < 0) {
            /* Silent: the one descriptor is still the device's, so it is never
             * posted again. */
            usable = 0;
            platform_printf("orisha: virtio-rng stopped answering: not used any more\n");
            break;
        }
        memcpy(p, buf, (size_t)n);
        p += n;
        len -= (size_t)n;
    }
    return len ? -1 : 0;
}
