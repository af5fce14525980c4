/*
 * HTTP/2 over the request core (see h2.h). Strategy: the same answers as the
 * Python layer (orisha/protocols/h2.py) from the same core: a request's header
 * block becomes the HTTP/1.1 head the core plans from (its pseudo-headers the
 * request line and Host, cookie crumbs joined, RFC 9113 §8.3), and the planned
 * response's head is sent as the header block the build stored beside it in the
 * image (hpack_blocks.block: static-table indexes and literals without indexing,
 * Huffman-coded where shorter, no dynamic table, the hosted server's bytes),
 * followed by the Date field; a head made per request (a 206, a redirect with a
 * query) is converted here the same way but without Huffman. Its body goes in
 * DATA frames that point into the image. A variant's 200 with early hints is
 * preceded by a 103 (RFC 8297; §8.1: an informational HEADERS frame without
 * END_STREAM), its block the build stored too (hpack_blocks.early_hints).
 *
 * Requests are decoded at once (HPACK state is shared by the whole connection)
 * and wait as heads in a bounded queue (one that does not fit gets
 * REFUSED_STREAM, §8.7: safe to retry). Each batch of output plans as many of
 * them as fit, one at a time through the core, and sends their HEADERS; a body
 * that is one span of the image (nearly every one) then goes on from a slot of
 * its own, DATA round robin across the slots like h2.py's ready queue. A body
 * of several pieces (multipart/byteranges) keeps per-response bytes in the
 * core, so no other request is planned until it is sent. Input is parsed frame
 * by frame as it arrives (never a whole frame held, except a header block),
 * and not at all while control frames wait to be written, so floods cannot
 * grow the output.
 *
 * A stream stays open on the client's side (struct body) until the client ends
 * or resets it, answered or not, so later frames meet its real state, as in
 * h2.py: DATA against the content-length and the stream's window, trailers
 * without pseudo-headers, WINDOW_UPDATE on an answered open stream, and DATA on
 * a stream the client ended or reset a connection error STREAM_CLOSED; only
 * streams we reset ignore late frames.
 *
 * The rules (§3.4 preface, §4.2 sizes, §5.1 stream states, §6 frames, §6.9 flow
 * control both ways, §8.2 field validity) and the abuse bounds (a budget of
 * frames that cost work but produce no response, refilled per second: rapid
 * reset, PING/SETTINGS floods; a header block of at most H2_BLOCK_FRAMES frames
 * and twice the head limit; a decoded list of at most four times it) are the
 * Python layer's, with its constants (h2tables.h, generated from it).
 */
#include <stddef.h>
#include <string.h>
#include "h2.h"
#include "h2tables.h"
#include "platform.h"
#include "tls.h"

static uint64_t planned; /* requests answered (this core's: the stats line) */

uint64_t h2_requests(void)
{
    return planned;
}

enum { DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY,
       WINDOW_UPDATE, CONTINUATION };
enum { F_END_STREAM = 0x1, F_ACK = 0x1, F_END_HEADERS = 0x4, F_PADDED = 0x8, F_PRIORITY = 0x20 };
enum { NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, SETTINGS_TIMEOUT,
       STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR,
       CONNECT_ERROR, ENHANCE_YOUR_CALM };
enum { K_REQUEST, K_TRAILERS, K_IGNORED };         /* what a header block is for */
enum { R_NONE, R_HEADERS, R_DATA };                /* the response being written */

#define BLOCK_CAP (2 * CORE_HEAD_MAX)    /* a header block: twice the head limit (h2.py) */
#define LIST_CAP (4 * CORE_HEAD_MAX)     /* a decoded field list (hpack's max_header_list_size) */
#define QUEUE_CAP (2 * CORE_HEAD_MAX)  /* heads of requests waiting: the longest, and more */
/* A header block and the queue start in small buffers of the connection and move to
 * full-size ones from the TLS heap only when they outgrow them (a long header list,
 * many requests at once), which are given back when the block ends or the queue
 * empties: most connections never need them. */
#define BLOCK_SMALL 1024
#define QUEUE_SMALL 2048
#define CTRL_CAP 1024                    /* control frames waiting to be written */
#define CTRL_ROOM 128                    /* input waits below this much room in ctrl */
#define OBUF_CAP 8192                    /* one batch: control frames, a HEADERS block, DATA headers */
#define OUT_HIGH (256 * 1024)            /* DATA bytes per batch (h2.py _OUT_HIGH) */
#define TABLE_CAP 4096                   /* SETTINGS_HEADER_TABLE_SIZE: the default, never changed */
#define TABLE_ENTRIES (TABLE_CAP / 32)
#define OPEN_CAP 8                       /* requests still sending their body */
#define RESETS 32                        /* streams reset lately (their late frames are ignored) */

static const uint8_t preface[24] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

struct qhead {                           /* a queued request, followed by its head bytes */
    int64_t window;                      /* its send window so far (WINDOW_UPDATE, SETTINGS) */
    uint32_t sid;
    uint16_t len;
    uint8_t whole;                       /* 0: over the head limit (the core answers 431) */
};
#define QSIZE(q) ((uint32_t)((sizeof(struct qhead) + (q)->len + 7) & ~7u))

struct tentry { uint16_t off, nlen, vlen; };

struct slot {                            /* a response sending DATA from one span of the image */
    const uint8_t *p;
    int64_t window;
    uint32_t sid, len, pos;
};

struct body {                            /* a request the client has not ended (h2.py _Body) */
    int64_t length, got, window, send;   /* content-length (-1: none), DATA, windows */
    uint32_t sid;
    uint8_t answered;                    /* our answer is all queued: `send` is its window */
};

struct h2 {
    struct core_conn *core;
    uint64_t since, refilled;
    uint32_t open;
    int32_t calm;
    uint8_t preface, settings_seen, closing, dead, eof;
    /* the peer's HPACK table went below the 4,096 bytes it started with: the next header
     * block owes it a size update (RFC 7541 §4.2), to 0 — our blocks use no table, so
     * once it is 0 nothing is owed again (table_zero) */
    uint8_t table_owed, table_zero;
    /* the frame being read */
    uint8_t fh[9], fh_len, ftype, fflags;
    uint32_t flen, fpos, fsid;
    uint8_t small[8], pre;               /* first payload bytes; HEADERS: pad + priority bytes */
    uint32_t frag_end;                   /* HEADERS/CONTINUATION: where the fragment ends */
    uint8_t set[6], set_len;             /* a SETTINGS entry being read */
    /* a header block being received */
    uint8_t in_block, block_frames, block_end, block_kind, self_dep;
    uint32_t block_sid, block_len;
    /* streams */
    uint32_t last_id;
    struct body remote_open[OPEN_CAP];
    uint8_t n_open, reset_pos;
    uint32_t resets[RESETS];
    /* flow control */
    int64_t window, initial, recv_window;
    uint32_t max_frame, recv_used;
    /* responses whose body is one span of the image: DATA round robin */
    struct slot slots[H2_MAX_STREAMS];
    uint32_t n_slots, rr;
    /* the response the core holds: being planned, or sending a body made of several
     * pieces (multipart/byteranges), which the core keeps until the next request */
    uint32_t cur_sid;
    int64_t cur_window;
    uint8_t cur_state, bseg;
    uint32_t boff;
    /* HPACK decoder's dynamic table: entries newest first from t_head, bytes in order */
    uint32_t table_max, table_size;
    uint16_t t_head, t_n, t_end;
    struct tentry tent[TABLE_ENTRIES];
    uint8_t table[TABLE_CAP];
    /* queues */
    uint32_t q_len, q_n, ctrl_len, olen, q_cap, block_cap;
    uint8_t *queue, *block;              /* the small buffers below, or QUEUE_CAP/BLOCK_CAP */
    uint8_t ctrl[CTRL_CAP];
    struct core_resp out;
    uint8_t obuf[OBUF_CAP];
    uint8_t queue_small[QUEUE_SMALL] __attribute__((aligned(8)));
    uint8_t block_small[BLOCK_SMALL];
};

/* Scratch shared by every connection: used within one call only. */
static uint8_t list_buf[LIST_CAP + 64];  /* decoded fields: u16 nlen, u16 vlen, name, value */
static uint8_t head_buf[LIST_CAP + 256]; /* a synthetic HTTP/1.1 head */
static uint8_t resp_buf[OBUF_CAP];       /* a response head, gathered from the core's segments */
static uint8_t huff_buf[LIST_CAP];       /* a Huffman-decoded string */

