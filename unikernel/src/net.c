/*
 * lwIP glue: a netif over virtio-net, DHCP, and one pass of the polling loop
 * (frames in, lwIP's timers, frames out). The loop itself is the
 * application's (main.c); HTTP is http.c.
 */
#include <string.h>
#include "lwip/init.h"
#include "lwip/netif.h"
#include "lwip/dhcp.h"
#include "lwip/etharp.h"
#include "lwip/pbuf.h"
#include "lwip/timeouts.h"
#include "lwip/ip4_addr.h"
#include "netif/ethernet.h"
#include "net.h"
#include "virtio_net.h"
#include "platform.h"

static struct netif nif;
static uint64_t rx_dropped, tx_dropped;

/* lwIP NO_SYS time base. */
u32_t sys_now(void)
{
    return platform_now_ms();
}

static void rx_frame(const uint8_t *frame, size_t len, void *arg)
{
    (void)arg;
    /* Heap-backed (PBUF_RAM): pages are only touched once traffic needs them. */
    struct pbuf *p = pbuf_alloc(PBUF_RAW, (u16_t)len, PBUF_RAM);
    if (!p) {
        rx_dropped++; /* out of memory: drop, TCP will retransmit */
        return;
    }
    pbuf_take(p, frame, (u16_t)len);
    if (nif.input(p, &nif) != ERR_OK)
        pbuf_free(p);
}

static err_t linkoutput(struct netif *n, struct pbuf *p)
{
    (void)n;
    if (p->tot_len > VIRTIO_NET_MAX_FRAME) {
        tx_dropped++;
        return ERR_BUF;
    }
    uint8_t *buf = virtio_net_tx_begin();
    if (!buf) {
        tx_dropped++;
        return ERR_MEM;
    }
    pbuf_copy_partial(p, buf, p->tot_len, 0);
    virtio_net_tx_commit(p->tot_len);
    return ERR_OK;
}

static err_t netif_setup(struct netif *n)
{
    n->name[0] = 'v';
    n->name[1] = 'n';
    n->hwaddr_len = 6;
    memcpy(n->hwaddr, virtio_net_mac(), 6);
    n->mtu = 1500;
    n->flags = NETIF_FLAG_BROADCAST | NETIF_FLAG_ETHARP | NETIF_FLAG_ETHERNET;
    n->output = etharp_output;
    n->linkoutput = linkoutput;
    return ERR_OK;
}

static void status_changed(struct netif *n)
{
    if (!ip4_addr_isany_val(*netif_ip4_addr(n))) {
        char ip[16], mask[16], gw[16];
        const uint8_t *m = n->hwaddr;
        ip4addr_ntoa_r(netif_ip4_addr(n), ip, sizeof ip);
        ip4addr_ntoa_r(netif_ip4_netmask(n), mask, sizeof mask);
        ip4addr_ntoa_r(netif_ip4_gw(n), gw, sizeof gw);
        platform_printf("orisha: dhcp address %s netmask %s gateway %s "
                        "mac %02x:%02x:%02x:%02x:%02x:%02x\n",
                        ip, mask, gw, m[0], m[1], m[2], m[3], m[4], m[5]);
    }
}

void net_init(void)
{
    if (!virtio_net_init())
        PANIC("no virtio-net device found");
    if (platform_verbose())
        platform_printf("orisha: nic %s\n", virtio_net_describe());
    lwip_init();
    if (!netif_add(&nif, NULL, NULL, NULL, NULL, netif_setup, ethernet_input))
        PANIC("netif_add failed");
    netif_set_default(&nif);
    netif_set_status_callback(&nif, status_changed);
    netif_set_up(&nif);
    netif_set_link_up(&nif);
    if (dhcp_start(&nif) != ERR_OK)
        PANIC("dhcp_start failed");
}

int net_poll(void)
{
    int n = virtio_net_rx_poll(rx_frame, NULL, 64);
    sys_check_timeouts();
    virtio_net_flush();
    return n;
}

int net_has_address(void)
{
    return dhcp_supplied_address(&nif);
}

void net_log_stats(void)
{
    const struct virtio_net_stats *st = virtio_net_stats();
    platform_printf("orisha: net rx %lu tx %lu tx_ring_full %lu rx_dropped %lu tx_dropped %lu\n",
                    (unsigned long)st->rx_frames, (unsigned long)st->tx_frames,
                    (unsigned long)st->tx_full, (unsigned long)rx_dropped,
                    (unsigned long)tx_dropped);
}
