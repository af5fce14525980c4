/*
 * HTTP on lwIP's raw TCP API: the glue between lwIP and the request core
 * (core.c). It moves bytes and time, nothing else: what to answer, when a
 * connection ends and when it times out are the core's decisions.
 *
 * - Input is held as lwIP delivered it (a pbuf chain per connection) and fed
 *   to the core only while the core wants it. Bytes count as received
 *   (tcp_recved) only once the core took them, so a client that pipelines
 *   faster than we answer fills its TCP window and waits: backpressure
 *   instead of buffering.
 * - One response at a time is queued with tcp_write: constant bytes (heads,
 *   bodies) point into the image (no copy for bodies; small heads are copied
 *   into the segment, which costs less than an extra pbuf), per-connection
 *   bytes (Date tail, 206 status, redirect query) are copied. Whatever does
 *   not fit in the send buffer or the pbuf/segment pools continues from
 *   tcp_sent, or from the poll timer after ERR_MEM: exhaustion slows a
 *   connection down, it never fails it.
 * - The poll timer (500 ms) drives the core's timeouts.
 * - TLS (a kernel built with a certificate, tls.h) listens on 443 beside the
 *   plain port: ciphertext waits in the same pbuf queue, plaintext goes to the
 *   same core, and responses are encrypted as lwIP takes them (small segments
 *   gathered so a small response is one record). A handshake must finish
 *   within the head timeout, as in the Python TLS layer; the last response is
 *   followed by a close_notify, then the linger below. A plain HTTP request
 *   there (its first byte) gets the Python layer's plain 400 (sniff). When ALPN chose h2,
 *   h2.c stands between the plaintext and the core (pump_h2 moves its frames
 *   out and plaintext in); it decides when the connection ends.
 * - After the last response the connection lingers, as the Python core's
 *   (connection.py _finish): our side is shut (a FIN after the queued bytes)
 *   and input is read and dropped until the peer's FIN, at most
 *   POLICY_LINGER_MS. tcp_close at once would answer input that is still on
 *   its way with a RST, and a RST destroys the response the client has not
 *   read yet (a Connection: close download with pipelined requests behind
 *   it, a fatal 400 queued behind a download).
 */
#include <string.h>
#include "lwip/tcp.h"
#include "lwip/priv/tcp_priv.h" /* tcp_active_pcbs: queued and unacknowledged segments */
#include "lwip/stats.h"
#include "lwip/timeouts.h"
#include "core.h"
#include "http.h"
#include "net.h"
#include "platform.h"
#include "tls.h"
#include "h2.h"

#define HTTP_PORT 80
/*
 * The table, sized at boot from the guest's RAM (http_init: the RAM above the
 * image, `orisha boot --memory`): `nslots` connection slots (at most
 * ORISHA_CONN_SLOTS, lwipopts.h) of which at most `table` are admitted (served,
 * each with its TLS session). A connection beyond the table waits in its slot,
 * unread (the accept backlog), until one leaves or gives way; a SYN beyond the
 * slots is dropped, and the peer's retransmission comes back later.
 */
#define SLOT_SHARE 2             /* of the RAM: at most half for slots, the rest the TLS heap */
#define TLS_BASE (256u * 1024)   /* the TLS heap beyond its sessions: the chain, the key, PSA */
#define RAM_KEEP (512u * 1024)   /* RAM left for later users of platform_ram_alloc */
/* A connection gives way to a waiting one only once nothing has come from its
 * client (and nothing of ours has been acknowledged) for this long: a client
 * in its handshake, or between two requests, is never cut off. */
#define STALE_MS 2000
/* For a waiting client that has asked (its whole head or ClientHello in hand),
 * a connection that stopped half way through its head or ClientHello gives way
 * after this much of its client's silence: one that can be answered now goes
 * before it (TCP retransmits a lost segment well within it after the first
 * round trip). One whose client has not begun a message (connected, handshake
 * done, between requests) keeps STALE_MS: a client starved of CPU in a burst of
 * its own handshakes is silent that long (h2load's 1,000 TLS connections on a
 * loaded host: 23 reset at 500 ms). */
#define STALE_ASKED_MS 500
/* Input the waiting connections may hold in lwIP's heap, all together (see
 * MEM_SIZE in lwipopts.h): 1,024 ClientHellos of 1.5 KB. Each may hold a receive
 * window (16 KiB), and 1,024 of them would hold twice the heap; past this the
 * one that has waited longest without a whole head (or ClientHello) is reset. */
#define WAIT_INPUT_ALL (1536u * 1024)
#define STATS_MS 1000            /* the stats line: at most this often, when something changed */
#define POLL_INTERVAL 1          /* x 500 ms (lwIP's slow timer) */
#define MAX_WRITE 0xf000u        /* tcp_write takes a u16 length */
#define COPY_BELOW 512           /* heads up to this size are copied into the segment */
/* The most pbufs one tcp_write adds: a segment per MSS, each a header and a data pbuf. */
#define WRITE_PBUFS (2 * (MAX_WRITE / TCP_MSS + 2))
/*
 * Send memory. A connection's queued response data holds pbufs and segments from
 * lwIP's pools (zero-copy body data: a segment header and a ROM pbuf per MSS)
 * and, for TLS, copies of its records in lwIP's heap. Each connection may
 * queue its floor; beyond it, it borrows from what the floors of a full table
 * leave, up to its cap. So a client that does not read holds at most its cap
 * until the send timeout ends it, and however many do, every other connection
 * still has its floor: a small response, or a slower download. (A share of
 * the pool by the number of connections open at the time of each write let
 * the first downloads keep what they took while few were open: twenty that did
 * not read starved every connection that came after them.)
 *
 * Pbufs for response data, all connections together: the segment pool less a
 * SYN-ACK or FIN, and a small response, for every slot (see queue_room), and
 * the most one write adds beyond its check.
 */
#define QUEUE_LIMIT (MEMP_NUM_TCP_SEG - 4 * ORISHA_CONN_SLOTS - WRITE_PBUFS)
#define QUEUE_FLOOR 12           /* pbufs: a small response, or 4 MSS of a body */
#define QUEUE_CAP 384            /* pbufs: about TCP_SND_BUF of zero-copy segments */
#define QUEUE_BORROW (QUEUE_LIMIT - ORISHA_CONN_TABLE * QUEUE_FLOOR)
/* The TLS records a connection keeps queued in lwIP's heap, in bytes: its floor,
 * its cap, and all of them together. 64 KiB each held one download to ~15 MB/s
 * behind QEMU's user networking, 192 to ~30. */
#define TLS_FLOOR (4 * 1024)
#define TLS_QUEUE (192 * 1024)
#define TLS_QUEUE_ALL (1536 * 1024)
#define TLS_BORROW (TLS_QUEUE_ALL - ORISHA_CONN_TABLE * TLS_FLOOR)
_Static_assert(QUEUE_BORROW >= 2 * QUEUE_CAP && TLS_BORROW >= 2 * TLS_QUEUE,
               "send memory: a full table's floors leave too little to borrow");
/* Input held for the core is coalesced when its pbufs (a frame each, with ~100
 * bytes of headers and bookkeeping) would cost more than the bytes they hold:
 * a client sending a byte per segment cannot make its window cost 100 times
 * its size. */
