/*
 * virtio-rng (the virtio entropy device, type 4): the host's random bytes
 * (QEMU: -device virtio-rng-*,rng=… over rng-random on /dev/urandom), one
 * request at a time, polled. An entropy source beside the CPU's RDSEED/RDRAND
 * (platform_entropy): the TLS entropy pool and the TCP ISN key use both.
 */
#ifndef ORISHA_VIRTIO_RNG_H
#define ORISHA_VIRTIO_RNG_H
#include <stddef.h>

/* Find and start the device (virtio-mmio, else a transitional PCI function).
 * Returns 1 if there is one to read from. */
int virtio_rng_init(void);
/* Where it was found ("virtio-mmio (cmdline) @0x…"), for the boot log. */
const char *virtio_rng_describe(void);
/* Fill buf with the device's bytes: 0, or -1 with no device or when it stays
 * silent for a second (then it is not asked again). */
int virtio_rng_read(void *buf, size_t len);

#endif
