/* lwIP glue: netif over virtio-net, DHCP, one pass of the polling loop. */
#ifndef ORISHA_NET_H
#define ORISHA_NET_H
/* Finds the NIC (PANICs without one), starts lwIP and DHCP. */
void net_init(void);
/* One pass: received frames into lwIP, lwIP's timers, queued frames out.
 * Returns the number of frames received (0: the caller may pause). */
int net_poll(void);
/* DHCP has supplied an address (status_changed has logged it). */
int net_has_address(void);
/* One log line of frame and drop counts. */
void net_log_stats(void);
#endif
