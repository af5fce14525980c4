/*
 * Virtio transports (virtio-mmio v1 "legacy" and v2 "modern", virtio-pci
 * legacy I/O BAR) and split virtqueues. Polled; a device whose interrupt line is
 * known (dev->irq) can also wake a waiting core (virtio_irq_ack, virtio_queue_interrupts).
 */
#ifndef ORISHA_VIRTIO_H
#define ORISHA_VIRTIO_H
#include <stdint.h>
#include <stddef.h>

#define VIRTIO_STATUS_ACK         1
#define VIRTIO_STATUS_DRIVER      2
#define VIRTIO_STATUS_DRIVER_OK   4
#define VIRTIO_STATUS_FEATURES_OK 8
#define VIRTIO_STATUS_FAILED      128

#define VIRTIO_F_VERSION_1        32

#define VIRTQ_DESC_F_NEXT  1
#define VIRTQ_DESC_F_WRITE 2
#define VIRTQ_USED_F_NO_NOTIFY 1
#define VIRTQ_AVAIL_F_NO_INTERRUPT 1

enum virtio_transport {
    VIRTIO_MMIO_LEGACY,   /* mmio Version 1 */
    VIRTIO_MMIO_MODERN,   /* mmio Version 2 */
    VIRTIO_PCI_LEGACY,    /* transitional PCI device, I/O BAR0 */
};

struct virtio_dev {
    enum virtio_transport transport;
    uintptr_t base;       /* MMIO address or I/O port base */
    uint32_t device_id;
    int modern;           /* VIRTIO_F_VERSION_1 negotiated */
    const char *how;      /* how virtio_find found it, for the boot log */
    uint32_t irq;         /* its interrupt's GSI (microvm's command line), 0 if unknown */
};

struct virtq_desc {
    uint64_t addr;
    uint32_t len;
    uint16_t flags;
    uint16_t next;
};

struct virtq_avail {
    uint16_t flags;
    uint16_t idx;
    uint16_t ring[];
};

struct virtq_used_elem {
    uint32_t id;
    uint32_t len;
};

struct virtq_used {
    uint16_t flags;
    uint16_t idx;
    struct virtq_used_elem ring[];
};

struct virtq {
    struct virtio_dev *dev;
    uint16_t index;
    uint16_t size;
    volatile struct virtq_desc *desc;
    volatile struct virtq_avail *avail;
    volatile struct virtq_used *used;
    uint16_t avail_idx;   /* our shadow of avail->idx */
    uint16_t last_used;   /* next used entry to consume */
    uint16_t unkicked;    /* buffers made available since last notify */
};

/*
 * Find the first device of virtio type 'id' (1 net, 4 entropy): the
 * virtio_mmio.device= entries microvm appends to the command line, else a
 * transitional PCI function 0x1af4:'pci_id' (its legacy I/O BAR0), else a scan
 * of microvm's mmio slots. Returns 1 and fills dev; 0 if there is none; -1 if
 * there is only a PCI function without the legacy interface (modern-only,
 * 0x1040 + id, or BAR0 not I/O), which this driver cannot drive.
 */
int virtio_find(uint32_t id, uint16_t pci_id, struct virtio_dev *dev);

uint8_t virtio_get_status(struct virtio_dev *dev);
void virtio_set_status(struct virtio_dev *dev, uint8_t status);
uint64_t virtio_get_features(struct virtio_dev *dev);
void virtio_set_features(struct virtio_dev *dev, uint64_t features);
uint8_t virtio_config_read8(struct virtio_dev *dev, unsigned off);
/* A little-endian 16-bit config field (two byte reads: legacy config is not aligned). */
uint16_t virtio_config_read16(struct virtio_dev *dev, unsigned off);

/* Allocate (from the platform arena) and register queue 'index'. */
void virtio_queue_setup(struct virtio_dev *dev, struct virtq *q, uint16_t index, uint16_t max_size);
/* Publish descriptor head 'id' to the device (no notification). */
void virtio_queue_push(struct virtq *q, uint16_t id);
/* Notify the device if buffers are pending and it wants notifications. */
void virtio_queue_kick(struct virtq *q);
/* Pop one used element; returns 1 if one was available. */
int virtio_queue_pop(struct virtq *q, uint32_t *id, uint32_t *len);
/* The same without taking it: the next pop returns it again. */
int virtio_queue_peek(const struct virtq *q, uint32_t *id, uint32_t *len);

/* Used-buffer notifications of queue q on or off (VIRTQ_AVAIL_F_NO_INTERRUPT: a
 * polling driver turns them off, so that the device neither raises its line nor the
 * host works to raise it). */
void virtio_queue_interrupts(struct virtq *q, int on);
/* Read and acknowledge the device's interrupt status, which lowers its line. */
uint32_t virtio_irq_ack(struct virtio_dev *dev);

#endif