size_t h2_size(void)
{
    return sizeof(struct h2);
}

static uint32_t be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static void put_frame(uint8_t *p, uint32_t len, uint8_t type, uint8_t flags, uint32_t sid)
{
    p[0] = (uint8_t)(len >> 16), p[1] = (uint8_t)(len >> 8), p[2] = (uint8_t)len;
    p[3] = type, p[4] = flags;
    p[5] = (uint8_t)(sid >> 24), p[6] = (uint8_t)(sid >> 16), p[7] = (uint8_t)(sid >> 8), p[8] = (uint8_t)sid;
}

/* A control frame for the next batch; input stops well before ctrl is full. */
static void ctrl(struct h2 *h, uint8_t type, uint8_t flags, uint32_t sid, const uint8_t *payload,
                 uint32_t len)
{
    ASSERT(h->ctrl_len + 9 + len <= CTRL_CAP);
    put_frame(h->ctrl + h->ctrl_len, len, type, flags, sid);
    memcpy(h->ctrl + h->ctrl_len + 9, payload, len);
    h->ctrl_len += 9 + len;
}

static void ctrl_u32(struct h2 *h, uint8_t type, uint32_t sid, uint32_t v)
{
    uint8_t b[4] = { (uint8_t)(v >> 24), (uint8_t)(v >> 16), (uint8_t)(v >> 8), (uint8_t)v };
    ctrl(h, type, 0, sid, b, 4);
}

/* -- streams ----------------------------------------------------------------- */

static struct body *open_of(struct h2 *h, uint32_t sid)
{
    for (uint8_t i = 0; i < h->n_open; i++)
        if (h->remote_open[i].sid == sid)
            return &h->remote_open[i];
    return NULL;
}

/* Open streams whose answer is all queued (half-closed (local)): they count (§5.1.2). */
static uint32_t half_local(const struct h2 *h)
{
    uint32_t n = 0;
    for (uint8_t i = 0; i < h->n_open; i++)
        n += h->remote_open[i].answered;
    return n;
}

static void close_remote(struct h2 *h, uint32_t sid)
{
    for (uint8_t i = 0; i < h->n_open; i++)
        if (h->remote_open[i].sid == sid) {
            h->remote_open[i] = h->remote_open[--h->n_open];
            return;
        }
}

static int was_reset(struct h2 *h, uint32_t sid)
{
    for (int i = 0; i < RESETS; i++)
        if (h->resets[i] == sid)
            return 1;
    return 0;
}

/* Move `*buf` (used bytes, in a small buffer) to a `cap`-byte one from the TLS heap;
 * 0 when the heap is full. */
static int grow(uint8_t **buf, uint32_t *buf_cap, uint32_t used, uint32_t cap)
{
    uint8_t *big = tls_alloc(cap);
    if (!big)
        return 0;
    memcpy(big, *buf, used);
    *buf = big, *buf_cap = cap;
    return 1;
}

static void block_small(struct h2 *h)
{
    if (h->block != h->block_small)
        tls_release(h->block);
    h->block = h->block_small, h->block_cap = BLOCK_SMALL;
}

static void queue_small(struct h2 *h)
{
    if (h->queue != h->queue_small)
        tls_release(h->queue);
    h->queue = h->queue_small, h->q_cap = QUEUE_SMALL;
}

static struct slot *slot_of(struct h2 *h, uint32_t sid)
{
    for (uint32_t i = 0; i < h->n_slots; i++)
        if (h->slots[i].sid == sid)
            return &h->slots[i];
    return NULL;
}

static void drop_slot(struct h2 *h, struct slot *s)
{
    *s = h->slots[--h->n_slots];
}

/* Streams being answered or waiting to be (the §5.1.2 count). */
static uint32_t streams(const struct h2 *h)
{
    return h->q_n + h->n_slots + (h->cur_sid ? 1 : 0);
}

static struct qhead *queued(struct h2 *h, uint32_t sid)
{
    for (uint32_t off = 0; off < h->q_len;) {
        struct qhead *q = (struct qhead *)(h->queue + off);
        if (q->sid == sid)
            return q;
        off += QSIZE(q);
    }
    return NULL;
}

static void unqueue(struct h2 *h, struct qhead *q)
{
    uint32_t off = (uint32_t)((uint8_t *)q - h->queue);
    uint32_t size = QSIZE(q);
    memmove(h->queue + off, h->queue + off + size, h->q_len - off - size);
    h->q_len -= size;
    h->q_n--;
    if (!h->q_n)
        queue_small(h);
}

static void go_away(struct h2 *h, uint32_t code)
{
    if (!h->closing || code) {
        uint8_t b[8] = { (uint8_t)(h->last_id >> 24), (uint8_t)(h->last_id >> 16),
                         (uint8_t)(h->last_id >> 8), (uint8_t)h->last_id,
                         (uint8_t)(code >> 24), (uint8_t)(code >> 16), (uint8_t)(code >> 8), (uint8_t)code };
        ctrl(h, GOAWAY, 0, 0, b, 8);
    }
    h->closing = 1;
}

/* A connection error (§5.4.1): GOAWAY, forget every stream, read nothing more. */
static void fail(struct h2 *h, uint32_t code)
{
    if (h->dead)
        return;
    go_away(h, code);
    h->dead = 1;
    h->in_block = 0;
    block_small(h);
    h->q_len = h->q_n = 0;
    queue_small(h);
    h->n_slots = 0;
    h->cur_sid = 0;
    h->cur_state = R_NONE;
}

/* A stream error (§5.4.2): RST_STREAM, and the stream is forgotten. */
static void reset(struct h2 *h, uint32_t sid, uint32_t code)
{
    ctrl_u32(h, RST_STREAM, sid, code);
    h->resets[h->reset_pos++ % RESETS] = sid;
    close_remote(h, sid);
    struct qhead *q = queued(h, sid);
    if (q)
        unqueue(h, q);
    struct slot *sl = slot_of(h, sid);
    if (sl)
        drop_slot(h, sl);
    if (h->cur_sid == sid) {
        h->cur_sid = 0;
        h->cur_state = R_NONE;
    }
}

/* One frame of work without a response; 0 (and GOAWAY) once the budget is spent. */
static int spend(struct h2 *h)
{
    if (--h->calm < 0) {
        fail(h, ENHANCE_YOUR_CALM);
        return 0;
    }
    return 1;
}

/* Our side of `sid` is done (`window`: what is left of its send window). A request
 * still open stays so (half-closed (local), §5.1) until the client ends or resets it;
 * one whose body has filled its window is told to stop (§8.1). */
static void ended(struct h2 *h, uint32_t sid, int64_t window)
{
    struct body *b = open_of(h, sid);
    if (b) {
        b->answered = 1;
        b->send = window;
        if (b->window <= 0)
            reset(h, sid, NO_ERROR);
    }
}

/* -- HPACK (RFC 7541) ------------------------------------------------------------ */

