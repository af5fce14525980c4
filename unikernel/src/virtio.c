#include <string.h>
#include "virtio.h"
#include "io.h"
#include "pci.h"
#include "platform.h"

/* virtio-mmio registers */
#define MMIO_MAGIC          0x000
#define MMIO_VERSION        0x004
#define MMIO_DEVICE_ID      0x008
#define MMIO_DEV_FEATURES   0x010
#define MMIO_DEV_FEAT_SEL   0x014
#define MMIO_DRV_FEATURES   0x020
#define MMIO_DRV_FEAT_SEL   0x024
#define MMIO_GUEST_PAGE     0x028
#define MMIO_QUEUE_SEL      0x030
#define MMIO_QUEUE_NUM_MAX  0x034
#define MMIO_QUEUE_NUM      0x038
#define MMIO_QUEUE_ALIGN    0x03c
#define MMIO_QUEUE_PFN      0x040
#define MMIO_QUEUE_READY    0x044
#define MMIO_QUEUE_NOTIFY   0x050
#define MMIO_INT_STATUS     0x060
#define MMIO_INT_ACK        0x064
#define MMIO_STATUS         0x070
#define MMIO_QUEUE_DESC_LO  0x080
#define MMIO_QUEUE_DESC_HI  0x084
#define MMIO_QUEUE_AVAIL_LO 0x090
#define MMIO_QUEUE_AVAIL_HI 0x094
#define MMIO_QUEUE_USED_LO  0x0a0
#define MMIO_QUEUE_USED_HI  0x0a4
#define MMIO_CONFIG         0x100
#define MMIO_MAGIC_VALUE    0x74726976u /* "virt" */

/* legacy virtio-pci I/O registers */
#define PCI_HOST_FEATURES   0x00
#define PCI_GUEST_FEATURES  0x04
#define PCI_QUEUE_PFN       0x08
#define PCI_QUEUE_NUM       0x0c
#define PCI_QUEUE_SEL       0x0e
#define PCI_QUEUE_NOTIFY    0x10
#define PCI_STATUS          0x12
#define PCI_ISR             0x13   /* read: the status, and acknowledged */
#define PCI_CONFIG          0x14   /* without MSI-X */

#define LEGACY_ALIGN 4096u

static uint32_t mr(struct virtio_dev *d, unsigned off) { return mmio_read32(d->base + off); }
static void mw(struct virtio_dev *d, unsigned off, uint32_t v) { mmio_write32(d->base + off, v); }

/* microvm places virtio-mmio transports here, 512 bytes apart. */
#define MICROVM_MMIO_BASE 0xfeb00000u
#define MICROVM_MMIO_SLOTS 24
#define MMIO_WINDOW 0x200
#define PCI_VENDOR_VIRTIO 0x1af4
#define PCI_MODERN_BASE 0x1040  /* a modern-only function's device id: 0x1040 + virtio id */

static int mmio_probe(uintptr_t base, struct virtio_dev *dev)
{
    if (mmio_read32(base + MMIO_MAGIC) != MMIO_MAGIC_VALUE)
        return 0;
    uint32_t version = mmio_read32(base + MMIO_VERSION);
    uint32_t id = mmio_read32(base + MMIO_DEVICE_ID);
    if (id == 0 || (version != 1 && version != 2))
        return 0;
    dev->transport = version == 1 ? VIRTIO_MMIO_LEGACY : VIRTIO_MMIO_MODERN;
    dev->base = base;
    dev->device_id = id;
    dev->modern = 0;
    return 1;
}

static uint64_t parse_hex(const char **p)
{
    uint64_t v = 0;
    const char *s = *p;
    if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X'))
        s += 2;
    for (;; s++) {
        char c = *s;
        unsigned d;
        if (c >= '0' && c <= '9') d = (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') d = (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') d = (unsigned)(c - 'A' + 10);
        else break;
        v = v * 16 + d;
    }
    *p = s;
    return v;
}

/* Command line entries look like "virtio_mmio.device=512@0xfeb00e00:12"
 * (added by QEMU microvm's auto-kernel-cmdline, one per transport in use). */
static int find_mmio_from_cmdline(uint32_t id, struct virtio_dev *dev)
{
    const char *key = "virtio_mmio.device=";
    size_t klen = strlen(key);
    for (const char *p = platform_cmdline(); *p; p++) {
        if (strncmp(p, key, klen) != 0)
            continue;
        const char *s = p + klen;
        while (*s && *s != '@' && *s != ' ')
            s++;
        if (*s != '@')
            continue;
        s++;
        uintptr_t base = (uintptr_t)parse_hex(&s);
        uint32_t irq = 0;
        if (*s == ':')
            for (s++; *s >= '0' && *s <= '9'; s++)
                irq = irq * 10 + (uint32_t)(*s - '0');
        if (mmio_probe(base, dev) && dev->device_id == id) {
            dev->irq = irq;
            return 1;
        }
    }
    return 0;
}

