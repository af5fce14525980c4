/* lwIP glue: netif over virtio-net, DHCP, one pass of the polling loop. */
#ifndef ORISHA_NET_H
#define ORISHA_NET_H
/* Finds the NIC (PANICs without one), starts lwIP and DHCP. */
void net_init(void);
/* One pass: received frames into lwIP, lwIP's timers, queued frames out.
 * Returns the number of frames received (0: the caller may pause). */
int net_poll(void);
/* After a poll that found nothing for this core: when every frame received for it
 * had reached it (ns), which is now unless core 0 feeds it from one queue pair and has
 * a backlog not yet handed on (http.c: a client is silent only past that). */
uint64_t net_caught_up_ns(void);
/* This core's time out of HLT since its network came up (polling included: what the
 * host gives the vCPU), for the stats line's guest cycles per request. */
uint64_t net_busy_ns(void);
/* DHCP has supplied an address (status_changed has logged it). */
int net_has_address(void);
/* One log line of frame and drop counts (this core's). */
void net_log_stats(void);

/* More cores (see net.c). Core 0: rings for cores 1..cpus-1 (before they start);
 * once it has an address, hand it to them and, when all of them are up (net_up)
 * within wait_ms, spread received segments over the cpus cores (0: some did not
 * come up in time). Cores 1..: lwIP on that address (waits for
 * it), net_up once listening; net_wait: sleep up to `us` (less when an lwIP timer
 * is due) unless a frame arrives. */
void net_share(unsigned cpus);
/* The guest RAM net_share(cpus) will take (http.c keeps it out of the TLS heap). */
size_t net_share_bytes(unsigned cpus);
int net_spread(unsigned cpus, uint32_t wait_ms);
void net_init_secondary(void);
void net_up(void);
void net_wait(uint32_t us);
#endif