#define INPUT_PBUFS 16
/* Response bytes gathered into one TLS record when a segment is short (a head,
 * its Date tail, a small body; an HTTP/2 frame header and its payload): one
 * full record instead of several. */
#define TLS_GATHER 16384

struct hconn {
    struct tcp_pcb *pcb;
    struct pbuf *in;             /* received, not yet taken by the core */
    uint32_t seg_off;            /* progress in the current response segment */
    uint8_t seg;                 /* current segment of core.resp */
    uint8_t used;
    uint8_t peer_eof;            /* lwIP reported the peer's FIN */
    uint8_t closing;             /* tcp_close failed (no memory): retry from poll */
    uint8_t lingering;           /* our FIN is queued; input is dropped until the peer's */
    uint64_t linger_since;       /* ms: when lingering began */
    uint64_t accepted;           /* ms: admitted (the TLS handshake's timeout runs from here) */
    uint64_t arrived;            /* ms: accepted by lwIP (a waiting connection's place in line) */
    uint64_t active;             /* ms: the last input, or the last of ours acknowledged */
    uint8_t waiting;             /* beyond the table: held, unread, until admitted */
    uint8_t whole;               /* waiting: its input holds a whole head or ClientHello */
    void *h2_reserve;            /* TLS: an h2 connection's state, taken at admission */
    uint8_t on_tls;              /* accepted on the TLS port */
    struct tls *tls;             /* NULL: the plain port */
    struct h2 *h2;               /* ALPN chose h2 (from the TLS heap) */
    uint32_t open;               /* connections open when this one came (h2's 503s) */
    uint8_t started;             /* TLS: handshake done, protocol chosen */
    uint8_t sniffed;             /* TLS: the first byte was looked at (sniff) */
    uint8_t plain_eof;           /* h2: the peer's close_notify or EOF was passed on */
    uint8_t served;              /* a request head was completed (then idle = keep-alive) */
    uint8_t refused;             /* beyond the table: its 503, then the close */
    struct core_conn core;
};

/*
 * A full table: who waits, who gives way. The policy runs at accept and again
 * whenever a place may have come free (admit, admit_waiting): below `table`
 * admitted connections a newcomer is served at once. Beyond it, a connection
 * that has heard nothing from its client for STALE_MS while waiting on it (half
 * a head, half a ClientHello, an idle keep-alive) gives way (aborted: a RST, its
 * slot and TLS session freed), the longest waiting in the lowest class first;
 * for a newcomer that has asked (its whole head or ClientHello) STALE_ASKED_MS
 * of silence half way through a head or ClientHello is enough, so it is served
 * within a second however many stalled connections fill the table (it waited
 * 2.2 s behind 300 on one core). A TLS handshake we have answered never gives way. When every admitted connection has
 * been busy writing for STALE_MS (long downloads, or clients that stopped
 * reading), the newcomer is refused with the core's 503 (the bytes and Retry-After of --max-connections,
 * orisha/core/connection.py ERRORS), then lingers like any last response.
 * Otherwise it waits in its slot, unread, in the order it came (those whose
 * first message is whole go first: a client that has asked goes before a
 * stalled one), for at most the head timeout.
 *
 * lwIP needs a PCB at a SYN (tcp_listen_input -> tcp_alloc), long before the
 * accept callback, and when its pool is empty it frees TIME_WAIT, LAST_ACK and
 * CLOSING PCBs, then aborts the active PCB of the lowest priority below the
 * listener's, the longest inactive (tcp_kill_prio). http_ip4_input drops a SYN
 * beyond the slots before that, and each connection carries its class as its
 * lwIP priority (tcp_setprio, kept current by pump and the poll timer: prio),
 * so the fallback takes only what admit would: a stale head, a stale idle
 * one, a finished one; waiting, fresh and busy connections rank above the
 * listeners and are never candidates.
 */
enum {
    CLASS_HEAD = 1,              /* no complete request head yet (or a TLS handshake) */
    CLASS_IDLE = 2,              /* keep-alive, nothing asked */
    CLASS_DONE = 3,              /* last response queued, lingering, refused */
    CLASS_LISTEN = 4,            /* the listeners: new PCBs inherit it (tcp_alloc(prio)) */
    CLASS_KEEP = 5,              /* waiting for the table, or waited on its client briefly: kept */
    CLASS_BUSY = TCP_PRIO_MAX,   /* writing a response: never displaced */
};
static uint64_t queued, displaced, refused, killed, send_timeouts, syn_dropped, waited_max,
    overflowed, head_timeouts;

static struct hconn *conns;      /* nslots of them, from the guest's RAM */
static uint32_t nslots, table;
static uint32_t open_conns, waiting_conns;
static int retry_pending;        /* admit_waiting is scheduled */
static struct tcp_pcb *listener, *tls_listener;
static int tls_port;             /* the address of this marks tls_listener's accepts */
static int stopping;             /* http_stop(): each connection ends after its current response */
static uint64_t accepted_conns, requests; /* this core's (the stats line, with more cores) */

static uint64_t now_ms(void)
{
    return platform_now_ns() / 1000000u;
}

static void schedule_admissions(void);

static void release(struct hconn *h)
{
    if (h->h2) {
        h2_free(h->h2);
        tls_release(h->h2);
    }
    h->h2 = NULL;
    if (h->h2_reserve)
        tls_release(h->h2_reserve);
    h->h2_reserve = NULL;
    if (h->waiting)
        waiting_conns--;
    else
        schedule_admissions(); /* a place in the table, or TLS heap, came free */
    h->waiting = 0;
    if (h->tls)
        tls_free(h->tls);
    h->tls = NULL;
    open_conns--;
    h->used = 0;
    h->pcb = NULL;
}

static void detach(struct tcp_pcb *pcb)
{
    tcp_arg(pcb, NULL);
    tcp_recv(pcb, NULL); /* lwIP's tcp_recv_null then acknowledges and drops late data */
    tcp_sent(pcb, NULL);
    tcp_err(pcb, NULL);
    tcp_poll(pcb, NULL, 0);
}

static void drop_input(struct hconn *h)
{
    /* Everything received counts as read: lwIP answers a close with a RST
     * (losing queued responses) while unread data is outstanding. Counted pbuf
     * by pbuf: the chain's u16 tot_len wraps to 0 once a whole 64 KiB window
     * is held (a client pipelining while a large response is written). */
    for (const struct pbuf *q = h->in; q; q = q->next)
        tcp_recved(h->pcb, q->len);
    if (h->in) {
        pbuf_free(h->in);
        h->in = NULL;
    }
}

/*
 * Send our FIN. tcp_close() resets instead when the receive window is not
 * fully open, and while lwIP delivers data that arrived together with the
 * peer's FIN the window is still one short (it corrects that after our recv
 * callback returns): closing from there would turn a 400 into a RST. Once the
 * peer's FIN is in (CLOSE_WAIT) nothing more can arrive, so shutting down our
 * side is a complete close without that check.
 */
static err_t finish(struct tcp_pcb *pcb)
{
    return pcb->state == CLOSE_WAIT ? tcp_shutdown(pcb, 0, 1) : tcp_close(pcb);
}