static int find_pci(uint32_t id, uint16_t pci_id, struct virtio_dev *dev)
{
    struct pci_addr a;
    if (!pci_present())
        return 0;
    if (!pci_find(PCI_VENDOR_VIRTIO, pci_id, &a))
        return pci_find(PCI_VENDOR_VIRTIO, (uint16_t)(PCI_MODERN_BASE + id), &a) ? -1 : 0;
    uint32_t bar0 = pci_read32(a, 0x10);
    if (!(bar0 & 1))
        return -1;
    pci_enable(a);
    dev->transport = VIRTIO_PCI_LEGACY;
    dev->base = bar0 & ~3u;
    dev->device_id = id;
    dev->modern = 0;
    return 1;
}

static int find_mmio_by_scan(uint32_t id, struct virtio_dev *dev)
{
    for (unsigned i = 0; i < MICROVM_MMIO_SLOTS; i++)
        if (mmio_probe(MICROVM_MMIO_BASE + i * MMIO_WINDOW, dev) && dev->device_id == id)
            return 1;
    return 0;
}

int virtio_find(uint32_t id, uint16_t pci_id, struct virtio_dev *dev)
{
    if (find_mmio_from_cmdline(id, dev)) {
        dev->how = "virtio-mmio (cmdline)";
        return 1;
    }
    int pci = find_pci(id, pci_id, dev);
    if (pci) {
        dev->how = "virtio-pci legacy";
        return pci;
    }
    if (find_mmio_by_scan(id, dev)) {
        dev->how = "virtio-mmio (scan)";
        return 1;
    }
    return 0;
}

uint8_t virtio_get_status(struct virtio_dev *dev)
{
    if (dev->transport == VIRTIO_PCI_LEGACY)
        return inb((uint16_t)(dev->base + PCI_STATUS));
    return (uint8_t)mr(dev, MMIO_STATUS);
}

void virtio_set_status(struct virtio_dev *dev, uint8_t status)
{
    if (dev->transport == VIRTIO_PCI_LEGACY)
        outb((uint16_t)(dev->base + PCI_STATUS), status);
    else
        mw(dev, MMIO_STATUS, status);
}

uint64_t virtio_get_features(struct virtio_dev *dev)
{
    if (dev->transport == VIRTIO_PCI_LEGACY)
        return inl((uint16_t)(dev->base + PCI_HOST_FEATURES));
    mw(dev, MMIO_DEV_FEAT_SEL, 0);
    uint64_t f = mr(dev, MMIO_DEV_FEATURES);
    if (dev->transport == VIRTIO_MMIO_MODERN) {
        mw(dev, MMIO_DEV_FEAT_SEL, 1);
        f |= (uint64_t)mr(dev, MMIO_DEV_FEATURES) << 32;
    }
    return f;
}

void virtio_set_features(struct virtio_dev *dev, uint64_t features)
{
    dev->modern = (features >> VIRTIO_F_VERSION_1) & 1;
    if (dev->transport == VIRTIO_PCI_LEGACY) {
        outl((uint16_t)(dev->base + PCI_GUEST_FEATURES), (uint32_t)features);
        return;
    }
    mw(dev, MMIO_DRV_FEAT_SEL, 0);
    mw(dev, MMIO_DRV_FEATURES, (uint32_t)features);
    if (dev->transport == VIRTIO_MMIO_MODERN) {
        mw(dev, MMIO_DRV_FEAT_SEL, 1);
        mw(dev, MMIO_DRV_FEATURES, (uint32_t)(features >> 32));
    }
}

uint8_t virtio_config_read8(struct virtio_dev *dev, unsigned off)
{
    if (dev->transport == VIRTIO_PCI_LEGACY)
        return inb((uint16_t)(dev->base + PCI_CONFIG + off));
    return mmio_read8(dev->base + MMIO_CONFIG + off);
}

uint16_t virtio_config_read16(struct virtio_dev *dev, unsigned off)
{
    return (uint16_t)(virtio_config_read8(dev, off) | virtio_config_read8(dev, off + 1) << 8);
}

static size_t align_up(size_t v, size_t a)
{
    return (v + a - 1) & ~(a - 1);
}

