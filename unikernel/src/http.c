#include <string.h>
#include "lwip/tcp.h"
#include "http.h"
#include "platform.h"

#define HTTP_PORT 80
#define MAX_CONNS MEMP_NUM_TCP_PCB
#define MAX_PENDING 256          /* queued request heads before we stop reading */
#define POLL_INTERVAL 2          /* x 500 ms: retry after ERR_MEM */
#define MAX_WRITE 0xf000u        /* tcp_write takes a u16 length */

struct conn {
    struct tcp_pcb *pcb;
    uint32_t pending;            /* complete request heads not yet fully queued */
    size_t body_off;             /* body bytes queued for the current response */
    uint8_t head_sent;           /* header of the current response queued */
    uint8_t match;               /* progress through "\r\n\r\n" */
    uint8_t peer_closed;
    uint8_t used;
    /* Minimal header scan, only to honour "Connection: close" / HTTP/1.0. */
    uint8_t closing;             /* last pending response closes the connection */
    uint8_t line_no;             /* line index within the current head (saturating) */
    uint8_t line_len;            /* bytes seen on the current line (saturating) */
    uint8_t http10;              /* request line ends in HTTP/1.0 */
    int8_t conn_hdr;             /* Connection header: 1 keep-alive, -1 close, 0 none */
    char line[24];               /* first bytes of the current line, lower-cased */
    char tail[8];                /* last 8 bytes of the current line */
};

static struct conn conns[MAX_CONNS];
static const uint8_t *site_body;
static size_t site_len;
static uint64_t responses;

static char date_buf[40];
static uint64_t date_sec = ~0ull;