static err_t close_conn(struct hconn *h)
{
    struct tcp_pcb *pcb = h->pcb;
    drop_input(h);
    if (finish(pcb) != ERR_OK) {
        h->closing = 1; /* no memory for the FIN yet: the poll timer retries */
        return ERR_OK;
    }
    detach(pcb);
    release(h);
    return ERR_OK;
}

/* Input after our last response: counted as read and dropped (pbuf by pbuf,
 * as drop_input, for the u16 tot_len). */
static void discard(struct tcp_pcb *pcb, struct pbuf *p)
{
    for (const struct pbuf *q = p; q; q = q->next)
        tcp_recved(pcb, q->len);
    pbuf_free(p);
}

/* The end of lingering (the peer's FIN, or time): tcp_close only marks the
 * receive side closed (our FIN is already queued), so it cannot fail; input
 * after this is answered with a RST, as a closed socket's on any host. */
static void end_linger(struct hconn *h)
{
    struct tcp_pcb *pcb = h->pcb;
    detach(pcb);
    release(h);
    if (tcp_close(pcb) != ERR_OK)
        PANIC("http: closing a lingering connection failed");
}

/*
 * The last response is queued: send our FIN and linger (see the top). When
 * the peer has finished too (its FIN is in: CLOSE_WAIT) nothing more can
 * arrive, so this is a plain close.
 */
static err_t linger(struct hconn *h)
{
    struct tcp_pcb *pcb = h->pcb;
    if (h->peer_eof || pcb->state != ESTABLISHED)
        return close_conn(h);
    drop_input(h);
    /* In ESTABLISHED tcp_shutdown sends the FIN, or (no memory for it) marks it
     * pending for lwIP's timer to retry (TF_CLOSEPEND): ERR_OK either way. */
    if (tcp_shutdown(pcb, 0, 1) != ERR_OK)
        PANIC("http: shutting down a connection's sending side failed");
    h->lingering = 1;
    h->linger_since = now_ms();
    schedule_admissions(); /* it left the table */
    return ERR_OK;
}

static err_t abort_conn(struct hconn *h)
{
    struct tcp_pcb *pcb = h->pcb;
    drop_input(h);
    detach(pcb);
    release(h);
    tcp_abort(pcb);
    return ERR_ABRT;
}

/*
 * Pbufs this connection may still add to its send queue (see QUEUE_FLOOR). The
 * pool it comes from also holds a SYN-ACK's (and a FIN's) segment, and lwIP
 * silently drops a SYN it cannot answer (the client then waits for its own
 * retransmission, six seconds under QEMU's user networking): QUEUE_LIMIT stops
 * short of that. snd_queuelen counts pbufs, at least one per segment: a bound
 * on both pools.
 */
static uint32_t queue_room(const struct tcp_pcb *pcb)
{
    uint32_t mine = pcb->snd_queuelen, borrowed = 0;
    if (mine >= QUEUE_CAP)
        return 0;
    for (const struct tcp_pcb *p = tcp_active_pcbs; p; p = p->next)
        if (p->snd_queuelen > QUEUE_FLOOR)
            borrowed += p->snd_queuelen - QUEUE_FLOOR;
    uint32_t room = (mine < QUEUE_FLOOR ? QUEUE_FLOOR - mine : 0) +
                    (borrowed < QUEUE_BORROW ? QUEUE_BORROW - borrowed : 0);
    return room < QUEUE_CAP - mine ? room : QUEUE_CAP - mine;
}

/* The most bytes one tcp_write may take with `room` pbufs (WRITE_PBUFS' count:
 * two per MSS and two more); 0 below one MSS. */
static size_t bytes_for(uint32_t room)
{
    return room >= 6 ? (size_t)(room / 2 - 2) * TCP_MSS : 0;
}

/* Bytes of TLS records this connection may still queue (see TLS_FLOOR). */
static size_t tls_room(const struct hconn *h)
{
    size_t mine = TCP_SND_BUF - h->pcb->snd_buf, borrowed = 0;
    if (mine >= TLS_QUEUE)
        return 0;
    for (uint32_t i = 0; i < nslots; i++) {
        const struct hconn *o = &conns[i];
        if (o->used && o->tls && o->pcb) {
            size_t q = TCP_SND_BUF - o->pcb->snd_buf;
            if (q > TLS_FLOOR)
                borrowed += q - TLS_FLOOR;
        }
    }
    size_t room = (mine < TLS_FLOOR ? TLS_FLOOR - mine : 0) +
                  (borrowed < TLS_BORROW ? TLS_BORROW - borrowed : 0);
    return room < TLS_QUEUE - mine ? room : TLS_QUEUE - mine;
}

/* Past n bytes of the response being written. */
static void advance(struct hconn *h, struct core_resp *r, size_t n)
{
    while (n) {
        size_t left = r->seg[h->seg].len - h->seg_off;
        size_t k = n < left ? n : left;
        h->seg_off += (uint32_t)k;
        n -= k;
        if (h->seg_off == r->seg[h->seg].len) {
            h->seg++;
            h->seg_off = 0;
        }
    }
    while (h->seg < r->n && r->seg[h->seg].len == 0)
        h->seg++;
}

/* The TLS twin of write_resp's loop: 1 done, 0 blocked, -1 closed. A short
 * segment is gathered with what follows into one record (copied into `gather`:
 * mbedTLS copies the plaintext into its record at once, so one buffer serves
 * every connection, and a retry after WANT_WRITE only flushes that record). */
static int write_tls(struct hconn *h, struct core_resp *r)
{
    static uint8_t gather[TLS_GATHER];
    struct tcp_pcb *pcb = h->pcb;
    while (h->seg < r->n) {
        const struct core_seg *s = &r->seg[h->seg];
        const uint8_t *p = s->p + h->seg_off;
        size_t n = s->len - h->seg_off;
        if (n < TLS_GATHER && h->seg + 1 < r->n) {
            size_t g = 0;
            uint32_t off = h->seg_off;
            for (uint8_t i = h->seg; i < r->n && g < TLS_GATHER; i++, off = 0) {
                size_t k = r->seg[i].len - off;
                if (k > TLS_GATHER - g)
                    k = TLS_GATHER - g;
                memcpy(gather + g, r->seg[i].p + off, k);
                g += k;
            }
            p = gather;
            n = g;
        }
        size_t room = tls_room(h), pbufs = bytes_for(queue_room(pcb)); /* copies: a pbuf per MSS */
        if (room > pbufs)
            room = pbufs;
        if (room > tcp_sndbuf(pcb)) /* tcp_sndbuf() caps at 64 KiB */
            room = tcp_sndbuf(pcb);
        long w = tls_write(h->tls, p, n, room);
        if (w < 0)
            return abort_conn(h), -1; /* a broken session */
        if (w == 0)
            return 0;
        advance(h, r, (size_t)w);
    }
    r->n = 0;
    h->seg = 0;
    return 1;
}

