/*
 * virtio-net driver: a queue pair (RX, TX) per core when the device has them
 * (VIRTIO_NET_F_MQ), else one; fixed 2 KiB buffers in memory mapped alike on every
 * core, polled. Knows nothing about lwIP (see net.c).
 */
#ifndef ORISHA_VIRTIO_NET_H
#define ORISHA_VIRTIO_NET_H
#include <stddef.h>
#include <stdint.h>

#define VIRTIO_NET_MAX_FRAME 1514

/* Find and initialise the NIC (virtio-mmio, else PCI). Returns 1 on success. */
int virtio_net_init(void);
const uint8_t *virtio_net_mac(void);
const char *virtio_net_describe(void);
/* Queue pairs in use: platform_cpus_asked() (core i polls and sends on pair i), or 1
 * (core 0 receives everything; every core sends on the one TX queue). */
unsigned virtio_net_pairs(void);

/* 0: the frame was taken; else it stays in the queue, first, for the next poll. */
typedef int (*virtio_net_rx_fn)(const uint8_t *frame, size_t len, void *arg);
/* Deliver up to 'budget' received frames of this core's pair, stopping at one fn keeps;
 * returns how many were taken. Core 0 alone with one pair. */
int virtio_net_rx_poll(virtio_net_rx_fn fn, void *arg, int budget);
/* Core 0 with one queue pair, before a nap: 1 when the device's interrupt will end it
 * (notifications on, the line lowered, nothing received meanwhile); 0 when a frame is
 * already there (poll instead); -1 when the device has no interrupt here (microvm's
 * GSI unknown, PCI, a pair per core): nothing but a poll notices a frame. After the
 * nap, virtio_net_rx_disarm turns notifications off again. */
int virtio_net_rx_arm(void);
void virtio_net_rx_disarm(void);

/* Get a TX frame buffer (VIRTIO_NET_MAX_FRAME bytes), NULL if the ring stays full;
 * any core, holding the TX queue until virtio_net_tx_commit. */
uint8_t *virtio_net_tx_begin(void);
void virtio_net_tx_commit(size_t len);
/* Notify the device of queued TX frames / re-posted RX buffers. */
void virtio_net_flush(void);

struct virtio_net_stats {
    uint64_t rx_frames, tx_frames, tx_full;
    uint64_t tso_frames, tso_segments; /* gathered TCP frames (TSO) and the segments in them */
};
/* This core's pair's counters. */
const struct virtio_net_stats *virtio_net_stats(void);

#endif