static const char *http_date(void)
{
    static const char *wd[] = { "Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed" };
    static const char *mo[] = { "Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                "Jul", "Aug", "Sep", "Oct", "Nov", "Dec" };
    uint64_t t = platform_unix_time();
    if (t == date_sec)
        return date_buf;
    date_sec = t;
    uint64_t days = t / 86400, rem = t % 86400;
    /* civil_from_days */
    int64_t z = (int64_t)days + 719468;
    int64_t era = z / 146097;
    unsigned doe = (unsigned)(z - era * 146097);
    unsigned yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    int64_t y = (int64_t)yoe + era * 400;
    unsigned doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    unsigned mp = (5 * doy + 2) / 153;
    unsigned d = doy - (153 * mp + 2) / 5 + 1;
    unsigned m = mp < 10 ? mp + 3 : mp - 9;
    y += m <= 2;
    platform_snprintf(date_buf, sizeof date_buf, "%s, %02u %s %04d %02u:%02u:%02u GMT",
                      wd[days % 7], d, mo[m - 1], (int)y, (unsigned)(rem / 3600),
                      (unsigned)(rem / 60 % 60), (unsigned)(rem % 60));
    return date_buf;
}

static void conn_free(struct conn *c)
{
    memset(c, 0, sizeof *c);
}

/* Returns ERR_ABRT if the pcb had to be aborted (callers must pass it on). */
static err_t conn_close(struct conn *c)
{
    struct tcp_pcb *pcb = c->pcb;
    tcp_arg(pcb, NULL);
    tcp_recv(pcb, NULL);
    tcp_sent(pcb, NULL);
    tcp_err(pcb, NULL);
    tcp_poll(pcb, NULL, 0);
    conn_free(c);
    if (tcp_close(pcb) != ERR_OK) {
        tcp_abort(pcb); /* out of memory for the FIN: reset instead */
        return ERR_ABRT;
    }
    return ERR_OK;
}

/* Queue as much of the pending responses as lwIP will take right now.
 * Returns ERR_ABRT if the connection was aborted. */
static err_t send_pending(struct conn *c)
{
    struct tcp_pcb *pcb = c->pcb;
    while (c->pending) {
        if (!c->head_sent) {
            char head[256];
            int n = platform_snprintf(head, sizeof head,
                                      "HTTP/1.1 200 OK\r\n"
                                      "Server: orisha\r\n"
                                      "Date: %s\r\n"
                                      "Content-Type: application/octet-stream\r\n"
                                      "Content-Length: %zu\r\n"
                                      "Connection: %s\r\n"
                                      "\r\n",
                                      http_date(), site_len,
                                      c->closing && c->pending == 1 ? "close" : "keep-alive");
            ASSERT(n > 0 && n < (int)sizeof head);
            if (tcp_sndbuf(pcb) < (unsigned)n)
                goto out;
            err_t e = tcp_write(pcb, head, (u16_t)n,
                                TCP_WRITE_FLAG_COPY | (site_len ? TCP_WRITE_FLAG_MORE : 0));
            if (e == ERR_MEM)
                goto out;
            if (e != ERR_OK) {
                conn_free(c);
                tcp_abort(pcb);
                return ERR_ABRT;
            }
            c->head_sent = 1;
            c->body_off = 0;
        }
        while (c->body_off < site_len) {
            size_t n = site_len - c->body_off;
            size_t room = tcp_sndbuf(pcb);
            if (n > room)
                n = room;
            if (n > MAX_WRITE)
                n = MAX_WRITE;
            if (n == 0)
                goto out;
            int more = c->body_off + n < site_len || c->pending > 1;
            err_t e;
            /* Body bytes are static (in the image): reference, don't copy. */
            while ((e = tcp_write(pcb, site_body + c->body_off, (u16_t)n,
                                  more ? TCP_WRITE_FLAG_MORE : 0)) == ERR_MEM &&
                   n > TCP_MSS)
                n /= 2;
            if (e == ERR_MEM)
                goto out; /* out of pbufs/segments: resume from sent/poll */
            if (e != ERR_OK) {
                conn_free(c);
                tcp_abort(pcb);
                return ERR_ABRT;
            }
            c->body_off += n;
        }
        c->head_sent = 0;
        c->body_off = 0;
        c->pending--;
        responses++;
    }
out:
    tcp_output(pcb);
    if ((c->peer_closed || c->closing) && !c->pending)
        return conn_close(c);
    return ERR_OK;
}

static err_t on_sent(void *arg, struct tcp_pcb *pcb, u16_t len)
{
    (void)pcb;
    (void)len;
    struct conn *c = arg;
    return c ? send_pending(c) : ERR_OK;
}

static err_t on_poll(void *arg, struct tcp_pcb *pcb)
{
    (void)pcb;
    struct conn *c = arg;
    return c ? send_pending(c) : ERR_OK;
}

static void on_err(void *arg, err_t err)
{
    (void)err;
    struct conn *c = arg;
    if (c)
        conn_free(c); /* pcb already freed by lwIP */
}

static int lower(int ch)
{
    return ch >= 'A' && ch <= 'Z' ? ch + 32 : ch;
}

static void end_of_line(struct conn *c)
{
    size_t n = c->line_len < sizeof c->line ? c->line_len : sizeof c->line;
    if (c->line_no == 0) {
        c->http10 = c->line_len >= 8 && memcmp(c->tail, "http/1.0", 8) == 0;
    } else if (n >= 11 && memcmp(c->line, "connection:", 11) == 0) {
        for (size_t i = 11; i + 5 <= n; i++) {
            if (memcmp(c->line + i, "close", 5) == 0)
                c->conn_hdr = -1;
            else if (i + 10 <= n && memcmp(c->line + i, "keep-alive", 10) == 0)
                c->conn_hdr = 1;
        }
    }
    if (c->line_no < 255)
        c->line_no++;
    c->line_len = 0;
}

/* Feed one request byte; counts complete heads (terminated by CRLFCRLF). */
static void scan_byte(struct conn *c, uint8_t ch)
{
    if (ch == '\r') {
        c->match = c->match == 2 ? 3 : 1;
        return;
    }
    if (ch == '\n' && (c->match == 1 || c->match == 3)) {
        if (c->match == 1) {
            c->match = 2;
            end_of_line(c);
            return;
        }
        /* end of head */
        c->match = 0;
        c->pending++;
        if (c->conn_hdr < 0 || (c->http10 && c->conn_hdr <= 0))
            c->closing = 1; /* answer this one, then close; ignore the rest */
        c->line_no = 0;
        c->line_len = 0;
        c->http10 = 0;
        c->conn_hdr = 0;
        return;
    }
    c->match = 0;
    if (c->line_len < sizeof c->line)
        c->line[c->line_len] = (char)lower(ch);
    memmove(c->tail, c->tail + 1, sizeof c->tail - 1);
    c->tail[sizeof c->tail - 1] = (char)lower(ch);
    if (c->line_len < 255)
        c->line_len++;
}

static err_t on_recv(void *arg, struct tcp_pcb *pcb, struct pbuf *p, err_t err)
{
    struct conn *c = arg;
    if (!c) {
        if (p)
            pbuf_free(p);
        tcp_abort(pcb);
        return ERR_ABRT;
    }
    if (!p) {
        c->peer_closed = 1;
        return send_pending(c);
    }
    if (err != ERR_OK) {
        pbuf_free(p);
        return err;
    }
    if (c->pending >= MAX_PENDING)
        return ERR_MEM; /* lwIP keeps the data and re-delivers it later */
    for (struct pbuf *q = p; q && !c->closing; q = q->next) {
        const uint8_t *s = q->payload;
        for (u16_t i = 0; i < q->len && !c->closing; i++)
            scan_byte(c, s[i]);
    }
    tcp_recved(pcb, p->tot_len);
    pbuf_free(p);
    return send_pending(c);
}

static err_t on_accept(void *arg, struct tcp_pcb *pcb, err_t err)
{
    (void)arg;
    if (err != ERR_OK || !pcb)
        return ERR_VAL;
    struct conn *c = NULL;
    for (int i = 0; i < MAX_CONNS; i++) {
        if (!conns[i].used) {
            c = &conns[i];
            break;
        }
    }
    if (!c) {
        tcp_abort(pcb);
        return ERR_ABRT;
    }
    c->used = 1;
    c->pcb = pcb;
    tcp_arg(pcb, c);
    tcp_recv(pcb, on_recv);
    tcp_sent(pcb, on_sent);
    tcp_err(pcb, on_err);
    tcp_poll(pcb, on_poll, POLL_INTERVAL);
    tcp_nagle_disable(pcb);
    return ERR_OK;
}

void http_init(const uint8_t *body, size_t len)
{
    site_body = body;
    site_len = len;
    struct tcp_pcb *pcb = tcp_new();
    ASSERT(pcb);
    err_t e = tcp_bind(pcb, IP_ANY_TYPE, HTTP_PORT);
    if (e != ERR_OK)
        PANIC("http: bind port %d failed (%d)", HTTP_PORT, e);
    pcb = tcp_listen(pcb);
    ASSERT(pcb);
    tcp_accept(pcb, on_accept);
    if (platform_verbose())
        platform_printf("orisha: http listening on port %d\n", HTTP_PORT);
}