/* Queue as much of the current response as lwIP takes: 1 done, 0 blocked, -1 aborted. */
static int write_resp(struct hconn *h)
{
    struct core_resp *r = &h->core.resp;
    struct tcp_pcb *pcb = h->pcb;
    if (h->tls)
        return write_tls(h, r);
    while (h->seg < r->n) {
        const struct core_seg *s = &r->seg[h->seg];
        size_t n = s->len - h->seg_off;
        size_t room = tcp_sndbuf(pcb), pbufs = bytes_for(queue_room(pcb));
        if (n > room)
            n = room;
        if (n > pbufs)
            n = pbufs;
        if (n > MAX_WRITE)
            n = MAX_WRITE;
        if (n == 0)
            return 0;
        int more = h->seg_off + n < s->len || h->seg + 1 < r->n;
        u8_t flags = (more ? TCP_WRITE_FLAG_MORE : 0) |
                     (s->copy || s->len <= COPY_BELOW ? TCP_WRITE_FLAG_COPY : 0);
        err_t e;
        while ((e = tcp_write(pcb, s->p + h->seg_off, (u16_t)n, flags)) == ERR_MEM && n > TCP_MSS)
            n /= 2;
        if (e == ERR_MEM)
            return 0; /* out of pbufs/segments/queue: resume from sent/poll */
        if (e != ERR_OK)
            return abort_conn(h), -1;
        h->seg_off += (uint32_t)n;
        if (h->seg_off == s->len) {
            h->seg++;
            h->seg_off = 0;
        }
    }
    r->n = 0;
    h->seg = 0;
    return 1;
}

/* An HTTP/2 connection's pump: frames out (h2.c decides which), plaintext in. */
static err_t pump_h2(struct hconn *h, uint64_t now)
{
    for (;;) {
        struct core_resp *out = h2_output(h->h2, now);
        if (out) {
            int w = write_tls(h, out);
            if (w < 0)
                return ERR_ABRT;
            if (w == 0)
                break;
            h2_written(h->h2, now);
            continue;
        }
        if (h2_done(h->h2)) {
            tls_close_notify(h->tls);
            tcp_output(h->pcb);
            return linger(h);
        }
        const uint8_t *p;
        long n = tls_plain(h->tls, &p);
        if (n > 0) {
            size_t k = h2_take(h->h2, p, (size_t)n, now);
            tls_consume(h->tls, k);
            if (k)
                continue;
        } else if (n == TLS_CLOSED && !h->plain_eof) {
            h->plain_eof = 1;
            h2_eof(h->h2);
            continue;
        } else if (n == TLS_FAILED) {
            tcp_output(h->pcb); /* mbedTLS's alert */
            return close_conn(h);
        }
        break;
    }
    tcp_output(h->pcb);
    return ERR_OK;
}

/* A TLS connection's handshake comes first: its ALPN decides whether the core
 * speaks HTTP/1.1 itself or through h2.c. 1: go on; 0: wait; -1: closed. */
static int start_tls(struct hconn *h, uint64_t now)
{
    int r = tls_handshake(h->tls);
    if (r == 0) {
        tcp_output(h->pcb);
        return 0;
    }
    if (r < 0) { /* a failed handshake: mbedTLS's alert goes out, then we close */
        tcp_output(h->pcb);
        close_conn(h);
        return -1;
    }
    h->started = 1;
    if (tls_alpn_h2(h->tls)) {
        h->h2 = h->h2_reserve; /* taken at admission: a full heap never ends it here */
        h->h2_reserve = NULL;
        h->core.resp.n = 0; /* a 503 planned at accept is h2's to send, per stream */
        h2_init(h->h2, &h->core, now, h->open);
    } else if (h->h2_reserve) {
        tls_release(h->h2_reserve);
        h->h2_reserve = NULL;
    }
    return 1;
}

/*
 * The TLS port's first byte decides, before mbedTLS reads any: an uppercase
 * method letter is a plain HTTP request, answered as the Python TLS layer
 * answers it (nginx's 400, policy.h's bytes from protocols/tls.py) in plain
 * text. The session is dropped and the connection goes on as a plain one whose
 * core has that one response to write, then lingers as after any fatal error.
 */
static void sniff(struct hconn *h)
{
    const struct pbuf *q = h->in;
    while (q && !q->len)
        q = q->next;
    if (!q)
        return;
    h->sniffed = 1;
    uint8_t first = *(const uint8_t *)q->payload;
    if (first < POLICY_TLS_PLAIN_FIRST_MIN || first > POLICY_TLS_PLAIN_FIRST_MAX)
        return;
    tls_free(h->tls);
    h->tls = NULL;
    core_refuse(&h->core, policy_tls_plain_head, sizeof policy_tls_plain_head - 1,
                policy_tls_plain_body, sizeof policy_tls_plain_body - 1);
}

/* The connection's class (CLASS_*): its place in admit. */
static int klass(const struct hconn *h)
{
    const struct tcp_pcb *pcb = h->pcb;
    if (h->waiting)
        return CLASS_KEEP;
    if (h->refused || h->closing || h->lingering)
        return CLASS_DONE;
    if (h->tls && !h->started)
        return CLASS_HEAD;
    int writing = pcb->unsent || pcb->unacked;
    if (h->h2)
        return writing ? CLASS_BUSY : CLASS_IDLE;
    const struct core_conn *c = &h->core;
    if (writing || c->resp.n)
        return CLASS_BUSY;
    if (!h->served || c->len > c->start || c->discard)
        return CLASS_HEAD;
    return CLASS_IDLE;
}

/* A connection waiting on its client (a head, a ClientHello, the next request)
 * that has heard nothing from it for STALE_MS: it may give way. A TLS handshake
 * we have answered never does (only its timeout ends it): a reset mid-handshake
 * would fail a client that is merely slow to compute its side. */
static uint64_t idle_at;         /* ms: every frame for this core had reached it (http_idle) */

static int stale(const struct hconn *h, int k, uint64_t now, uint64_t quiet)
{
    if (h->tls && !h->started && tls_replied(h->tls))
        return 0;
    /* The silence must be the client's: STALE_MS after its last frame the loop
     * had drained every frame and found none of it. While the kernel itself is
     * behind (a burst of handshakes, a slow TCG guest), frames wait in the ring
     * and nobody is stale; on a core fed by core 0 (one queue pair) that includes
     * core 0's backlog not yet handed on (net_caught_up_ns). */
    return (k == CLASS_HEAD || k == CLASS_IDLE) && now - h->active > quiet &&
           idle_at > h->active + quiet;
}

/* Part of a head or ClientHello came and not the rest: stale for a newcomer that
 * has asked after STALE_ASKED_MS (admit). */
static int midway(const struct hconn *h)
{
    if (h->tls && !h->started)
        return h->sniffed && !tls_replied(h->tls);
    return !h->h2 && h->core.len > h->core.start && !h->core.resp.n;
}

void http_idle(void)
{
    idle_at = net_caught_up_ns() / 1000000u;
}

/* Its lwIP priority: lwIP aborts the lowest below the listeners' at a full PCB
 * pool (see CLASS_*), so only a stale or finished connection is ever a candidate. */
static int prio(const struct hconn *h, uint64_t now)
{
    int k = klass(h);
    return k == CLASS_DONE || stale(h, k, now, STALE_MS) ? k : k == CLASS_BUSY ? CLASS_BUSY : CLASS_KEEP;
}

/* How long it has waited in its class: since the accept for a handshake, else
 * since the core's current wait began (the connect, or the last response's
 * acknowledgement). */