static int dec_int(const uint8_t **p, const uint8_t *end, int prefix, uint32_t *out)
{
    uint32_t max = (1u << prefix) - 1, v = **p & max;
    (*p)++;
    if (v < max) {
        *out = v;
        return 0;
    }
    for (int shift = 0; *p < end && shift <= 21; shift += 7) {
        uint8_t b = *(*p)++;
        v += (uint32_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return -1; /* truncated, or more than 2^28: no field is that long */
}

/* §5.2 with Appendix B: returns the decoded length, or -1. */
static long huffman(const uint8_t *s, uint32_t n, uint8_t *out, uint32_t cap)
{
    uint32_t code = 0, len = 0, o = 0;
    for (uint32_t i = 0; i < n; i++)
        for (int bit = 7; bit >= 0; bit--) {
            code = code << 1 | ((s[i] >> bit) & 1);
            if (++len > 30)
                return -1;
            if (h2_huff_count[len] && code - h2_huff_first[len] < h2_huff_count[len]) {
                uint16_t sym = h2_huff_symbols[h2_huff_offset[len] + code - h2_huff_first[len]];
                if (sym == 256 || o == cap)
                    return -1; /* EOS inside a string (§5.2), or too long */
                out[o++] = (uint8_t)sym;
                code = len = 0;
            }
        }
    if (len > 7 || code != (1u << len) - 1)
        return -1; /* padding: at most 7 bits, the EOS code's leading ones */
    return (long)o;
}

/* A string literal into *s and *n (pointing into the block, or huff_buf + *used). */
static int dec_string(const uint8_t **p, const uint8_t *end, const uint8_t **s, uint32_t *n,
                      uint32_t *used)
{
    if (*p >= end)
        return -1;
    int huff = **p & 0x80;
    uint32_t len;
    if (dec_int(p, end, 7, &len) || len > (uint32_t)(end - *p))
        return -1;
    if (!huff) {
        *s = *p, *n = len;
    } else {
        long k = huffman(*p, len, huff_buf + *used, LIST_CAP - *used);
        if (k < 0)
            return -1;
        *s = huff_buf + *used, *n = (uint32_t)k;
        *used += (uint32_t)k;
    }
    *p += len;
    return 0;
}

static struct tentry *tget(struct h2 *h, uint32_t i)
{
    return &h->tent[(h->t_head + i) % TABLE_ENTRIES];
}

static void tevict(struct h2 *h)
{
    struct tentry *e = tget(h, (uint32_t)h->t_n - 1);
    h->table_size -= e->nlen + e->vlen + 32u;
    h->t_n--;
    if (!h->t_n)
        h->t_end = 0;
}

static void tshrink(struct h2 *h, uint32_t max)
{
    while (h->table_size > max)
        tevict(h);
}

/* §4.4: evict until the entry fits; one larger than the table empties it. */
static void tinsert(struct h2 *h, const uint8_t *name, uint32_t nlen, const uint8_t *value, uint32_t vlen)
{
    uint32_t size = nlen + vlen + 32;
    if (size > h->table_max) {
        tshrink(h, 0);
        return;
    }
    tshrink(h, h->table_max - size);
    if (h->t_end + nlen + vlen > TABLE_CAP) { /* compact, oldest first: offsets only fall */
        uint16_t at = 0;
        for (uint32_t i = h->t_n; i-- > 0;) {
            struct tentry *e = tget(h, i);
            memmove(h->table + at, h->table + e->off, e->nlen + e->vlen);
            e->off = at;
            at = (uint16_t)(at + e->nlen + e->vlen);
        }
        h->t_end = at;
    }
    h->t_head = (uint16_t)((h->t_head + TABLE_ENTRIES - 1) % TABLE_ENTRIES);
    struct tentry *e = tget(h, 0);
    e->off = h->t_end, e->nlen = (uint16_t)nlen, e->vlen = (uint16_t)vlen;
    memcpy(h->table + h->t_end, name, nlen);
    memcpy(h->table + h->t_end + nlen, value, vlen);
    h->t_end = (uint16_t)(h->t_end + nlen + vlen);
    h->t_n++;
    h->table_size += size;
}

static int lookup(struct h2 *h, uint32_t idx, const uint8_t **name, uint32_t *nlen,
                  const uint8_t **value, uint32_t *vlen)
{
    if (idx >= 1 && idx <= H2_STATIC_N) {
        const struct h2_static *s = &h2_static[idx - 1];
        *name = (const uint8_t *)s->name, *nlen = s->nlen;
        *value = (const uint8_t *)s->value, *vlen = s->vlen;
        return 0;
    }
    if (idx <= H2_STATIC_N || idx - H2_STATIC_N - 1 >= h->t_n)
        return -1; /* 0, or past the dynamic table */
    struct tentry *e = tget(h, idx - H2_STATIC_N - 1);
    *name = h->table + e->off, *nlen = e->nlen;
    *value = h->table + e->off + e->nlen, *vlen = e->vlen;
    return 0;
}

/* A decoded field appended to list_buf (u16 name length, u16 value length, name,
 * value); NULL past the list bound (an HPACK bomb) or the buffer. */
static uint8_t *add_field(uint32_t *out, uint32_t *list, const uint8_t *name, uint32_t nlen,
                          const uint8_t *value, uint32_t vlen)
{
    *list += nlen + vlen + 32; /* RFC 7541 §4.1's size, as hpack's max_header_list_size */
    if (*list > 4 * core_limits.head || *out + 4 + nlen + vlen > LIST_CAP)
        return NULL;
    uint8_t *f = list_buf + *out;
    f[0] = (uint8_t)nlen, f[1] = (uint8_t)(nlen >> 8), f[2] = (uint8_t)vlen, f[3] = (uint8_t)(vlen >> 8);
    memcpy(f + 4, name, nlen);
    memcpy(f + 4 + nlen, value, vlen);
    *out += 4 + nlen + vlen;
    return f;
}

/* The field at list_buf + *off, and *off past it. */
static void next_field(long *off, const uint8_t **name, uint32_t *nlen, const uint8_t **value,
                       uint32_t *vlen)
{
    const uint8_t *f = list_buf + *off;
    *nlen = f[0] | (uint32_t)f[1] << 8, *vlen = f[2] | (uint32_t)f[3] << 8;
    *name = f + 4, *value = f + 4 + *nlen;
    *off += 4 + *nlen + *vlen;
}

/* Decode a header block into list_buf; returns its length in bytes, or -1 (the
 * connection's HPACK state is then lost: COMPRESSION_ERROR). */
static long hpack_decode(struct h2 *h, const uint8_t *p, uint32_t n)
{
    const uint8_t *end = p + n;
    uint32_t out = 0, list = 0, used = 0;
    while (p < end) {
        uint8_t b = *p;
        const uint8_t *name, *value;
        uint32_t nlen, vlen, idx;
        int index = 0;
        if ((b & 0xe0) == 0x20) { /* §6.3 size update: only before the first field */
            if (out || dec_int(&p, end, 5, &idx) || idx > TABLE_CAP)
                return -1;
            h->table_max = idx;
            tshrink(h, idx);
            continue;
        }
        if (b & 0x80) { /* §6.1 indexed */
            if (dec_int(&p, end, 7, &idx) || lookup(h, idx, &name, &nlen, &value, &vlen))
                return -1;
        } else { /* §6.2 literals: with incremental indexing, without, never indexed */
            index = (b & 0xc0) == 0x40;
            const uint8_t *unused;
            uint32_t unused_len;
            if (dec_int(&p, end, index ? 6 : 4, &idx) ||
                (idx ? lookup(h, idx, &name, &nlen, &unused, &unused_len)
                     : dec_string(&p, end, &name, &nlen, &used)) ||
                dec_string(&p, end, &value, &vlen, &used))
                return -1;
        }
        uint8_t *f = add_field(&out, &list, name, nlen, value, vlen);
        if (!f)
            return -1;
        if (index) /* §6.2.1: from the copy, as eviction may reuse the name's bytes */
            tinsert(h, f + 4, nlen, f + 4 + nlen, vlen);
    }
    return (long)out;
}

/* -- requests: a decoded list as the HTTP/1.1 head the core takes (h2.py _synthetic_head) -- */

static int same(const uint8_t *a, uint32_t n, const char *s)
{
    return n == strlen(s) && memcmp(a, s, n) == 0;
}

/* §8.2.1: a name is lowercase tokens (":" only as the pseudo prefix), a value has no
 * NUL, CR or LF and no whitespace at either end. */
static int valid(const uint8_t *name, uint32_t nlen, const uint8_t *value, uint32_t vlen)
{
    if (!nlen)
        return 0;
    for (uint32_t i = 0; i < nlen; i++)
        if (name[i] <= 0x20 || (name[i] >= 'A' && name[i] <= 'Z') || name[i] == ':' || name[i] >= 0x7f)
            return 0;
    for (uint32_t i = 0; i < vlen; i++)
        if (!value[i] || value[i] == '\r' || value[i] == '\n')
            return 0;
    return !vlen || (value[0] != ' ' && value[0] != '\t' && value[vlen - 1] != ' ' &&
                     value[vlen - 1] != '\t');
}

static int connection_field(const uint8_t *name, uint32_t nlen, const uint8_t *value, uint32_t vlen)
{
    for (size_t i = 0; i < sizeof h2_connection_fields / sizeof h2_connection_fields[0]; i++)
        if (same(name, nlen, h2_connection_fields[i]))
            return 1;
    return same(name, nlen, H2_TE) && !same(value, vlen, H2_TRAILERS);
}

/* Bytes appended after a fixed start, within a room. */
struct lines {
    uint8_t *o;
    uint32_t at, room;
};

static int emit(struct lines *w, const void *p, uint32_t n)
{
    if (w->at + n > w->room)
        return -1;
    memcpy(w->o + w->at, p, n);
    w->at += n;
    return 0;
}

struct request {
    const uint8_t *pseudo[4];            /* :method, :path, :scheme, :authority */
    uint32_t plen[4];
    const uint8_t *host;
    uint32_t host_len, cookies;
};

/* Pass over the list: pseudo-headers first (§8.3), every field valid (§8.2), the
 * regular ones as "\r\nname: value" lines but Host and cookies. 0, -1 malformed,
 * -2 too long. */
static int request_fields(long list_len, struct request *r, struct lines *w)
{
    int regular = 0;
    for (long off = 0; off < list_len;) {
        const uint8_t *name, *value;
        uint32_t nlen, vlen;
        next_field(&off, &name, &nlen, &value, &vlen);
        if (nlen && name[0] == ':') {
            int k = 0;
            while (k < 4 && !same(name, nlen, h2_pseudo[k]))
                k++;
            if (regular || k == 4 || r->pseudo[k])
                return -1; /* late, unknown, repeated or a response pseudo-header */
            r->pseudo[k] = value, r->plen[k] = vlen;
            continue;
        }
        regular = 1;
        if (!valid(name, nlen, value, vlen) || connection_field(name, nlen, value, vlen))
            return -1;
        if (same(name, nlen, H2_COOKIE)) {
            r->cookies++; /* joined at the end (§8.2.3) */
        } else if (same(name, nlen, policy_field_names[FIELD_HOST])) {
            r->host = value, r->host_len = vlen;
        } else if (emit(w, "\r\n", 2) || emit(w, name, nlen) || emit(w, ": ", 2) ||
                   emit(w, value, vlen)) {
            return -2;
        }
    }
    return 0;
}

/* "cookie: a; b" from the crumbs, in order (§8.2.3). */
static int cookie_line(long list_len, struct lines *w)
{
    if (emit(w, "\r\n", 2) || emit(w, H2_COOKIE, sizeof H2_COOKIE - 1) || emit(w, ": ", 2))
        return -2;
    uint32_t n = 0;
    for (long off = 0; off < list_len;) {
        const uint8_t *name, *value;
        uint32_t nlen, vlen;
        next_field(&off, &name, &nlen, &value, &vlen);
        if (same(name, nlen, H2_COOKIE) && ((n++ && emit(w, "; ", 2)) || emit(w, value, vlen)))
            return -2;
    }
    return 0;
}

/* The head into head_buf (its length); -1 for a malformed request (§8.1.1), -2
 * for one longer than any head the core takes. The field lines are written to
 * the buffer's second half first, then the request line just before them. */
static long synthetic(long list_len)
{
    struct request r = { 0 };
    struct lines w = { head_buf + sizeof head_buf / 2, 0, sizeof head_buf / 2 };
    int e = request_fields(list_len, &r, &w);
    if (e)
        return e;
    if (!r.pseudo[0])
        return -1;
    if (same(r.pseudo[0], r.plen[0], H2_CONNECT)) {
        if (r.pseudo[1] || r.pseudo[2] || !r.pseudo[3])
            return -1; /* §8.5 */
        r.pseudo[1] = r.pseudo[3], r.plen[1] = r.plen[3];
    } else if (!r.pseudo[1] || !r.plen[1] || !r.pseudo[2]) {
        return -1;
    }
    if (r.cookies && cookie_line(list_len, &w))
        return -2;
    const uint8_t *authority = r.pseudo[3] ? r.pseudo[3] : r.host;
    uint32_t alen = r.pseudo[3] ? r.plen[3] : r.host_len;
    struct lines line = { head_buf, 0, sizeof head_buf / 2 };
    if (emit(&line, r.pseudo[0], r.plen[0]) || emit(&line, " ", 1) ||
        emit(&line, r.pseudo[1], r.plen[1]) || emit(&line, " HTTP/1.1\r\n", 11) ||
        emit(&line, policy_field_names[FIELD_HOST], (uint32_t)strlen(policy_field_names[FIELD_HOST])) ||
        emit(&line, ": ", 2) ||
        (alen && emit(&line, authority, alen)))
        return -2;
    memmove(head_buf + line.at, w.o, w.at);
    return (long)(line.at + w.at);
}

/* Queue a request's head. One over the head limit is queued as a stand-in the
 * core answers 431 (RFC 9113 §10.5.1, as h2.py): a request line and a field line
 * running past the limit with no end. */
static int enqueue(struct h2 *h, uint32_t sid, long len)
{
    uint32_t keep = (uint32_t)len, whole = 1;
    if (len < 0 || (uint64_t)len > core_limits.head)
        keep = whole = 0; /* start_next feeds the stand-in */
    uint32_t size = (uint32_t)((sizeof(struct qhead) + keep + 7) & ~7u);
    if (streams(h) + half_local(h) >= H2_MAX_STREAMS || h->q_len + size > QUEUE_CAP)
        return 0;
    if (h->q_len + size > h->q_cap && !grow(&h->queue, &h->q_cap, h->q_len, QUEUE_CAP))
        return 0; /* the TLS heap is full: refused, as when the queue is */
    struct qhead *q = (struct qhead *)(h->queue + h->q_len);
    q->sid = sid;
    q->window = h->initial;
    q->len = (uint16_t)keep;
    q->whole = (uint8_t)whole;
    memcpy(q + 1, head_buf, keep);
    h->q_len += size;
    h->q_n++;
    return 1;
}

/* The request's content-length: -1 when there is none the DATA can be held to
 * (absent, repeated with different values, not 1 to 18 digits: the core answers 400). */
static int64_t declared(long list_len)
{
    const uint8_t *first = NULL;
    uint32_t first_len = 0;
    for (long off = 0; off < list_len;) {
        const uint8_t *name, *value;
        uint32_t nlen, vlen;
        next_field(&off, &name, &nlen, &value, &vlen);
        if (!same(name, nlen, policy_field_names[FIELD_CONTENT_LENGTH]))
            continue;
        if (first && (vlen != first_len || memcmp(value, first, vlen)))
            return -1;
        first = value, first_len = vlen;
    }
    if (!first || !first_len || first_len > 18)
        return -1;
    int64_t v = 0;
    for (uint32_t i = 0; i < first_len; i++) {
        if (first[i] < '0' || first[i] > '9')
            return -1;
        v = v * 10 + (first[i] - '0');
    }
    return v;
}

/* §8.1: trailers end the request; a pseudo-header in them, or a body short of its
 * content-length, makes it malformed (§8.1.1). */
static void trailers(struct h2 *h, uint32_t sid, long list_len)
{
    struct body *b = open_of(h, sid);
    if (!b)
        return;
    int bad = b->length >= 0 && b->got != b->length;
    for (long off = 0; off < list_len && !bad;) {
        const uint8_t *name, *value;
        uint32_t nlen, vlen;
        next_field(&off, &name, &nlen, &value, &vlen);
        bad = nlen && name[0] == ':';
    }
    close_remote(h, sid);
    if (bad)
        reset(h, sid, PROTOCOL_ERROR);
}

/* §6.2, §6.10: a complete header block. */
static void end_headers(struct h2 *h, uint64_t now)
{
    h->in_block = 0;
    uint32_t sid = h->block_sid;
    long list = hpack_decode(h, h->block, h->block_len);
    block_small(h); /* decoded: the fields are in list_buf now */
    if (list < 0) {
        fail(h, COMPRESSION_ERROR);
        return;
    }
    if (h->block_kind == K_TRAILERS) {
        trailers(h, sid, list);
        return;
    }
    if (h->block_kind != K_REQUEST)
        return;
    long head = synthetic(list);
    int64_t length = declared(list);
    if (head == -1 || (h->block_end && length > 0)) {
        reset(h, sid, PROTOCOL_ERROR); /* §8.1.1 malformed; a content-length with no DATA */
        return;
    }
    if (!h->block_end && h->n_open == OPEN_CAP) {
        reset(h, sid, REFUSED_STREAM);
        spend(h);
        return;
    }
    if (!enqueue(h, sid, head)) {
        reset(h, sid, REFUSED_STREAM); /* §5.1.2, §8.7: the client may retry it */
        spend(h);
        return;
    }
    if (!h->block_end)
        h->remote_open[h->n_open++] = (struct body){ length, 0, H2_WINDOW, 0, sid, 0 };
    h->since = now;
}

/* -- frames ---------------------------------------------------------------------- */

static void headers_frame(struct h2 *h, uint64_t now)
{
    uint32_t sid = h->fsid;
    if (!sid || !(sid & 1)) {
        fail(h, PROTOCOL_ERROR); /* §5.1.1: clients use odd ids */
        return;
    }
    int kind;
    if (open_of(h, sid)) {
        kind = K_TRAILERS;
        if (!(h->fflags & F_END_STREAM)) {
            reset(h, sid, PROTOCOL_ERROR); /* §8.1: trailers end the stream */
            kind = K_IGNORED;
        }
    } else if (sid <= h->last_id) {
        if (!was_reset(h, sid)) {
            fail(h, PROTOCOL_ERROR); /* ids only grow; a closed stream takes no HEADERS */
            return;
        }
        kind = K_IGNORED; /* decoded for the HPACK state, then dropped */
        if (!spend(h))
            return;
    } else {
        h->last_id = sid;
        kind = K_REQUEST;
        if (h->closing) { /* §6.8: after our GOAWAY a new stream is ignored, with its frames */
            kind = K_IGNORED;
            h->resets[h->reset_pos++ % RESETS] = sid;
        }
        h->since = now;
    }
    if (h->self_dep) { /* §5.3.1: a stream error; the block is still decoded */
        reset(h, sid, PROTOCOL_ERROR);
        kind = K_IGNORED;
    }
    h->in_block = 1;
    h->block_sid = sid;
    h->block_end = h->fflags & F_END_STREAM;
    h->block_kind = (uint8_t)kind;
    h->block_frames = 1;
    if (h->fflags & F_END_HEADERS)
        end_headers(h, now);
}

static void data_frame(struct h2 *h)
{
    uint32_t sid = h->fsid;
    if (!sid) {
        fail(h, PROTOCOL_ERROR);
        return;
    }
    h->recv_used += h->flen;
    if (h->recv_used >= H2_WINDOW / 2) { /* bodies are discarded: give the window back */
        ctrl_u32(h, WINDOW_UPDATE, 0, h->recv_used);
        h->recv_window += h->recv_used;
        h->recv_used = 0;
    }
    uint32_t payload = h->flen;
    if (h->fflags & F_PADDED) {
        if (!h->flen || h->small[0] >= h->flen) {
            fail(h, PROTOCOL_ERROR); /* §6.1: padding as long as the payload */
            return;
        }
        payload = h->flen - 1 - h->small[0];
    }
    struct body *b = open_of(h, sid);
    if (b) {
        b->window -= h->flen;
        b->got += payload;
        if (b->window < 0)
            reset(h, sid, FLOW_CONTROL_ERROR); /* §6.9.1: past the stream's window */
        else if (b->length >= 0 && (b->got > b->length ||
                                    ((h->fflags & F_END_STREAM) && b->got != b->length)))
            reset(h, sid, PROTOCOL_ERROR); /* §8.1.1: not its content-length */
        else if (h->fflags & F_END_STREAM)
            close_remote(h, sid);
        else if (!payload)
            spend(h);
        else if (!b->window && b->answered)
            reset(h, sid, NO_ERROR); /* §8.1: answered; the rest cannot come */
    } else if (sid > h->last_id) {
        fail(h, PROTOCOL_ERROR); /* §5.1: DATA on an idle stream */
    } else if (was_reset(h, sid)) {
        spend(h); /* §5.1 "closed": sent before our RST_STREAM arrived, ignored */
    } else {
        fail(h, STREAM_CLOSED); /* §5.1, §6.1: the client ended or reset it */
    }
}

static void apply_setting(struct h2 *h, const uint8_t *e)
{
    uint32_t key = (uint32_t)e[0] << 8 | e[1], value = be32(e + 2);
    if (key == 2 && value > 1) {
        fail(h, PROTOCOL_ERROR); /* ENABLE_PUSH */
    } else if (key == 4) { /* INITIAL_WINDOW_SIZE: a delta for open streams (§6.9.2) */
        if (value > H2_WINDOW_MAX) {
            fail(h, FLOW_CONTROL_ERROR);
            return;
        }
        int64_t delta = (int64_t)value - h->initial;
        h->initial = value;
        if (h->cur_sid && (h->cur_window += delta) > H2_WINDOW_MAX)
            fail(h, FLOW_CONTROL_ERROR);
        for (uint32_t i = 0; i < h->n_slots && !h->dead; i++)
            if ((h->slots[i].window += delta) > H2_WINDOW_MAX)
                fail(h, FLOW_CONTROL_ERROR);
        for (uint32_t off = 0; off < h->q_len;) {
            struct qhead *q = (struct qhead *)(h->queue + off);
            if ((q->window += delta) > H2_WINDOW_MAX) {
                fail(h, FLOW_CONTROL_ERROR); /* the queue is gone with it */
                break;
            }
            off += QSIZE(q);
        }
        for (uint8_t i = 0; i < h->n_open && !h->dead; i++) /* answered, still open */
            if (h->remote_open[i].answered && (h->remote_open[i].send += delta) > H2_WINDOW_MAX)
                fail(h, FLOW_CONTROL_ERROR);
    } else if (key == 5) {
        if (value < H2_FRAME_MAX || value > (1u << 24) - 1)
            fail(h, PROTOCOL_ERROR);
        else
            h->max_frame = value;
    } else if (key == 1 && value < TABLE_CAP && !h->table_zero) { /* HEADER_TABLE_SIZE */
        h->table_owed = 1;
    } /* the rest are advisory */
}

static void window_update(struct h2 *h)
{
    uint32_t sid = h->fsid, inc = be32(h->small) & 0x7fffffffu;
    if (!sid) {
        if (!inc) {
            fail(h, PROTOCOL_ERROR); /* §6.9 */
        } else if ((h->window += inc) > H2_WINDOW_MAX) {
            fail(h, FLOW_CONTROL_ERROR);
        }
        return;
    }
    struct slot *sl = slot_of(h, sid);
    struct qhead *q = sl || h->cur_sid == sid ? NULL : queued(h, sid);
    int64_t *window = sl ? &sl->window : q ? &q->window : h->cur_sid == sid ? &h->cur_window : NULL;
    struct body *b = window ? NULL : open_of(h, sid);
    if (b && b->answered) /* answered, the request still open: it counts (§6.9) */
        window = &b->send;
    if (window) {
        if (!inc)
            reset(h, sid, PROTOCOL_ERROR);
        else if (*window + (int64_t)inc > H2_WINDOW_MAX)
            reset(h, sid, FLOW_CONTROL_ERROR);
        else
            *window += inc;
    } else if (sid > h->last_id) {
        fail(h, PROTOCOL_ERROR); /* an idle stream */
    }
}

static void frame_expect(struct h2 *h);

/* The frame's header is in: checks that need no payload, and what to keep of it. */
static void frame_start(struct h2 *h)
{
    h->flen = (uint32_t)h->fh[0] << 16 | (uint32_t)h->fh[1] << 8 | h->fh[2];
    h->ftype = h->fh[3], h->fflags = h->fh[4];
    h->fsid = be32(h->fh + 5) & 0x7fffffffu;
    h->fpos = 0;
    h->set_len = 0;
    h->self_dep = 0;
    if (h->flen > H2_FRAME_MAX)
        fail(h, FRAME_SIZE_ERROR); /* §4.2 */
    else if (!h->settings_seen && h->ftype != SETTINGS)
        fail(h, PROTOCOL_ERROR); /* §3.4: the preface ends with SETTINGS */
    else if (h->in_block && (h->ftype != CONTINUATION || h->fsid != h->block_sid))
        fail(h, PROTOCOL_ERROR); /* §6.10: nothing may interleave a header block */
    else
        frame_expect(h);
}

/* Per type: the checks on the header alone, and `pre`, the payload bytes kept. */
static void frame_expect(struct h2 *h)
{
    switch (h->ftype) {
    case DATA:
        if ((h->recv_window -= h->flen) < 0) /* padding counts too (§6.9.1) */
            fail(h, FLOW_CONTROL_ERROR);
        h->pre = h->fflags & F_PADDED ? 1 : 0;
        break;
    case HEADERS:
        h->block_len = 0;
        h->pre = (uint8_t)((h->fflags & F_PADDED ? 1 : 0) + (h->fflags & F_PRIORITY ? 5 : 0));
        h->frag_end = h->flen;
        if (h->flen < h->pre)
            fail(h, h->fflags & F_PADDED && !h->flen ? PROTOCOL_ERROR : FRAME_SIZE_ERROR);
        break;
    case CONTINUATION:
        if (!h->in_block)
            fail(h, PROTOCOL_ERROR); /* §6.10: only after HEADERS */
        h->pre = 0;
        h->frag_end = h->flen;
        break;
    case SETTINGS:
        if (h->fsid)
            fail(h, PROTOCOL_ERROR);
        else if ((h->fflags & F_ACK) ? h->flen != 0 : h->flen % 6 != 0)
            fail(h, FRAME_SIZE_ERROR);
        else if (!(h->fflags & F_ACK) && h->settings_seen)
            spend(h);
        h->pre = 0;
        break;
    case PING:
        if (h->fsid)
            fail(h, PROTOCOL_ERROR);
        else if (h->flen != 8)
            fail(h, FRAME_SIZE_ERROR);
        h->pre = 8;
        break;
    case RST_STREAM:
        if (!h->fsid || h->fsid > h->last_id)
            fail(h, PROTOCOL_ERROR); /* §6.4: not on idle streams */
        else if (h->flen != 4)
            fail(h, FRAME_SIZE_ERROR);
        h->pre = 4;
        break;
    case WINDOW_UPDATE:
        if (h->flen != 4)
            fail(h, FRAME_SIZE_ERROR);
        h->pre = 4;
        break;
    case PRIORITY:
        if (!h->fsid)
            fail(h, PROTOCOL_ERROR);
        h->pre = h->flen == 5 ? 5 : 0;
        break;
    case PUSH_PROMISE:
        fail(h, PROTOCOL_ERROR); /* §8.4: a client cannot push */
        break;
    case GOAWAY:
        if (h->fsid)
            fail(h, PROTOCOL_ERROR);
        h->pre = 0;
        break;
    default:
        h->pre = 0; /* §5.5: unknown types are ignored (and budgeted) */
    }
}

/* Payload bytes [fpos, fpos + n) of the frame being read. */
static void frame_bytes(struct h2 *h, const uint8_t *p, uint32_t n)
{
    uint32_t pos = h->fpos;
    while (pos < h->pre && n) { /* the first bytes a frame's handling needs */
        h->small[pos++] = *p++;
        n--;
        if (pos == h->pre && h->ftype == HEADERS) {
            uint32_t pad = h->fflags & F_PADDED ? h->small[0] : 0;
            if (pad >= h->flen || h->flen - pad < h->pre) {
                fail(h, pad >= h->flen ? PROTOCOL_ERROR : FRAME_SIZE_ERROR);
                return;
            }
            h->frag_end = h->flen - pad;
            if (h->fflags & F_PRIORITY)
                h->self_dep = (be32(h->small + (h->fflags & F_PADDED ? 1 : 0)) & 0x7fffffffu) == h->fsid;
        }
    }
    if (h->ftype == HEADERS || h->ftype == CONTINUATION) {
        uint32_t k = pos < h->frag_end ? h->frag_end - pos : 0;
        if (k > n)
            k = n;
        if (h->block_len + k > 2 * core_limits.head) {
            fail(h, ENHANCE_YOUR_CALM); /* CONTINUATION flood (CVE-2024-27316) */
            return;
        }
        if (h->block_len + k > h->block_cap &&
            !grow(&h->block, &h->block_cap, h->block_len, BLOCK_CAP)) {
            fail(h, INTERNAL_ERROR); /* no memory for a long header block */
            return;
        }
        memcpy(h->block + h->block_len, p, k);
        h->block_len += k;
    } else if (h->ftype == SETTINGS && !(h->fflags & F_ACK)) {
        for (uint32_t i = 0; i < n && !h->dead; i++) {
            h->set[h->set_len++] = p[i];
            if (h->set_len == 6) {
                apply_setting(h, h->set);
                h->set_len = 0;
            }
        }
    }
}

/* The whole frame is in: its handling (h2.py's handlers). */
static void frame_end(struct h2 *h, uint64_t now)
{
    switch (h->ftype) {
    case DATA:
        data_frame(h);
        break;
    case HEADERS:
        headers_frame(h, now);
        break;
    case CONTINUATION:
        if (++h->block_frames > H2_BLOCK_FRAMES) {
            fail(h, ENHANCE_YOUR_CALM);
        } else if (h->fflags & F_END_HEADERS) {
            end_headers(h, now);
        } else if (!h->flen) {
            spend(h);
        }
        break;
    case SETTINGS:
        if (!(h->fflags & F_ACK)) {
            h->settings_seen = 1;
            if (!h->dead)
                ctrl(h, SETTINGS, F_ACK, 0, NULL, 0);
        }
        break;
    case PING:
        if (!(h->fflags & F_ACK) && spend(h))
            ctrl(h, PING, F_ACK, 0, h->small, 8);
        break;
    case RST_STREAM:
        if (spend(h)) { /* rapid reset (CVE-2023-44487) runs out of budget here */
            close_remote(h, h->fsid);
            struct qhead *q = queued(h, h->fsid);
            if (q)
                unqueue(h, q);
            struct slot *sl = slot_of(h, h->fsid);
            if (sl)
                drop_slot(h, sl);
            if (h->cur_sid == h->fsid)
                h->cur_sid = 0, h->cur_state = R_NONE;
        }
        break;
    case WINDOW_UPDATE:
        window_update(h);
        break;
    case PRIORITY:
        if (!spend(h))
            break;
        if (h->flen != 5)
            reset(h, h->fsid, FRAME_SIZE_ERROR); /* §6.3: a stream error */
        else if ((be32(h->small) & 0x7fffffffu) == h->fsid)
            reset(h, h->fsid, PROTOCOL_ERROR);
        break;
    case GOAWAY:
        h->closing = 1; /* the peer starts no more streams; ours finish, then we close */
        break;
    default:
        spend(h);
    }
}

size_t h2_take(struct h2 *h, const uint8_t *p, size_t n, uint64_t now)
{
    size_t i = 0;
    while (h->preface < sizeof preface && i < n) {
        if (p[i++] != preface[h->preface++]) {
            fail(h, PROTOCOL_ERROR); /* §3.4: not HTTP/2 after all */
            return n;
        }
    }
    while (i < n) {
        if (h->dead)
            return n; /* nothing more is parsed: discarded until the peer's EOF */
        if (h->fh_len < 9) {
            if (h->fh_len == 0 && h->ctrl_len > CTRL_CAP - CTRL_ROOM)
                break; /* control frames wait to be written: no more input until then */
            h->fh[h->fh_len++] = p[i++];
            if (h->fh_len == 9) {
                frame_start(h);
                if (!h->dead && h->flen == 0) {
                    frame_end(h, now);
                    h->fh_len = 0;
                }
            }
            continue;
        }
        uint32_t k = h->flen - h->fpos;
        if (k > n - i)
            k = (uint32_t)(n - i);
        frame_bytes(h, p + i, k);
        i += k;
        h->fpos += k;
        if (h->fpos == h->flen && !h->dead) {
            frame_end(h, now);
            h->fh_len = 0;
        }
    }
    return i;
}

/* -- responses: the core's HTTP/1.1 response as frames ------------------------------- */

static uint32_t enc_int(uint8_t *o, uint32_t v, int prefix, uint8_t flags)
{
    uint32_t max = (1u << prefix) - 1, n = 0;
    if (v < max) {
        o[n++] = (uint8_t)(flags | v);
        return n;
    }
    o[n++] = (uint8_t)(flags | max);
    for (v -= max; v >= 0x80; v >>= 7)
        o[n++] = (uint8_t)(0x80 | (v & 0x7f));
    o[n++] = (uint8_t)v;
    return n;
}

static uint32_t enc_string(uint8_t *o, const uint8_t *s, uint32_t n)
{
    uint32_t k = enc_int(o, n, 7, 0);
    memcpy(o + k, s, n);
    return k + n;
}

/* One field: a static index, a literal without indexing on a static name, or one
 * with a literal name (RFC 7541 §6.1, §6.2.2), as hpack_blocks.field (no Huffman). */
static uint32_t enc_field(uint8_t *o, const uint8_t *name, uint32_t nlen, const uint8_t *value,
                          uint32_t vlen)
{
    uint32_t named = 0;
    for (uint32_t i = 0; i < H2_STATIC_N; i++) {
        const struct h2_static *s = &h2_static[i];
        if (s->nlen != nlen || memcmp(s->name, name, nlen))
            continue;
        if (s->vlen == vlen && memcmp(s->value, value, vlen) == 0)
            return enc_int(o, i + 1, 7, 0x80);
        if (!named)
            named = i + 1;
    }
    uint32_t k = named ? enc_int(o, named, 4, 0) : (o[0] = 0, 1 + enc_string(o + 1, name, nlen));
    return k + enc_string(o + k, value, vlen);
}

/* The response head (up to its empty line) gathered into resp_buf; the body's
 * start in the core's segments. Returns the head's length, or -1. */
static long gather_head(struct h2 *h)
{
    struct core_resp *r = &h->core->resp;
    uint32_t n = 0;
    for (uint8_t i = 0; i < r->n; i++) {
        const struct core_seg *s = &r->seg[i];
        for (uint32_t j = 0; j < s->len; j++) {
            if (n == sizeof resp_buf)
                return -1;
            resp_buf[n++] = s->p[j];
            if (n >= 4 && memcmp(resp_buf + n - 4, "\r\n\r\n", 4) == 0) {
                h->bseg = i, h->boff = j + 1;
                if (h->boff == s->len)
                    h->bseg++, h->boff = 0;
                return n - 4;
            }
        }
    }
    return -1;
}

static uint64_t body_left(struct h2 *h)
{
    struct core_resp *r = &h->core->resp;
    uint64_t left = 0;
    for (uint8_t i = h->bseg; i < r->n; i++)
        left += r->seg[i].len - (i == h->bseg ? h->boff : 0);
    return left;
}

static void add_seg(struct h2 *h, const uint8_t *p, uint32_t len)
{
    ASSERT(h->out.n < CORE_SEGS);
    h->out.seg[h->out.n].p = p;
    h->out.seg[h->out.n].len = len;
    h->out.seg[h->out.n].copy = 1;
    h->out.n++;
}

/* The header block of the head in resp_buf (status line, field lines), written at
 * obuf + o: its end, or 0 when it does not fit. When the core planned a head the
 * image stores (its first core_resp.h2_head bytes), the build's block of it
 * (core_resp.h2) and then the lines after it (the Date and Connection tail); else
 * the whole head converted here: names lowercased, connection fields dropped
 * (hpack_blocks.block). */
static uint32_t encode_head(struct h2 *h, long head, uint32_t o)
{
    uint8_t *b = h->obuf;
    const struct core_resp *r = &h->core->resp;
    long at = 0;
    if (r->h2_len && r->h2_head <= (uint64_t)head + 2) {
        if (o + r->h2_len > OBUF_CAP)
            return 0;
        memcpy(b + o, r->h2, r->h2_len);
        o += r->h2_len;
        at = r->h2_head; /* the stored head ends with its last line's CRLF */
    } else {
        o += enc_field(b + o, (const uint8_t *)":status", 7, resp_buf + 9, 3);
    }
    while (at < head) {
        const uint8_t *line = resp_buf + at, *eol = resp_buf + head;
        for (const uint8_t *q = line; q + 1 < resp_buf + head; q++)
            if (q[0] == '\r' && q[1] == '\n') {
                eol = q;
                break;
            }
        at = eol - resp_buf + 2;
        const uint8_t *colon = line;
        while (colon < eol && *colon != ':')
            colon++;
        if (line == resp_buf || colon == eol)
            continue; /* the status line */
        uint8_t name[256];
        uint32_t nlen = 0;
        for (const uint8_t *q = line; q < colon && nlen < sizeof name; q++)
            if (*q != ' ' && *q != '\t')
                name[nlen++] = (uint8_t)(*q >= 'A' && *q <= 'Z' ? *q + 32 : *q);
        const uint8_t *v = colon + 1, *ve = eol;
        while (v < ve && (*v == ' ' || *v == '\t'))
            v++;
        while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t'))
            ve--;
        if (connection_field(name, nlen, (const uint8_t *)H2_TRAILERS, sizeof H2_TRAILERS - 1))
            continue;
        if (o + 16 + nlen + (uint32_t)(ve - v) > OBUF_CAP)
            return 0;
        o += enc_field(b + o, name, nlen, v, (uint32_t)(ve - v));
    }
    return o;
}

/* The batch buffer is smaller than the smallest frame a peer may allow (§4.2), so a
 * response's header block is always one HEADERS frame, never CONTINUATION. */
_Static_assert(OBUF_CAP <= H2_FRAME_MAX, "a header block in one frame");

/* HEADERS for the planned response, into obuf; 0 when it must wait for a batch of
 * its own. A body that is one span of the image goes on from a slot, and the core
 * is free for the next request; any other stays the core's (R_DATA). */
static int emit_headers(struct h2 *h)
{
    long head = gather_head(h);
    struct core_resp *r = &h->core->resp;
    /* The 103 goes in the same batch, just before the 200 (as h2.py writes them). A size
     * update owed (table_owed) is the first byte of the first of them: `lead` in the 200. */
    uint32_t owed = h->table_owed;
    uint32_t early = r->h2_103_len ? 9 + owed + r->h2_103_len : 0;
    uint32_t lead = early ? 0 : owed;
    uint32_t start = h->olen + early + 9, sid = h->cur_sid;
    uint32_t o = head >= 12 && start + lead <= OBUF_CAP ? encode_head(h, head, start + lead) : 0;
    if (!o && early && !h->olen) { /* beyond even an empty batch with it: the 200 alone */
        early = 0;
        lead = owed;
        start = 9;
        o = head >= 12 ? encode_head(h, head, start + lead) : 0;
    }
    if (!o) {
        if (h->olen)
            return 0; /* the batch is partly full: this head goes first in the next */
        reset(h, sid, INTERNAL_ERROR); /* no head, or one beyond the batch buffer */
        return 1;
    }
    uint64_t left = body_left(h);
    if (early) {
        put_frame(h->obuf + h->olen, owed + r->h2_103_len, HEADERS, F_END_HEADERS, sid);
        if (owed)
            h->obuf[h->olen + 9] = 0x20; /* §6.3: the table's size is 0 */
        memcpy(h->obuf + h->olen + 9 + owed, r->h2_103, r->h2_103_len);
    }
    if (lead)
        h->obuf[start] = 0x20; /* §6.3: the table's size is 0 */
    if (owed)
        h->table_owed = 0, h->table_zero = 1;
    put_frame(h->obuf + start - 9, o - start, HEADERS,
              (uint8_t)(F_END_HEADERS | (left ? 0 : F_END_STREAM)), sid);
    add_seg(h, h->obuf + h->olen, o - h->olen);
    h->olen = o;
    if (left && (r->n - h->bseg > 1 || r->seg[h->bseg].copy)) {
        h->cur_state = R_DATA;
        return 1;
    }
    if (left) {
        struct slot *sl = &h->slots[h->n_slots++];
        sl->sid = sid, sl->window = h->cur_window;
        sl->p = r->seg[h->bseg].p + h->boff, sl->len = (uint32_t)left, sl->pos = 0;
    }
    h->cur_sid = 0;
    h->cur_state = R_NONE;
    if (!left)
        ended(h, sid, h->cur_window);
    return 1;
}

/* The size of the next DATA frame of a stream with `left` bytes and `window`. */
static uint32_t frame_size(const struct h2 *h, uint64_t left, int64_t window)
{
    if (window <= 0 || h->window <= 0)
        return 0; /* a window a SETTINGS delta made negative stays shut until it is positive */
    uint64_t n = left;
    if (n > (uint64_t)h->window)
        n = (uint64_t)h->window;
    if (n > (uint64_t)window)
        n = (uint64_t)window;
    if (n > h->max_frame)
        n = h->max_frame;
    return (uint32_t)n;
}

static void put_data_header(struct h2 *h, uint32_t n, int end, uint32_t sid)
{
    put_frame(h->obuf + h->olen, n, DATA, end ? F_END_STREAM : 0, sid);
    add_seg(h, h->obuf + h->olen, 9);
    h->olen += 9;
    h->window -= n;
}

/* One DATA frame of the core's response (R_DATA): its payload spans the core's pieces. */
static uint32_t core_frame(struct h2 *h)
{
    struct core_resp *r = &h->core->resp;
    uint64_t left = body_left(h);
    uint32_t n = frame_size(h, left, h->cur_window);
    if (!n || h->out.n + 1 + (r->n - h->bseg) > CORE_SEGS)
        return 0;
    uint32_t sid = h->cur_sid;
    put_data_header(h, n, n == left, sid);
    for (uint32_t k = n; k;) {
        const struct core_seg *s = &r->seg[h->bseg];
        uint32_t take = s->len - h->boff < k ? s->len - h->boff : k;
        add_seg(h, s->p + h->boff, take);
        k -= take;
        if ((h->boff += take) == s->len)
            h->bseg++, h->boff = 0;
    }
    h->cur_window -= n;
    if (n == left) {
        h->cur_sid = 0;
        h->cur_state = R_NONE;
        ended(h, sid, h->cur_window);
    }
    return n;
}

/* One DATA frame of a slot's response; the slot is freed with its last. */
static uint32_t slot_frame(struct h2 *h, struct slot *sl)
{
    uint32_t n = frame_size(h, sl->len - sl->pos, sl->window);
    if (!n || h->out.n + 2 > CORE_SEGS)
        return 0;
    uint32_t sid = sl->sid;
    int end = sl->pos + n == sl->len;
    put_data_header(h, n, end, sid);
    add_seg(h, sl->p + sl->pos, n);
    sl->pos += n;
    sl->window -= n;
    if (end) {
        int64_t window = sl->window;
        drop_slot(h, sl);
        ended(h, sid, window);
    }
    return n;
}

/* DATA within both windows, the peer's frame size and this batch's room: a frame per
 * stream per round, round robin from a point that moves each batch (h2.py's ready
 * queue). */
static void emit_data(struct h2 *h)
{
    uint64_t batch = 0;
    int moved = 1;
    h->rr++;
    while (moved && h->window > 0 && batch < OUT_HIGH && h->olen + 9 <= OBUF_CAP) {
        moved = 0;
        if (h->cur_state == R_DATA) {
            uint32_t n = core_frame(h);
            batch += n, moved |= n > 0;
        }
        for (uint32_t k = h->n_slots; k-- > 0 && h->window > 0 && h->olen + 9 <= OBUF_CAP;) {
            uint32_t n = slot_frame(h, &h->slots[(h->rr + k) % h->n_slots]);
            batch += n, moved |= n > 0;
            if (!h->n_slots)
                break;
        }
    }
}

/* The next queued request: planned by the core, which is fresh for each. */
static void start_next(struct h2 *h, uint64_t now)
{
    struct qhead *q = (struct qhead *)h->queue;
    struct core_conn *c = h->core;
    core_connect(c, now, h->open); /* over the connection limit: a 503 */
    if (!c->resp.n) {
        if (q->whole) {
            core_take(c, (const uint8_t *)(q + 1), q->len);
            core_take(c, (const uint8_t *)"\r\n\r\n", 4);
        } else { /* over the head limit: a stand-in the core answers 431 */
            uint32_t n = (uint32_t)(core_limits.head + 4);
            memset(head_buf, 'x', n);
            memcpy(head_buf, "GET / HTTP/1.1\r\nx-long: ", 24);
            core_take(c, head_buf, n);
        }
        if (!core_next(c, now)) {
            core_eof(c);
            core_next(c, now);
        }
        planned++;
    }
    h->cur_sid = q->sid;
    h->cur_window = q->window;
    h->cur_state = c->resp.n ? R_HEADERS : R_NONE;
    unqueue(h, q);
    if (h->open > core_limits.connections)
        go_away(h, NO_ERROR); /* refused: 503 per stream, then away (h2.py) */
    if (h->cur_state == R_NONE) {
        reset(h, h->cur_sid, INTERNAL_ERROR);
    }
}

static void emit_ctrl(struct h2 *h)
{
    memcpy(h->obuf + h->olen, h->ctrl, h->ctrl_len);
    add_seg(h, h->obuf + h->olen, h->ctrl_len);
    h->olen += h->ctrl_len;
    h->ctrl_len = 0;
}

/* A batch: a head that waited first, then control frames, the heads of as many
 * queued requests as fit (each planned by the core in turn), then DATA. */
struct core_resp *h2_output(struct h2 *h, uint64_t now)
{
    if (h->out.n)
        return &h->out;
    h->olen = 0;
    if (h->cur_state == R_HEADERS)
        emit_headers(h);
    if (h->ctrl_len)
        emit_ctrl(h);
    while (!h->dead && !h->cur_sid && h->q_n && h->out.n + 1 < CORE_SEGS) {
        start_next(h, now);
        if (h->cur_state == R_HEADERS && !emit_headers(h))
            break;
    }
    emit_data(h);
    if (h->ctrl_len && h->olen + h->ctrl_len <= OBUF_CAP) { /* a reset made meanwhile */
        emit_ctrl(h);
    }
    return h->out.n ? &h->out : NULL;
}

void h2_written(struct h2 *h, uint64_t now)
{
    h->out.n = 0;
    h->olen = 0;
    h->since = now;
}

void h2_init(struct h2 *h, struct core_conn *core, uint64_t now, uint32_t open)
{
    memset(h, 0, offsetof(struct h2, table)); /* the buffers need no clearing */
    h->core = core;
    h->since = h->refilled = now;
    h->open = open;
    h->calm = H2_CALM_MAX;
    h->window = h->initial = h->recv_window = H2_WINDOW;
    h->max_frame = H2_FRAME_MAX;
    h->table_max = TABLE_CAP;
    h->q_len = h->q_n = h->ctrl_len = h->olen = 0;
    h->n_slots = h->rr = 0;
    h->queue = h->queue_small, h->q_cap = QUEUE_SMALL;
    h->block = h->block_small, h->block_cap = BLOCK_SMALL;
    h->out.n = 0;
    uint8_t s[12] = { 0, 3, 0, 0, 0, H2_MAX_STREAMS, 0, 6 }; /* MAX_CONCURRENT_STREAMS, MAX_HEADER_LIST_SIZE */
    uint32_t head = (uint32_t)core_limits.head;
    s[8] = (uint8_t)(head >> 24), s[9] = (uint8_t)(head >> 16), s[10] = (uint8_t)(head >> 8), s[11] = (uint8_t)head;
    ctrl(h, SETTINGS, 0, 0, s, sizeof s);
}

void h2_free(struct h2 *h)
{
    block_small(h);
    queue_small(h);
}

void h2_eof(struct h2 *h)
{
    h->eof = 1;
}

void h2_stop(struct h2 *h)
{
    if (!h->closing)
        go_away(h, NO_ERROR);
}

/* Whether a response could send DATA now (both windows open). */
static int can_send(const struct h2 *h)
{
    if (h->window <= 0)
        return 0;
    if (h->cur_state == R_DATA && h->cur_window > 0)
        return 1;
    for (uint32_t i = 0; i < h->n_slots; i++)
        if (h->slots[i].window > 0)
            return 1;
    return 0;
}

/* After the peer's EOF, once the queued requests are answered, what remains can never
 * move: a response waiting for window (no WINDOW_UPDATE comes after a FIN), an
 * unfinished header block (h2.py's _settle). */
int h2_done(const struct h2 *h)
{
    if (h->ctrl_len || h->out.n)
        return 0;
    return h->dead || ((h->closing || h->eof) && !streams(h) && !h->in_block) ||
           (h->eof && !h->q_n && h->cur_state != R_HEADERS && !can_send(h));
}

int h2_tick(struct h2 *h, uint64_t now, int writing)
{
    uint64_t secs = (now - h->refilled) / 1000;
    if (secs) {
        h->refilled += secs * 1000;
        int64_t calm = h->calm + (int64_t)secs * H2_CALM_PER_SECOND;
        h->calm = (int32_t)(calm > H2_CALM_MAX ? H2_CALM_MAX : calm);
    }
    uint64_t waited = now - h->since;
    if (h->out.n || writing) {
        if (waited > core_limits.send_timeout)
            return 1; /* a reader that takes nothing is dropped */
    } else if (streams(h)) { /* every window is zero and nothing moves (§10.5) */
        if (waited > core_limits.send_timeout)
            fail(h, ENHANCE_YOUR_CALM);
    } else if (h->fh_len || h->in_block) { /* a frame or block that never completes */
        if (waited > core_limits.head_timeout)
            fail(h, ENHANCE_YOUR_CALM);
    } else if (waited > core_limits.idle_timeout && !h->closing) {
        go_away(h, NO_ERROR);
    }
    return 0;
}
