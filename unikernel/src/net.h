/* lwIP glue: netif over virtio-net, DHCP, the polling main loop. */
#ifndef ORISHA_NET_H
#define ORISHA_NET_H
void net_init(void);
/* Run the loop until DHCP has supplied an address; logs it. */
void net_wait_for_address(void);
void net_run(void) __attribute__((noreturn));
#endif