static uint64_t waited(const struct hconn *h, uint64_t now)
{
    return now - (h->tls && !h->started ? h->accepted : h->core.since);
}

enum { ADMIT, REFUSE, WAIT };

/* ms until a connection may give way to a waiting one that has asked (admit's
 * WAIT for it; 0: none will by its silence alone): admit_waiting runs again then. */
static uint64_t stale_in;

/*
 * A connection's admission to the table (see CLASS_*): ADMIT when the table has
 * room or a stale waiting or idle connection gave way (the one that has waited
 * longest in the lowest class; stale after STALE_ASKED_MS of its client's silence
 * half way through a message when the newcomer has asked, else STALE_MS); REFUSE (a 503) when every
 * admitted one has been busy writing for STALE_MS; else WAIT, in its slot, for
 * one of them to finish or go stale.
 */
static int admit(const struct hconn *self, uint64_t now)
{
    struct hconn *victim = NULL;
    int vclass = CLASS_DONE;
    static uint64_t busy_since; /* every admitted connection busy since then (0: not) */
    uint32_t admitted = 0, unbusy = 0;
    uint64_t vwait = 0;
    int asked = self->waiting && self->whole;
    stale_in = 0;
    for (uint32_t i = 0; i < nslots; i++) {
        struct hconn *h = &conns[i];
        if (!h->used || h == self)
            continue;
        int k = klass(h);
        if (k == CLASS_DONE || k == CLASS_KEEP)
            continue;
        admitted++;
        if (k == CLASS_BUSY)
            continue;
        unbusy++;
        uint64_t w = waited(h, now);
        uint64_t quiet = asked && midway(h) ? STALE_ASKED_MS : STALE_MS;
        if (stale(h, k, now, quiet)) {
            if (k < vclass || (k == vclass && w > vwait)) {
                victim = h;
                vclass = k;
                vwait = w;
            }
        } else if ((k == CLASS_HEAD || k == CLASS_IDLE) &&
                   !(h->tls && !h->started && tls_replied(h->tls))) {
            /* quiet enough soon, or already but the loop has not drained since */
            uint64_t in = now - h->active <= quiet ? h->active + quiet + 1 - now : 10;
            if (!stale_in || in < stale_in)
                stale_in = in;
        }
    }
    if (admitted < table || unbusy)
        busy_since = 0;
    else if (!busy_since)
        busy_since = now;
    if (admitted < table)
        return ADMIT;
    if (victim) {
        abort_conn(victim);
        displaced++;
        return ADMIT;
    }
    return busy_since && now - busy_since > STALE_MS ? REFUSE : WAIT;
}

/* Whether a waiting connection has its first message whole (a TLS record, a
 * request head), or its peer finished: it goes before those still sending one. */
static int ready(const struct hconn *h)
{
    if (h->peer_eof)
        return 1;
    if (!h->in)
        return 0;
    uint8_t rec[5];
    if (h->on_tls && pbuf_copy_partial(h->in, rec, 5, 0) == 5 && rec[0] == 0x16)
        return h->in->tot_len >= 5u + ((uint32_t)rec[3] << 8 | rec[4]);
    return pbuf_memfind(h->in, "\r\n\r\n", 4, 0) != 0xffff ||
           pbuf_memfind(h->in, "\n\n", 2, 0) != 0xffff;
}

static err_t pump(struct hconn *h);

/*
 * Take a connection into the table (or refuse it: a 503): its TLS session and
 * the state an h2 connection would need come from the TLS heap now, so a full
 * heap makes it wait rather than fail later. 0: it still waits.
 */
static int enter(struct hconn *h, uint64_t now)
{
    int v = admit(h, now);
    if (v == WAIT)
        return 0;
    if (h->on_tls && !h->tls) {
        if (!(h->tls = tls_new(h->pcb, &h->in, &h->peer_eof)))
            return 0;
        if (v == ADMIT && !(h->h2_reserve = tls_alloc(h2_size()))) {
            tls_free(h->tls);
            h->tls = NULL;
            return 0;
        }
    }
    if (h->waiting) {
        h->waiting = 0;
        waiting_conns--;
        if (now - h->arrived > waited_max)
            waited_max = now - h->arrived;
    }
    if (v == REFUSE)
        refused++;
    h->refused = v == REFUSE;
    h->accepted = h->active = now;
    /* Over the limit, or refused by admit (UINT32_MAX: above any limit, see
     * limits_from_cmdline): a 503 to write (h2: one per stream). */
    h->open = v == ADMIT ? open_conns : UINT32_MAX;
    core_connect(&h->core, now, h->open);
    return 1;
}

/* The waiting connections, ready ones first, each in the order it came, while
 * the table takes them (from lwIP's timer: never inside another's callback). */
static void admit_waiting(void *arg);

/* admit_waiting again when a connection may give way to a waiting one that has
 * asked (its wait would otherwise end at a poll, every 500 ms). */
static int stale_retry_pending;

static void stale_retry(void *arg)
{
    (void)arg;
    stale_retry_pending = 0;
    /* Through schedule_admissions, never admit_waiting itself: that clears retry_pending
     * while its own timeout may still be queued, and each later schedule then queued one
     * more, until lwIP's timeout pool was empty (a PANIC in a burst of 1,000). */
    schedule_admissions();
}

static void admit_waiting(void *arg)
{
    (void)arg;
    retry_pending = 0;
    uint64_t now = now_ms(), retry = 0;
    for (int pass = 0; pass < 2 && waiting_conns; pass++) {
        for (;;) {
            struct hconn *next = NULL;
            for (uint32_t i = 0; i < nslots; i++) {
                struct hconn *h = &conns[i];
                if (h->used && h->waiting && (pass || ready(h)) &&
                    (!next || h->arrived < next->arrived))
                    next = h;
            }
            if (!next)
                break;
            if (!enter(next, now)) {
                if (!pass)
                    retry = stale_in;
                break;
            }
            pump(next);
        }
    }
    if (retry && !stale_retry_pending) {
        stale_retry_pending = 1;
        sys_timeout((u32_t)retry, stale_retry, NULL);
    }
}

static void schedule_admissions(void)
{
    if (!waiting_conns || retry_pending)
        return;
    retry_pending = 1;
    sys_timeout(0, admit_waiting, NULL);
}