void virtio_queue_setup(struct virtio_dev *dev, struct virtq *q, uint16_t index, uint16_t max_size)
{
    uint32_t size;
    if (dev->transport == VIRTIO_PCI_LEGACY) {
        outw((uint16_t)(dev->base + PCI_QUEUE_SEL), index);
        size = inw((uint16_t)(dev->base + PCI_QUEUE_NUM)); /* fixed by device */
    } else {
        mw(dev, MMIO_QUEUE_SEL, index);
        size = mr(dev, MMIO_QUEUE_NUM_MAX);
        if (size > max_size)
            size = max_size;
    }
    if (size == 0 || (size & (size - 1)))
        PANIC("virtio: queue %u has unusable size %u", index, size);

    /* Legacy split-ring layout; also valid for modern (addresses given separately). */
    size_t desc_sz = 16u * size;
    size_t avail_sz = 6u + 2u * size;
    size_t used_off = align_up(desc_sz + avail_sz, LEGACY_ALIGN);
    size_t used_sz = 6u + 8u * size;
    size_t total = used_off + align_up(used_sz, LEGACY_ALIGN);
    uint8_t *mem = platform_arena_alloc(total, LEGACY_ALIGN);
    /* Arena memory is fresh (zeroed) RAM: rings start empty. The device reads it by
     * its physical address, which only memory mapped alike on every core has. */
    ASSERT(platform_is_shared(mem, total));

    q->dev = dev;
    q->index = index;
    q->size = (uint16_t)size;
    q->desc = (volatile struct virtq_desc *)mem;
    q->avail = (volatile struct virtq_avail *)(mem + desc_sz);
    q->used = (volatile struct virtq_used *)(mem + used_off);
    q->avail_idx = 0;
    q->last_used = 0;
    q->unkicked = 0;

    uintptr_t pa = (uintptr_t)mem; /* identity mapped */
    switch (dev->transport) {
    case VIRTIO_PCI_LEGACY:
        outl((uint16_t)(dev->base + PCI_QUEUE_PFN), (uint32_t)(pa / LEGACY_ALIGN));
        break;
    case VIRTIO_MMIO_LEGACY:
        mw(dev, MMIO_QUEUE_NUM, size);
        mw(dev, MMIO_GUEST_PAGE, LEGACY_ALIGN);
        mw(dev, MMIO_QUEUE_ALIGN, LEGACY_ALIGN);
        mw(dev, MMIO_QUEUE_PFN, (uint32_t)(pa / LEGACY_ALIGN));
        break;
    case VIRTIO_MMIO_MODERN:
        mw(dev, MMIO_QUEUE_NUM, size);
        mw(dev, MMIO_QUEUE_DESC_LO, (uint32_t)pa);
        mw(dev, MMIO_QUEUE_DESC_HI, (uint32_t)((uint64_t)pa >> 32));
        mw(dev, MMIO_QUEUE_AVAIL_LO, (uint32_t)(pa + desc_sz));
        mw(dev, MMIO_QUEUE_AVAIL_HI, 0);
        mw(dev, MMIO_QUEUE_USED_LO, (uint32_t)(pa + used_off));
        mw(dev, MMIO_QUEUE_USED_HI, 0);
        mw(dev, MMIO_QUEUE_READY, 1);
        break;
    }
}

void virtio_queue_push(struct virtq *q, uint16_t id)
{
    q->avail->ring[q->avail_idx & (q->size - 1)] = id;
    compiler_barrier(); /* x86: stores are not reordered with other stores */
    q->avail_idx++;
    q->avail->idx = q->avail_idx;
    q->unkicked++;
}

void virtio_queue_kick(struct virtq *q)
{
    if (!q->unkicked)
        return;
    q->unkicked = 0;
    memory_barrier(); /* publish avail->idx before reading used->flags */
    if (q->used->flags & VIRTQ_USED_F_NO_NOTIFY)
        return;
    if (q->dev->transport == VIRTIO_PCI_LEGACY)
        outw((uint16_t)(q->dev->base + PCI_QUEUE_NOTIFY), q->index);
    else
        mw(q->dev, MMIO_QUEUE_NOTIFY, q->index);
}

int virtio_queue_peek(const struct virtq *q, uint32_t *id, uint32_t *len)
{
    if (q->last_used == q->used->idx)
        return 0;
    compiler_barrier(); /* read idx before the element (x86 loads are ordered) */
    volatile struct virtq_used_elem *e = &q->used->ring[q->last_used & (q->size - 1)];
    *id = e->id;
    *len = e->len;
    return 1;
}

int virtio_queue_pop(struct virtq *q, uint32_t *id, uint32_t *len)
{
    if (!virtio_queue_peek(q, id, len))
        return 0;
    q->last_used++;
    return 1;
}

void virtio_queue_interrupts(struct virtq *q, int on)
{
    q->avail->flags = on ? 0 : VIRTQ_AVAIL_F_NO_INTERRUPT;
    memory_barrier(); /* the flag before whatever the caller reads next (the used ring) */
}

uint32_t virtio_irq_ack(struct virtio_dev *dev)
{
    if (dev->transport == VIRTIO_PCI_LEGACY)
        return inb((uint16_t)(dev->base + PCI_ISR));
    uint32_t status = mr(dev, MMIO_INT_STATUS);
    if (status)
        mw(dev, MMIO_INT_ACK, status);
    return status;
}
