/* lwIP hooks (LWIP_HOOK_FILENAME in lwipopts.h): the functions lwIP calls
 * back into the kernel, each defined in the subsystem named by its prefix. */
#ifndef ORISHA_LWIPHOOKS_H
#define ORISHA_LWIPHOOKS_H
#include "lwip/ip_addr.h"

/* RFC 6528 initial sequence numbers (net.c). */
u32_t net_tcp_isn(const ip_addr_t *local_ip, u16_t local_port,
                  const ip_addr_t *remote_ip, u16_t remote_port);

/* A SYN that starts a new connection over a TIME_WAIT one (net.c). */
struct pbuf;
struct netif;
int net_ip4_input(struct pbuf *p, struct netif *inp);
/* A SYN while every connection slot is taken: dropped (http.c; the peer retries). */
int http_ip4_input(struct pbuf *p, struct netif *inp);

#endif