/* Answer whatever can be answered now; returns ERR_ABRT if the pcb is gone. */
static err_t pump_io(struct hconn *h)
{
    struct core_conn *c = &h->core;
    uint64_t now = now_ms();
    if (h->lingering || h->waiting)
        return ERR_OK;
    if (h->tls && !h->sniffed)
        sniff(h);
    if (h->tls && !h->started && start_tls(h, now) <= 0)
        return ERR_OK;
    if (h->h2)
        return pump_h2(h, now);
    for (;;) {
        if (c->resp.n) {
            int w = write_resp(h);
            if (w < 0)
                return ERR_ABRT;
            if (w == 0)
                break;
            continue;
        }
        if (core_done(c) || stopping) {
            if (h->tls)
                tls_close_notify(h->tls);
            tcp_output(h->pcb);
            return linger(h);
        }
        if (core_next(c, now)) {
            h->served = 1;
            requests++;
            continue;
        }
        if (core_done(c))
            continue;
        if (h->tls) {
            const uint8_t *p;
            long n = core_wants_input(c) ? tls_plain(h->tls, &p) : 0;
            if (n > 0) {
                size_t k = core_take(c, p, (size_t)n);
                if (k) {
                    tls_consume(h->tls, k);
                    continue;
                }
            } else if (n == TLS_CLOSED && !c->eof) {
                core_eof(c); /* close_notify, or a bare EOF: answer what is asked */
                continue;
            } else if (n == TLS_FAILED) {
                tcp_output(h->pcb); /* mbedTLS's alert */
                return close_conn(h);
            }
            break;
        }
        if (h->in && core_wants_input(c)) {
            size_t k = core_take(c, h->in->payload, h->in->len);
            if (k) {
                tcp_recved(h->pcb, (u16_t)k);
                h->in = pbuf_free_header(h->in, (u16_t)k);
                continue;
            }
        }
        if (!h->in && h->peer_eof && !c->eof) {
            core_eof(c);
            continue;
        }
        break;
    }
    tcp_output(h->pcb);
    return ERR_OK;
}

/* pump_io, then the connection's class as its lwIP priority (see CLASS_*). */
static err_t pump(struct hconn *h)
{
    err_t e = pump_io(h);
    if (e != ERR_ABRT && h->used && h->pcb)
        tcp_setprio(h->pcb, (u8_t)prio(h, now_ms()));
    return e;
}

/* See INPUT_PBUFS. tot_len cannot wrap: what is held is within the window. When
 * the heap has no room for the copy, the chain stays as it is. */
static void compact_input(struct hconn *h)
{
    u16_t n = pbuf_clen(h->in);
    if (n < INPUT_PBUFS || (uint32_t)n * 128 <= h->in->tot_len)
        return;
    struct pbuf *q = pbuf_clone(PBUF_RAW, PBUF_RAM, h->in);
    if (q) {
        pbuf_free(h->in);
        h->in = q;
    }
}

static err_t on_recv(void *arg, struct tcp_pcb *pcb, struct pbuf *p, err_t err)
{
    struct hconn *h = arg;
    if (!h || h->closing || h->lingering) {
        if (p)
            discard(pcb, p);
        else if (h && h->lingering)
            end_linger(h); /* the peer's FIN: nothing more will come */
        return ERR_OK;
    }
    if (err != ERR_OK) { /* lwIP never passes anything else here in 2.1; keep it safe */
        if (p)
            pbuf_free(p);
        return ERR_OK;
    }
    h->active = now_ms();
    if (!p) {
        h->peer_eof = 1;
    } else if (h->in) {
        pbuf_cat(h->in, p);
        compact_input(h);
    } else {
        h->in = p;
    }
    if (h->waiting) {
        h->whole = (uint8_t)ready(h);
        uint32_t held = 0;
        for (uint32_t i = 0; i < nslots; i++)
            if (conns[i].used && conns[i].waiting && conns[i].in)
                held += conns[i].in->tot_len;
        while (held > WAIT_INPUT_ALL) {
            /* The waiting connection that has held input longest without a whole head
             * (or ClientHello) is reset: a flood's, not the hello of a client that came
             * last and is still sending it. */
            struct hconn *v = NULL;
            for (uint32_t i = 0; i < nslots; i++) {
                struct hconn *c = &conns[i];
                if (c->used && c->waiting && c->in && !c->whole &&
                    (!v || c->arrived < v->arrived))
                    v = c;
            }
            if (!v)
                v = h; /* every one whole (each about to be admitted): the one that sent */
            overflowed++;
            held -= v->in->tot_len;
            if (v == h)
                return abort_conn(h);
            abort_conn(v);
        }
        if (h->whole)
            schedule_admissions();
        return ERR_OK;
    }
    return pump(h);
}

static err_t on_sent(void *arg, struct tcp_pcb *pcb, u16_t len)
{
    (void)pcb;
    (void)len;
    struct hconn *h = arg;
    if (!h || h->closing || h->lingering || h->waiting)
        return ERR_OK;
    h->active = now_ms();
    core_sent(&h->core, now_ms());
    return pump(h);
}

static err_t on_poll(void *arg, struct tcp_pcb *pcb)
{
    struct hconn *h = arg;
    if (!h)
        return ERR_OK;
    if (h->closing) {
        if (finish(pcb) == ERR_OK) {
            detach(pcb);
            release(h);
        }
        return ERR_OK;
    }
    if (h->lingering) {
        if (now_ms() - h->linger_since > POLICY_LINGER_MS)
            end_linger(h);
        return ERR_OK;
    }
    if (h->waiting) {
        /* One whose first message is not whole waits as long as a head may take
         * (and the loop has drained every frame since: not while the kernel is
         * behind), then closes unanswered, as a head that never came; one that
         * has asked waits for its turn (ours to give: the table drains in order). */
        if (!ready(h) && now_ms() - h->arrived > core_limits.head_timeout &&
            idle_at > h->arrived + core_limits.head_timeout) {
            head_timeouts++;
            return close_conn(h);
        }
        schedule_admissions(); /* a connection may have gone stale meanwhile */
        tcp_setprio(pcb, CLASS_KEEP);
        return ERR_OK;
    }
    if (h->tls && tls_handshaking(h->tls) &&
        now_ms() - h->accepted > core_limits.head_timeout) {
        head_timeouts++;
        return close_conn(h); /* a slow or silent handshake */
    }
    if (h->h2) {
        if (h2_tick(h->h2, now_ms(), pcb->unsent || pcb->unacked)) {
            send_timeouts++;
            return abort_conn(h); /* a reader that takes nothing is dropped */
        }
        return pump(h);
    }
    int writing = h->core.resp.n || pcb->unsent || pcb->unacked;
    if (core_tick(&h->core, now_ms(), writing)) {
        if (!writing)
            return close_conn(h); /* idle */
        send_timeouts++;
        return abort_conn(h); /* a reader that takes nothing is dropped */
    }
    return pump(h); /* a 408, or output that ERR_MEM held back */
}

static void on_err(void *arg, err_t err)
{
    struct hconn *h = arg;
    if (h && err == ERR_ABRT)
        killed++; /* tcp_kill_prio at a full PCB pool, or retransmissions gave up */
    if (h) { /* the pcb is already freed by lwIP */
        if (h->in)
            pbuf_free(h->in);
        h->in = NULL;
        release(h);
    }
}

static err_t on_accept(void *arg, struct tcp_pcb *pcb, err_t err)
{
    if (err != ERR_OK || !pcb)
        return ERR_VAL;
    uint64_t now = now_ms();
    struct hconn *h = NULL;
    for (uint32_t i = 0; i < nslots; i++) {
        if (!conns[i].used) {
            h = &conns[i];
            break;
        }
    }
    if (!h) { /* cannot happen (http_ip4_input keeps a slot for each SYN), but never crash on it */
        tcp_abort(pcb);
        return ERR_ABRT;
    }
    h->used = 1;
    h->pcb = pcb;
    h->in = NULL;
    h->seg = 0;
    h->seg_off = 0;
    h->peer_eof = 0;
    h->closing = 0;
    h->lingering = 0;
    h->arrived = h->accepted = h->active = now;
    h->tls = NULL;
    h->h2 = NULL;
    h->h2_reserve = NULL;
    h->on_tls = arg == &tls_port;
    h->started = h->plain_eof = h->sniffed = 0;
    h->served = 0;
    h->refused = 0;
    h->waiting = 1; /* until enter() takes it */
    h->whole = 0;
    waiting_conns++;
    open_conns++;
    accepted_conns++;
    tcp_arg(pcb, h);
    tcp_recv(pcb, on_recv);
    tcp_sent(pcb, on_sent);
    tcp_err(pcb, on_err);
    tcp_poll(pcb, on_poll, POLL_INTERVAL);
    tcp_nagle_disable(pcb);
    /* The oldest waiting one goes first: a newcomer enters at once only when none waits. */
    if (waiting_conns > 1 || !enter(h, now)) {
        queued++;
        tcp_setprio(pcb, CLASS_KEEP);
        schedule_admissions();
        return ERR_OK;
    }
    err_t e = pump(h);
    return e == ERR_ABRT ? ERR_ABRT : ERR_OK;
}

/*
 * lwIP's IPv4 input hook (lwipopts.h): a SYN for one of our ports when every
 * slot is taken or promised (connections open and handshakes in SYN_RCVD) is
 * dropped, not answered: the peer retransmits it, so it waits for a slot
 * instead of taking the place of a connection in its handshake.
 */
int http_ip4_input(struct pbuf *p, struct netif *inp)
{
    (void)inp;
    const uint8_t *ip = p->payload;
    size_t hl = (size_t)(ip[0] & 0x0f) * 4;
    if (p->len < hl + TCP_HLEN || hl < IP_HLEN || ip[9] != IP_PROTO_TCP || ((ip[6] & 0x3f) | ip[7]))
        return 0;
    const struct tcp_hdr *th = (const struct tcp_hdr *)(ip + hl);
    u16_t dport = lwip_ntohs(th->dest);
    if ((TCPH_FLAGS(th) & (TCP_SYN | TCP_ACK | TCP_RST)) != TCP_SYN ||
        (dport != HTTP_PORT && !(tls_listener && dport == TLS_PORT)) || open_conns < nslots / 2)
        return 0;
    uint32_t promised = open_conns;
    for (const struct tcp_pcb *q = tcp_active_pcbs; q; q = q->next)
        if (q->state == SYN_RCVD)
            promised++;
    if (promised < nslots)
        return 0;
    syn_dropped++;
    pbuf_free(p);
    return 1;
}

/* "orisha.NAME=VALUE" on the kernel command line: a decimal, maybe with a fraction. */
static int option(const char *name, uint64_t scale, uint64_t *out)
{
    const char *cmd = platform_cmdline();
    size_t n = strlen(name);
    for (const char *p = cmd; *p; p++) {
        if ((p != cmd && p[-1] != ' ') || strncmp(p, "orisha.", 7) != 0 ||
            strncmp(p + 7, name, n) != 0 || p[7 + n] != '=')
            continue;
        const char *v = p + 8 + n;
        uint64_t whole = 0, frac = 0, div = 1;
        int digits = 0;
        while (*v >= '0' && *v <= '9' && whole < (1ull << 40))
            whole = whole * 10 + (uint64_t)(*v++ - '0'), digits++;
        if (*v == '.')
            for (v++; *v >= '0' && *v <= '9'; v++)
                if (div < 1000000)
                    frac = frac * 10 + (uint64_t)(*v - '0'), div *= 10, digits++;
        if (!digits || (*v && *v != ' ')) {
            platform_printf("orisha: ignoring malformed option orisha.%s\n", name);
            return 0;
        }
        *out = whole * scale + frac * scale / div;
        return 1;
    }
    return 0;
}

/* A value outside its limit's range (POLICY_LIMIT_RANGES) keeps the default, and says so. */
static int within(const char *name, uint64_t v, uint64_t low, uint64_t high)
{
    if (v >= low && v <= high)
        return 1;
    platform_printf("orisha: ignoring out-of-range option orisha.%s (expected %lu to %lu, "
                    "timeouts in ms)\n", name, (unsigned long)low, (unsigned long)high);
    return 0;
}

#define LIMIT_BOUNDS(name, low, high) \
    static const uint64_t name##_low = low, name##_high = high;
POLICY_LIMIT_RANGES(LIMIT_BOUNDS)
#undef LIMIT_BOUNDS

/* Every limit in POLICY_LIMITS (generated from orisha/core/policy.py LIMITS) as
 * orisha.<name>=<value>, the value times its scale (seconds become ms), within its range. */
static void limits_from_cmdline(void)
{
    struct core_limits *l = &core_limits;
    uint64_t v;
#define LIMIT_FROM_CMDLINE(name, def, scale)                                     \
    if (option(#name, scale, &v) && within(#name, v, name##_low, name##_high)) \
        l->name = v;
    POLICY_LIMITS(LIMIT_FROM_CMDLINE)
#undef LIMIT_FROM_CMDLINE
    /* The buffers are sized at compile time: larger limits are clamped. */
    if (l->head > CORE_HEAD_MAX)
        l->head = CORE_HEAD_MAX;
    if (l->target > CORE_TARGET_MAX)
        l->target = CORE_TARGET_MAX;
    if (l->head < 16)
        l->head = 16;
    if (l->connections >= UINT32_MAX) /* counts are u32; UINT32_MAX marks a refusal */
        l->connections = UINT32_MAX - 1;
    if (platform_verbose()) {
        platform_printf("orisha: limits");
#define LIMIT_SHOW(name, def, scale) platform_printf(" " #name " %lu", (unsigned long)l->name);
        POLICY_LIMITS(LIMIT_SHOW)
#undef LIMIT_SHOW
        platform_printf(" (timeouts in ms)\n");
    }
}

static struct tcp_pcb *listen_on(uint16_t port, void *arg)
{
    struct tcp_pcb *pcb = tcp_new();
    ASSERT(pcb);
    err_t e = tcp_bind(pcb, IP_ANY_TYPE, port);
    if (e != ERR_OK)
        PANIC("http: bind port %d failed (%d)", port, e);
    tcp_setprio(pcb, CLASS_LISTEN); /* tcp_listen keeps it; new PCBs inherit it */
    struct tcp_pcb *l = tcp_listen(pcb);
    ASSERT(l);
    tcp_arg(l, arg);
    tcp_accept(l, on_accept);
    return l;
}

/*
 * The stats line: admissions and memory. lwIP's heap holds received frames,
 * TLS records and segment headers; its pools the zero-copy body pbufs and the
 * segments. Logged at most once a second when a connection was displaced,
 * refused or killed or an allocation failed since the last line (serial
 * output is slow: nothing while all is well), at a stop, every 10 s with
 * orisha.verbose, and when the console asks ("stats"). Then each core's own
 * line: its connections, requests (HTTP/1.1 and h2), drops, and its time out of
 * HLT since its network came up as milliseconds and as guest (TSC) cycles per
 * request: what a request costs the core, polling included.
 */
void http_log_stats(void)
{
    const struct stats_mem *pb = lwip_stats.memp[MEMP_PBUF], *sg = lwip_stats.memp[MEMP_TCP_SEG];
    const struct stats_mem *pc = lwip_stats.memp[MEMP_TCP_PCB];
    char who[16] = ""; /* with more cores, whose counters these are: each has its own */
    if (platform_cpus() > 1)
        platform_snprintf(who, sizeof who, " cpu %u", platform_cpu());
    platform_printf("orisha: stats open %u waiting %u queued %lu waited_ms %lu syn_dropped %lu "
                    "overflowed %lu head_timeouts %lu "
                    "displaced %lu refused %lu killed %lu send_timeouts %lu "
                    "heap_used %lu heap_peak %lu heap_size %lu heap_failed %lu "
                    "pbufs_peak %u pbufs %u segs_peak %u segs %u pcbs_peak %u pcbs %u%s\n",
                    open_conns, waiting_conns, (unsigned long)queued, (unsigned long)waited_max,
                    (unsigned long)syn_dropped, (unsigned long)overflowed,
                    (unsigned long)head_timeouts,
                    (unsigned long)displaced, (unsigned long)refused,
                    (unsigned long)killed, (unsigned long)send_timeouts,
                    (unsigned long)lwip_stats.mem.used,
                    (unsigned long)lwip_stats.mem.max, (unsigned long)lwip_stats.mem.avail,
                    (unsigned long)lwip_stats.mem.err, pb->max, pb->avail, sg->max, sg->avail,
                    pc->max, pc->avail, who);
    uint64_t answered = requests + h2_requests(), busy_us = net_busy_ns() / 1000u;
    uint64_t cycles = busy_us * (platform_tsc_hz() / 1000000u);
    platform_printf("orisha: stats cpu %u connections %lu requests %lu drops %lu busy_ms %lu "
                    "cycles_per_request %lu\n",
                    platform_cpu(), (unsigned long)accepted_conns, (unsigned long)answered,
                    (unsigned long)(syn_dropped + refused + displaced + killed),
                    (unsigned long)(busy_us / 1000u),
                    (unsigned long)(answered ? cycles / answered : 0));
    net_log_stats();
    tls_log_stats();
}

static void stats_tick(void *arg)
{
    static uint64_t last, ticks;
    (void)arg;
    uint64_t sum = queued + syn_dropped + overflowed + head_timeouts + displaced + refused + killed + send_timeouts + lwip_stats.mem.err +
                   lwip_stats.memp[MEMP_PBUF]->err + lwip_stats.memp[MEMP_TCP_SEG]->err +
                   tls_failed_handshakes();
    if (sum != last || (platform_verbose() && ++ticks % 10 == 0))
        http_log_stats();
    last = sum;
    sys_timeout(STATS_MS, stats_tick, NULL);
}

/*
 * The table from the guest's RAM above the image: slots (a struct hconn each,
 * touched only as far as used) from at most half of it, the TLS heap from the
 * rest, TLS_SLOT for each connection the table admits; a plain kernel's table
 * is three quarters of its slots. Both within lwipopts.h's bounds, which the
 * pools and send floors are sized for. The TLS heap keeps the whole rest even
 * when the table is capped (what net_share takes next, and RAM_KEEP, kept out):
 * mbedTLS's first-fit heap fragments under bursts of handshakes (sessions of two
 * 16 KiB buffers freed and taken again among the handshakes' smaller blocks), and
 * with only TLS_SLOT a connection plus TLS_BASE a starved burst of 1,000 failed a
 * few dozen handshakes for want of a block (-0x7f00, MBEDTLS_ERR_SSL_ALLOC_FAILED;
 * tls.c counts them). Pages of it that are never used are never touched.
 */
static size_t size_table(void)
{
    size_t ram = platform_ram_left();
    size_t keep = RAM_KEEP + (platform_cpu() ? 0 : net_share_bytes(platform_cpus_asked()));
    ram = ram > keep ? ram - keep : 0;
    size_t slots = ram / SLOT_SHARE / sizeof(struct hconn), heap = 0;
    if (slots > ORISHA_CONN_SLOTS)
        slots = ORISHA_CONN_SLOTS;
    if (tls_built()) {
        size_t rest = ram - slots * sizeof(struct hconn);
        heap = rest > 128 ? rest - 128 : 0; /* two 64-byte alignments */
        table = heap > TLS_BASE ? (uint32_t)((heap - TLS_BASE) / TLS_SLOT) : 0;
    } else {
        table = (uint32_t)(slots - slots / 4);
    }
    if (table > ORISHA_CONN_TABLE)
        table = ORISHA_CONN_TABLE;
    if (table > slots)
        table = (uint32_t)slots;
    if (table < 4)
        PANIC("http: %zu KiB of RAM above the image hold %u connections: give the guest more "
              "memory (--memory)", ram / 1024, table);
    nslots = (uint32_t)slots;
    conns = platform_ram_alloc(slots * sizeof(struct hconn), 64);
    return heap;
}

int http_init(const uint8_t *image, size_t len)
{
    uint32_t routes = core_init(image, len);
    limits_from_cmdline();
    size_t heap = size_table();
    listener = listen_on(HTTP_PORT, NULL);
    if (tls_init(heap))
        tls_listener = listen_on(TLS_PORT, &tls_port);
    if (platform_verbose())
        platform_printf("orisha: http listening on port %d%s, %u routes\n", HTTP_PORT,
                        tls_listener ? " and tls on 443" : "", routes);
    sys_timeout(STATS_MS, stats_tick, NULL);
    return tls_listener != NULL;
}

/*
 * A graceful stop, as the hosted loops' (Connection.shutdown): no new
 * connections (lwIP answers a SYN for a closed port with a RST, and aborts
 * handshakes still in progress), idle connections close now, busy ones once
 * their current response is queued.
 */
void http_stop(void)
{
    if (stopping)
        return;
    stopping = 1;
    http_log_stats();
    if (tcp_close(listener) != ERR_OK) /* a listener closes without allocating */
        PANIC("http: closing the listener failed");
    listener = NULL;
    if (tls_listener && tcp_close(tls_listener) != ERR_OK)
        PANIC("http: closing the TLS listener failed");
    tls_listener = NULL;
    for (uint32_t i = 0; i < nslots; i++) {
        struct hconn *h = &conns[i];
        if (!h->used || h->closing || h->lingering)
            continue;
        if (h->waiting)
            close_conn(h);   /* never admitted: closes unanswered, as a SYN now would be */
        else if (h->h2) {
            h2_stop(h->h2);  /* GOAWAY; what was asked is still answered */
            pump(h);
        } else if (h->core.resp.n)
            pump(h);         /* lingers once its response is queued */
        else
            close_conn(h);   /* idle: closes now, as Connection.shutdown */
    }
}

uint32_t http_table(uint32_t *slots)
{
    *slots = nslots;
    return table;
}

/* Open connections, or bytes (a FIN included) the peers have not acknowledged. */
int http_busy(void)
{
    if (open_conns)
        return 1;
    for (const struct tcp_pcb *p = tcp_active_pcbs; p; p = p->next)
        if (p->unsent || p->unacked || (p->flags & TF_CLOSEPEND))
            return 1;
    return 0;
}
