/* HTTP/3 over ngtcp2 and GnuTLS (h3_quic.h says what is here and what the host does). */
#include "h3_quic.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <gnutls/crypto.h>
#include <gnutls/gnutls.h>
#include <nghttp3/nghttp3.h>
#include <ngtcp2/ngtcp2.h>
#include <ngtcp2/ngtcp2_crypto.h>
#include <ngtcp2/ngtcp2_crypto_gnutls.h>

/* RFC 9114 §8.1, RFC 9204 §6 */
enum {
    H3_NO_ERROR = 0x100, H3_GENERAL_PROTOCOL_ERROR = 0x101, H3_INTERNAL_ERROR = 0x102,
    H3_STREAM_CREATION_ERROR = 0x103, H3_CLOSED_CRITICAL_STREAM = 0x104,
    H3_FRAME_UNEXPECTED = 0x105, H3_FRAME_ERROR = 0x106, H3_EXCESSIVE_LOAD = 0x107,
    H3_SETTINGS_ERROR = 0x109, H3_MISSING_SETTINGS = 0x10a, H3_REQUEST_CANCELLED = 0x10c,
    H3_REQUEST_INCOMPLETE = 0x10d, H3_MESSAGE_ERROR = 0x10e,
    QPACK_DECOMPRESSION_FAILED = 0x200, QPACK_ENCODER_STREAM_ERROR = 0x201,
};
/* Frame and unidirectional stream types (RFC 9114 §7.2, §6.2; RFC 9204 §4.2). */
enum { F_DATA = 0x0, F_HEADERS = 0x1, F_SETTINGS = 0x4, F_GOAWAY = 0x7 };
enum { U_CONTROL = 0x0, U_PUSH = 0x1, U_ENCODER = 0x2, U_DECODER = 0x3, U_UNKNOWN = 0xff };

/* TLS 1.3 only, QUIC's cipher suites (RFC 9001 §5.3), no middlebox compatibility mode
 * (§8.4). */
static const char PRIORITY[] =
    "%DISABLE_TLS13_COMPAT_MODE:NORMAL:-VERS-ALL:+VERS-TLS1.3:-CIPHER-ALL:+AES-128-GCM:"
    "+AES-256-GCM:+CHACHA20-POLY1305:+AES-128-CCM:-GROUP-ALL:+GROUP-X25519:"
    "+GROUP-SECP256R1:+GROUP-SECP384R1:+GROUP-SECP521R1";

/* One certificate: its credentials, and the key its session tickets are sealed with. */
typedef struct {
    gnutls_certificate_credentials_t cred;
    uint8_t ticket_key[64];
    gnutls_datum_t ticket;
} credential;

struct h3q_server {
    h3q_calls calls;
    void *host;
    h3q_limits limits;
    credential *creds;
    size_t ncreds;
    int tickets;              /* session tickets and 0-RTT */
    gnutls_anti_replay_t anti_replay;
    gnutls_priority_t priority;
    uint8_t reset_secret[32]; /* stateless reset tokens */
    uint8_t retry_secret[32]; /* Retry tokens: this worker's (its tag routes them back) */
};

/* A frame being read from a stream: its header, then its payload (kept only for the
 * frames parsed whole), or a count of payload bytes to skip. */
typedef struct {
    uint8_t head[16];
    size_t headlen;
    int in_frame;
    uint64_t type, len, got, skip;
    uint8_t *pay;
    size_t cap;
} reader;

typedef struct stream {
    int64_t id;
    struct stream *next;  /* in the connection's send queue */
    struct stream *all_prev, *all_next; /* every stream of the connection (h3q_conn_del) */
    int queued, blocked;
    int uni;              /* a client's unidirectional stream: its type (U_*) */
    int headers;          /* request: HEADERS frames seen */
    int answered;
    reader rd;
    /* what is sent: frames (owned), then the body (the owner's) */
    uint8_t *frames;
    size_t frameslen;
    const uint8_t *body;
    size_t bodylen;
    void *owner;
    uint64_t off;          /* bytes given to ngtcp2 */
    int fin;               /* the answer ends the stream */
    nghttp3_qpack_stream_context *sctx;
} stream;

struct h3q_conn {
    h3q_server *s;
    void *host;
    ngtcp2_conn *conn;
    ngtcp2_crypto_conn_ref ref;
    gnutls_session_t tls;
    nghttp3_qpack_decoder *qpack;
    stream *sendq, *sendq_tail;
    stream *all;            /* every stream of the client's (new_stream) */
    stream *current;        /* the stream whose request the host is answering */
    stream ctrl, enc, dec;  /* ours (unidirectional) */
    uint8_t ctrl_bytes[32];
    uint8_t enc_byte, dec_byte;
    int64_t peer_ctrl;      /* the client's control stream, or -1 */
    int settings_seen;
    int opened;             /* our unidirectional streams opened */
    int state;
    int goaway;
    int64_t last_sid;       /* the highest request stream taken */
    size_t open_requests;
    ngtcp2_ccerr ccerr;
    int close_pending;      /* a CONNECTION_CLOSE to write */
    uint8_t *closebuf;      /* and once written, resent to what still comes */
    size_t closelen;
    uint64_t close_until;
    ngtcp2_path_storage path;
    char sni[256];
};

static int bidi(int64_t sid) { return !(sid & 0x2); }

/* -- small helpers -------------------------------------------------------------- */

/* A QUIC variable-length integer (RFC 9000 §16) at p: its length, or 0 if cut short. */
static size_t vint(const uint8_t *p, size_t len, uint64_t *v) {
    if (len == 0) return 0;
    size_t n = (size_t)1 << (p[0] >> 6);
    if (len < n) return 0;
    uint64_t x = p[0] & 0x3f;
    for (size_t i = 1; i < n; i++) x = (x << 8) | p[i];
    *v = x;
    return n;
}

static size_t put_vint(uint8_t *p, uint64_t v) {
    if (v < 64) { p[0] = (uint8_t)v; return 1; }
    if (v < 16384) { p[0] = 0x40 | (uint8_t)(v >> 8); p[1] = (uint8_t)v; return 2; }
    if (v < (1u << 30)) {
        p[0] = 0x80 | (uint8_t)(v >> 24); p[1] = (uint8_t)(v >> 16);
        p[2] = (uint8_t)(v >> 8); p[3] = (uint8_t)v; return 4;
    }
    p[0] = 0xc0 | (uint8_t)(v >> 56);
    for (int i = 1; i < 8; i++) p[i] = (uint8_t)(v >> (56 - 8 * i));
    return 8;
}

static void rand_bytes(uint8_t *dest, size_t len) {
    if (gnutls_rnd(GNUTLS_RND_RANDOM, dest, len) != 0) abort(); /* no randomness: no QUIC */
}

static void conn_error(h3q_conn *c, uint64_t code) {
    if (c->state >= H3Q_CLOSING || c->close_pending) return;
    ngtcp2_ccerr_set_application_error(&c->ccerr, code, NULL, 0);
    c->close_pending = 1;
}

static stream *new_stream(h3q_conn *c, int64_t sid) {
    stream *st = calloc(1, sizeof(*st));
    if (st == NULL) return NULL;
    st->id = sid;
    st->uni = -1;
    if (ngtcp2_conn_set_stream_user_data(c->conn, sid, st) != 0) {
        free(st);
        return NULL;
    }
    st->all_next = c->all;
    if (c->all) c->all->all_prev = st;
    c->all = st;
    return st;
}

static stream *find(h3q_conn *c, int64_t sid) {
    if (c->current && c->current->id == sid) return c->current;
    for (stream *st = c->all; st; st = st->all_next)
        if (st->id == sid) return st;
    return NULL;
}

static void free_stream(h3q_conn *c, stream *st) {
    if (st->all_prev) st->all_prev->all_next = st->all_next; else c->all = st->all_next;
    if (st->all_next) st->all_next->all_prev = st->all_prev;
    if (c->current == st) c->current = NULL;
    if (st->owner != NULL) c->s->calls.release(c->s->host, st->owner);
    if (st->sctx != NULL) nghttp3_qpack_stream_context_del(st->sctx);
    free(st->frames);
    free(st->rd.pay);
    free(st);
}

static void enqueue(h3q_conn *c, stream *st) {
    if (st->queued || st->blocked) return;
    st->queued = 1;
    st->next = NULL;
    if (c->sendq_tail) c->sendq_tail->next = st; else c->sendq = st;
    c->sendq_tail = st;
}

static void dequeue_head(h3q_conn *c) {
    stream *st = c->sendq;
    c->sendq = st->next;
    if (c->sendq == NULL) c->sendq_tail = NULL;
    st->queued = 0;
    st->next = NULL;
}

static void unqueue(h3q_conn *c, stream *st) {
    if (!st->queued) return;
    stream **p = &c->sendq, *prev = NULL;
    while (*p && *p != st) { prev = *p; p = &(*p)->next; }
    if (*p) {
        *p = st->next;
        if (c->sendq_tail == st) c->sendq_tail = prev;
    }
    st->queued = 0;
    st->next = NULL;
}

static uint64_t pending_bytes(const stream *st) {
    return st->frameslen + st->bodylen - st->off;
}

/* -- our streams: control (SETTINGS, later GOAWAY), QPACK encoder and decoder ------------ */

static int open_uni(h3q_conn *c, stream *st, const uint8_t *data, size_t len) {
    int64_t sid;
    if (ngtcp2_conn_open_uni_stream(c->conn, &sid, st) != 0) return -1;
    st->id = sid;
    st->frames = NULL;
    st->body = data;
    st->bodylen = len;
    enqueue(c, st);
    return 0;
}

static int open_ours(h3q_conn *c) {
    if (c->opened) return 0;
    /* A SETTINGS frame with no setting: a field section holds no dynamic table
     * reference (QPACK_MAX_TABLE_CAPACITY 0, the default) and none is blocked. */
    uint8_t *p = c->ctrl_bytes;
    p[0] = U_CONTROL;
    p[1] = F_SETTINGS;
    p[2] = 0;
    c->enc_byte = U_ENCODER;
    c->dec_byte = U_DECODER;
    if (open_uni(c, &c->ctrl, c->ctrl_bytes, 3) || open_uni(c, &c->enc, &c->enc_byte, 1)
        || open_uni(c, &c->dec, &c->dec_byte, 1))
        return -1;
    c->opened = 1;
    return 0;
}

/* -- reading streams ----------------------------------------------------------------- */

/* Feed bytes to a frame reader. Returns bytes used; *done is set when a frame's header
 * (want_payload 0: *skip counts its payload) or whole frame (payload kept) is ready. */
typedef int (*frame_fn)(h3q_conn *c, stream *st, uint64_t type, const uint8_t *pay, size_t len);
typedef int (*keep_fn)(uint64_t type);

/* `ended` for the HEADERS frame being handled: its stream's FIN came right after it. */
static int g_ended;

static int read_frames(h3q_conn *c, stream *st, const uint8_t *data, size_t len, int fin,
                       keep_fn keep, frame_fn on_frame) {
    reader *r = &st->rd;
    while (len > 0) {
        if (c->close_pending || c->state >= H3Q_CLOSING) return 0;
        if (r->skip) {
            size_t n = len < r->skip ? len : (size_t)r->skip;
            r->skip -= n;
            data += n;
            len -= n;
            continue;
        }
        if (!r->in_frame) {
            while (len > 0 && r->headlen < sizeof(r->head)) {
                r->head[r->headlen++] = *data++;
                len--;
                uint64_t type, flen;
                size_t a = vint(r->head, r->headlen, &type);
                size_t b = a ? vint(r->head + a, r->headlen - a, &flen) : 0;
                if (a && b) {
                    r->headlen = 0;
                    r->type = type;
                    r->len = flen;
                    r->got = 0;
                    if (!keep(type)) {
                        int rv = on_frame(c, st, type, NULL, 0);
                        if (rv) return rv;
                        r->skip = flen;
                    } else {
                        if (flen > c->s->limits.max_section) {
                            conn_error(c, H3_EXCESSIVE_LOAD);
                            return -1;
                        }
                        r->in_frame = 1;
                        if (flen == 0) goto whole;
                    }
                    break;
                }
            }
            continue;
        }
        {
            size_t need = (size_t)(r->len - r->got), n = len < need ? len : need;
            if (r->cap < r->len) {
                uint8_t *p = realloc(r->pay, (size_t)r->len);
                if (p == NULL) { conn_error(c, H3_INTERNAL_ERROR); return -1; }
                r->pay = p;
                r->cap = (size_t)r->len;
            }
            memcpy(r->pay + r->got, data, n);
            r->got += n;
            data += n;
            len -= n;
            if (r->got < r->len) continue;
        }
    whole:
        r->in_frame = 0;
        {
            g_ended = fin && len == 0;
            int rv = on_frame(c, st, r->type, r->pay, (size_t)r->len);
            g_ended = 0;
            if (rv) return rv;
        }
    }
    return 0;
}

static int reserved_h2(uint64_t type) {
    /* HTTP/2's PRIORITY, PING, WINDOW_UPDATE, CONTINUATION (RFC 9114 §7.2.8) */
    return type == 0x2 || type == 0x6 || type == 0x8 || type == 0x9;
}

static int keep_request(uint64_t type) { return type == F_HEADERS; }

static int request_frame(h3q_conn *c, stream *st, uint64_t type, const uint8_t *pay,
                         size_t len);

static int keep_control(uint64_t type) { return type == F_SETTINGS || type == F_GOAWAY; }

static int control_frame(h3q_conn *c, stream *st, uint64_t type, const uint8_t *pay,
                         size_t len) {
    (void)st;
    if (!c->settings_seen) {
        if (type != F_SETTINGS) { conn_error(c, H3_MISSING_SETTINGS); return -1; }
        c->settings_seen = 1;
        /* each setting once; HTTP/2's (0x2-0x5) are errors (RFC 9114 §7.2.4.1) */
        uint64_t seen[32];
        size_t nseen = 0, i = 0;
        while (i < len) {
            uint64_t id, v;
            size_t a = vint(pay + i, len - i, &id);
            size_t b = a ? vint(pay + i + a, len - i - a, &v) : 0;
            if (!a || !b) { conn_error(c, H3_FRAME_ERROR); return -1; }
            i += a + b;
            if (id >= 0x2 && id <= 0x5) { conn_error(c, H3_SETTINGS_ERROR); return -1; }
            for (size_t k = 0; k < nseen; k++)
                if (seen[k] == id) { conn_error(c, H3_SETTINGS_ERROR); return -1; }
            if (nseen < 32) seen[nseen++] = id;
        }
        return 0;
    }
    if (type == F_SETTINGS || type == F_DATA || type == F_HEADERS || type == 0x5
        || reserved_h2(type)) {
        conn_error(c, H3_FRAME_UNEXPECTED);
        return -1;
    }
    return 0; /* GOAWAY, MAX_PUSH_ID, CANCEL_PUSH, unknown: nothing to do for a server */
}

static void request_fields(h3q_conn *c, stream *st, const uint8_t *pay, size_t len, int ended) {
    unsigned flags = (ended ? H3Q_ENDED : 0)
                     | (ngtcp2_conn_get_handshake_completed(c->conn) ? 0 : H3Q_EARLY);
    if (st->sctx == NULL && nghttp3_qpack_stream_context_new(&st->sctx, st->id, nghttp3_mem_default()) != 0) {
        conn_error(c, H3_INTERNAL_ERROR);
        return;
    }
    /* Every field copied into one block, then handed over at once. */
    size_t nfields = 0, capf = 16, used = 0, capb = len * 2 + 256;
    h3q_field *fields = malloc(capf * sizeof(*fields));
    uint8_t *block = malloc(capb);
    size_t *offs = malloc(capf * 4 * sizeof(size_t));
    if (!fields || !block || !offs) goto fail;
    const uint8_t *p = pay;
    size_t left = len;
    for (;;) {
        nghttp3_qpack_nv nv;
        uint8_t flags = 0;
        nghttp3_ssize n = nghttp3_qpack_decoder_read_request(c->qpack, st->sctx, &nv, &flags, p,
                                                             left, 1);
        if (n < 0) {
            conn_error(c, QPACK_DECOMPRESSION_FAILED);
            goto done;
        }
        p += n;
        left -= (size_t)n;
        if (flags & NGHTTP3_QPACK_DECODE_FLAG_EMIT) {
            nghttp3_vec name = nghttp3_rcbuf_get_buf(nv.name);
            nghttp3_vec value = nghttp3_rcbuf_get_buf(nv.value);
            if (nfields == capf) {
                capf *= 2;
                h3q_field *f = realloc(fields, capf * sizeof(*fields));
                size_t *o = realloc(offs, capf * 4 * sizeof(size_t));
                if (f) fields = f;
                if (o) offs = o;
                if (!f || !o) { nghttp3_rcbuf_decref(nv.name); nghttp3_rcbuf_decref(nv.value); goto fail; }
            }
            if (used + name.len + value.len > capb) {
                size_t want = (used + name.len + value.len) * 2;
                uint8_t *b = realloc(block, want);
                if (!b) { nghttp3_rcbuf_decref(nv.name); nghttp3_rcbuf_decref(nv.value); goto fail; }
                block = b;
                capb = want;
            }
            offs[nfields * 4] = used;
            memcpy(block + used, name.base, name.len);
            used += name.len;
            offs[nfields * 4 + 1] = name.len;
            offs[nfields * 4 + 2] = used;
            memcpy(block + used, value.base, value.len);
            used += value.len;
            offs[nfields * 4 + 3] = value.len;
            nfields++;
            nghttp3_rcbuf_decref(nv.name);
            nghttp3_rcbuf_decref(nv.value);
        }
        if (flags & NGHTTP3_QPACK_DECODE_FLAG_FINAL) break;
        if (flags & NGHTTP3_QPACK_DECODE_FLAG_BLOCKED || (n == 0 && !(flags & NGHTTP3_QPACK_DECODE_FLAG_EMIT))) {
            /* no dynamic table was offered: a reference to one is an error (RFC 9204 §2.2.3) */
            conn_error(c, QPACK_DECOMPRESSION_FAILED);
            goto done;
        }
    }
    for (size_t i = 0; i < nfields; i++) {
        fields[i].name = block + offs[i * 4];
        fields[i].namelen = offs[i * 4 + 1];
        fields[i].value = block + offs[i * 4 + 2];
        fields[i].valuelen = offs[i * 4 + 3];
    }
    if (st->id > c->last_sid) c->last_sid = st->id;
    c->current = st;
    c->s->calls.request(c->s->host, c, st->id, pay, len, fields, nfields, flags);
    c->current = NULL;
    goto done;
fail:
    conn_error(c, H3_INTERNAL_ERROR);
done:
    free(fields);
    free(block);
    free(offs);
}

static int request_frame(h3q_conn *c, stream *st, uint64_t type, const uint8_t *pay,
                         size_t len) {
    if (type == F_HEADERS) {
        if (st->headers++ == 0) {
            if (c->goaway && st->id > c->last_sid) {
                /* after our GOAWAY: not taken (RFC 9114 §5.2) */
                h3q_reset(c, st->id, 0x10b /* H3_REQUEST_REJECTED */);
                st->rd.skip = 0;
                return 1;
            }
            request_fields(c, st, pay, len, g_ended);
        }
        return 0; /* trailers: nothing in them changes the answer */
    }
    if (type == F_DATA) {
        if (st->headers == 0) { conn_error(c, H3_FRAME_UNEXPECTED); return -1; }
        return 0; /* a request body is not read: the answer does not depend on it */
    }
    if (type == F_SETTINGS || type == F_GOAWAY || type == 0x3 || type == 0x5 || type == 0xd
        || reserved_h2(type)) {
        conn_error(c, H3_FRAME_UNEXPECTED);
        return -1;
    }
    return 0; /* unknown frame types are skipped (§9) */
}

static int recv_stream_data(ngtcp2_conn *conn, uint32_t flags, int64_t sid, uint64_t offset,
                            const uint8_t *data, size_t len, void *user, void *sud) {
    (void)offset;
    h3q_conn *c = user;
    stream *st = sud;
    int fin = (flags & NGTCP2_STREAM_DATA_FLAG_FIN) != 0;
    if (st == NULL) {
        st = new_stream(c, sid);
        if (st == NULL) return NGTCP2_ERR_CALLBACK_FAILURE;
        if (!bidi(sid)) st->uni = -2; /* type not read yet */
        else c->open_requests++;
    }
    ngtcp2_conn_extend_max_stream_offset(conn, sid, len);
    ngtcp2_conn_extend_max_offset(conn, len);
    if (bidi(sid)) {
        if (st->answered && st->headers) return 0; /* the rest of a request already answered */
        int rv = read_frames(c, st, data, len, fin, keep_request, request_frame);
        if (rv < 0) return 0;
        if (fin && !st->answered && st->headers == 0 && c->state < H3Q_CLOSING
            && !c->close_pending) {
            if (st->rd.in_frame || st->rd.headlen) conn_error(c, H3_FRAME_ERROR);
            else h3q_reset(c, sid, H3_REQUEST_INCOMPLETE);
        }
        return 0;
    }
    /* a unidirectional stream of the client's: its type first (RFC 9114 §6.2) */
    if (st->uni == -2) {
        if (len == 0) return 0;
        st->rd.head[st->rd.headlen++] = *data++;
        len--;
        uint64_t t;
        size_t n = vint(st->rd.head, st->rd.headlen, &t);
        if (!n) {
            /* the rest of the type's bytes come in this chunk or later */
            while (len > 0 && !n) {
                st->rd.head[st->rd.headlen++] = *data++;
                len--;
                n = vint(st->rd.head, st->rd.headlen, &t);
            }
            if (!n) return 0;
        }
        st->rd.headlen = 0;
        if (t == U_CONTROL) {
            if (c->peer_ctrl >= 0) { conn_error(c, H3_STREAM_CREATION_ERROR); return 0; }
            c->peer_ctrl = sid;
            st->uni = U_CONTROL;
        } else if (t == U_ENCODER || t == U_DECODER) {
            st->uni = (int)t;
        } else if (t == U_PUSH) {
            conn_error(c, H3_STREAM_CREATION_ERROR); /* only servers push (§6.2.2) */
            return 0;
        } else {
            st->uni = U_UNKNOWN; /* §6.2.3: not read */
            ngtcp2_conn_shutdown_stream_read(conn, 0, sid, H3_STREAM_CREATION_ERROR);
            return 0;
        }
    }
    if (fin && st->uni != U_UNKNOWN) {
        conn_error(c, H3_CLOSED_CRITICAL_STREAM);
        return 0;
    }
    switch (st->uni) {
    case U_CONTROL:
        read_frames(c, st, data, len, 0, keep_control, control_frame);
        break;
    case U_ENCODER:
        if (len && nghttp3_qpack_decoder_read_encoder(c->qpack, data, len) < 0)
            conn_error(c, QPACK_ENCODER_STREAM_ERROR);
        break;
    default: /* the decoder stream: with no dynamic table of ours there is nothing to learn */
        break;
    }
    return 0;
}

static int stream_close(ngtcp2_conn *conn, uint32_t flags, int64_t sid, uint64_t code,
                        void *user, void *sud) {
    (void)flags;
    (void)code;
    h3q_conn *c = user;
    stream *st = sud;
    if (bidi(sid)) {
        ngtcp2_conn_extend_max_streams_bidi(conn, 1);
    } else if (!(sid & 0x1)) {  /* a client's unidirectional stream */
        ngtcp2_conn_extend_max_streams_uni(conn, 1);
        if (st && (st->uni == U_CONTROL || st->uni == U_ENCODER || st->uni == U_DECODER))
            conn_error(c, H3_CLOSED_CRITICAL_STREAM);
    }
    if (st == NULL || st == &c->ctrl || st == &c->enc || st == &c->dec) return 0;
    unqueue(c, st);
    if (bidi(sid) && c->open_requests) c->open_requests--;
    if (st->sctx) nghttp3_qpack_decoder_cancel_stream(c->qpack, sid);
    free_stream(c, st);
    return 0;
}

static int stream_reset(ngtcp2_conn *conn, int64_t sid, uint64_t final_size, uint64_t code,
                        void *user, void *sud) {
    (void)conn; (void)final_size; (void)code; (void)sud;
    /* the client cancelled the request (§4.1.1): the answer stops too */
    if (bidi(sid)) h3q_reset(user, sid, H3_REQUEST_CANCELLED);
    return 0;
}

static int stream_stop_sending(ngtcp2_conn *conn, int64_t sid, uint64_t code, void *user,
                               void *sud) {
    (void)conn;
    h3q_conn *c = user;
    stream *st = sud;
    if (st && bidi(sid)) {
        unqueue(c, st);
        st->blocked = 1;
        ngtcp2_conn_shutdown_stream_write(c->conn, 0, sid, code);
    }
    return 0;
}

static int extend_max_stream_data(ngtcp2_conn *conn, int64_t sid, uint64_t max, void *user,
                                  void *sud) {
    (void)conn; (void)sid; (void)max;
    stream *st = sud;
    if (st && st->blocked == 2) {
        st->blocked = 0;
        if (pending_bytes(st) || (st->fin && st->off == st->frameslen + st->bodylen))
            enqueue(user, st);
    }
    return 0;
}

static int handshake_completed(ngtcp2_conn *conn, void *user) {
    (void)conn;
    h3q_conn *c = user;
    c->state = H3Q_OPEN;
    /* one ticket, after the handshake (GNUTLS_NO_AUTO_SEND_TICKET): as ngtcp2's server */
    if (c->s->tickets && gnutls_session_ticket_send(c->tls, 1, 0) != 0) { /* none: no resumption */ }
    return open_ours(c) ? NGTCP2_ERR_CALLBACK_FAILURE : 0;
}

/* The client hello's server name (extension 0, RFC 6066 §3: the first host_name), read
 * before GnuTLS parses the hello: it chooses the certificate and the ticket key. */
static int hello_ext(void *ctx, unsigned tls_id, const unsigned char *data, unsigned len) {
    char *name = ctx;
    if (tls_id != 0 || len < 5) return 0;
    unsigned list = (unsigned)data[0] << 8 | data[1];
    if (list + 2 > len || data[2] != 0) return 0;
    unsigned n = (unsigned)data[3] << 8 | data[4];
    if (n + 5 > len || n >= 256 || memchr(data + 5, 0, n)) return 0;
    memcpy(name, data + 5, n);
    name[n] = 0;
    return 0;
}

static int hello_hook(gnutls_session_t tls, unsigned htype, unsigned when, unsigned incoming,
                      const gnutls_datum_t *msg) {
    (void)htype; (void)when; (void)incoming;
    h3q_conn *c = ((ngtcp2_crypto_conn_ref *)gnutls_session_get_ptr(tls))->user_data;
    h3q_server *s = c->s;
    char name[256] = "";
    gnutls_ext_raw_parse(name, hello_ext, msg, GNUTLS_EXT_RAW_FLAG_TLS_CLIENT_HELLO);
    size_t i = s->calls.credential(s->host, name);
    if (i >= s->ncreds) i = 0;
    if (gnutls_credentials_set(tls, GNUTLS_CRD_CERTIFICATE, s->creds[i].cred) != 0)
        return GNUTLS_E_INTERNAL_ERROR;
    if (s->tickets && gnutls_session_ticket_enable_server(tls, &s->creds[i].ticket) != 0)
        return GNUTLS_E_INTERNAL_ERROR;
    return 0;
}

/* Every 0-RTT attempt is new to us: every answer is a static GET or HEAD's (425 for any
 * other method early), so a replay changes nothing (RFC 9001 §9.2, RFC 8470 §5.2). GnuTLS
 * still holds early data to its ticket-age window. */
static int replay_add(void *ptr, time_t expires, const gnutls_datum_t *key,
                      const gnutls_datum_t *data) {
    (void)ptr; (void)expires; (void)key; (void)data;
    return 0;
}

static void rand_cb(uint8_t *dest, size_t len, const ngtcp2_rand_ctx *ctx) {
    (void)ctx;
    rand_bytes(dest, len);
}

static int new_cid(ngtcp2_conn *conn, ngtcp2_cid *cid, uint8_t *token, size_t len, void *user) {
    (void)conn;
    h3q_conn *c = user;
    c->s->calls.cid(c->s->host, c, cid->data, len);
    cid->datalen = len;
    if (ngtcp2_crypto_generate_stateless_reset_token(token, c->s->reset_secret,
                                                     sizeof(c->s->reset_secret), cid) != 0)
        return NGTCP2_ERR_CALLBACK_FAILURE;
    c->s->calls.route(c->s->host, c, cid->data, cid->datalen, 1);
    return 0;
}

static int remove_cid(ngtcp2_conn *conn, const ngtcp2_cid *cid, void *user) {
    (void)conn;
    h3q_conn *c = user;
    c->s->calls.route(c->s->host, c, cid->data, cid->datalen, 0);
    return 0;
}

static ngtcp2_conn *get_conn(ngtcp2_crypto_conn_ref *ref) {
    return ((h3q_conn *)ref->user_data)->conn;
}

/* -- the server ---------------------------------------------------------------------- */

h3q_server *h3q_server_new(const h3q_calls *calls, void *host, const h3q_limits *limits,
                           const h3q_pem *pems, size_t n, const uint8_t *ticket_key,
                           char *err, size_t errlen) {
    h3q_server *s = calloc(1, sizeof(*s));
    if (s == NULL || n == 0 || (s->creds = calloc(n, sizeof(*s->creds))) == NULL) {
        snprintf(err, errlen, n ? "out of memory" : "no certificate");
        h3q_server_del(s);
        return NULL;
    }
    s->calls = *calls;
    s->host = host;
    s->limits = *limits;
    s->tickets = ticket_key != NULL;
    rand_bytes(s->reset_secret, sizeof(s->reset_secret));
    rand_bytes(s->retry_secret, sizeof(s->retry_secret));
    int rv = gnutls_priority_init(&s->priority, PRIORITY, NULL);
    if (rv == 0 && s->tickets) {
        rv = gnutls_anti_replay_init(&s->anti_replay);
        if (rv == 0) gnutls_anti_replay_set_add_function(s->anti_replay, replay_add);
    }
    if (rv != 0) {
        snprintf(err, errlen, "GnuTLS: %s", gnutls_strerror(rv));
        h3q_server_del(s);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        credential *k = &s->creds[i];
        s->ncreds = i + 1;
        rv = gnutls_certificate_allocate_credentials(&k->cred);
        if (rv == 0) {
            const gnutls_datum_t cert = {(unsigned char *)pems[i].cert, (unsigned)pems[i].cert_len};
            const gnutls_datum_t key = {(unsigned char *)pems[i].key, (unsigned)pems[i].key_len};
            rv = gnutls_certificate_set_x509_key_mem2(k->cred, &cert, &key, GNUTLS_X509_FMT_PEM,
                                                      NULL, 0);
        }
        if (rv < 0) {
            snprintf(err, errlen, "certificate %zu: %s", i, gnutls_strerror(rv));
            h3q_server_del(s);
            return NULL;
        }
        if (s->tickets) {  /* HMAC-SHA-512(shared key, certificate's index): 64 bytes */
            uint8_t index[8];
            for (int b = 0; b < 8; b++) index[b] = (uint8_t)((uint64_t)i >> (56 - 8 * b));
            if (gnutls_hmac_fast(GNUTLS_MAC_SHA512, ticket_key, 64, index, sizeof(index),
                                 k->ticket_key) != 0) {
                snprintf(err, errlen, "GnuTLS: no HMAC-SHA-512 for the ticket keys");
                h3q_server_del(s);
                return NULL;
            }
            k->ticket.data = k->ticket_key;
            k->ticket.size = sizeof(k->ticket_key);
        }
    }
    return s;
}

void h3q_server_del(h3q_server *s) {
    if (s == NULL) return;
    for (size_t i = 0; i < s->ncreds; i++)
        if (s->creds[i].cred) gnutls_certificate_free_credentials(s->creds[i].cred);
    free(s->creds);
    if (s->anti_replay) gnutls_anti_replay_deinit(s->anti_replay);
    if (s->priority) gnutls_priority_deinit(s->priority);
    free(s);
}

int h3q_classify(h3q_server *s, const uint8_t *data, size_t len, uint8_t *out, size_t *outlen) {
    ngtcp2_version_cid vc;
    int rv = ngtcp2_pkt_decode_version_cid(&vc, data, len, s->limits.cid_len);
    if (rv == NGTCP2_ERR_VERSION_NEGOTIATION) {
        uint8_t unused;
        uint32_t versions[] = {NGTCP2_PROTO_VER_V1};
        rand_bytes(&unused, 1);
        ngtcp2_ssize n = ngtcp2_pkt_write_version_negotiation(
            out, *outlen, unused, vc.scid, vc.scidlen, vc.dcid, vc.dcidlen, versions, 1);
        if (n < 0) return H3Q_DROP;
        *outlen = (size_t)n;
        return H3Q_ANSWERED;
    }
    if (rv != 0) return H3Q_DROP;
    ngtcp2_pkt_hd hd;
    if (ngtcp2_accept(&hd, data, len) != 0) return H3Q_DROP; /* not a client's first Initial */
    return H3Q_NEW;
}

/* Whether an Initial's token proves its address: 1 (a Retry token of ours: `*odcid` is the
 * ID the client first sent), 0 (none, or not one of ours: as if none), -1 (ours, but for
 * another address, or expired: the client cannot take another Retry, §17.2.5.2). */
static int retried(h3q_server *s, const ngtcp2_pkt_hd *hd, const struct sockaddr *remote,
                   socklen_t remotelen, uint64_t now, ngtcp2_cid *odcid) {
    if (hd->tokenlen == 0 || hd->token[0] != NGTCP2_CRYPTO_TOKEN_MAGIC_RETRY2) return 0;
    int rv = ngtcp2_crypto_verify_retry_token2(
        odcid, hd->token, hd->tokenlen, s->retry_secret, sizeof(s->retry_secret), hd->version,
        (const ngtcp2_sockaddr *)remote, (ngtcp2_socklen)remotelen, &hd->dcid,
        s->limits.retry_lifetime, now);
    return rv == 0 ? 1 : rv == NGTCP2_CRYPTO_ERR_UNREADABLE_TOKEN ? 0 : -1;
}

/* The Retry for `hd` (its source ID drawn by the host, so it names this worker), or 0. */
static size_t write_retry(h3q_server *s, const ngtcp2_pkt_hd *hd, const struct sockaddr *remote,
                          socklen_t remotelen, uint64_t now, uint8_t *out, size_t cap) {
    ngtcp2_cid scid;
    uint8_t token[NGTCP2_CRYPTO_MAX_RETRY_TOKENLEN2];
    scid.datalen = s->limits.cid_len;
    s->calls.cid(s->host, NULL, scid.data, scid.datalen);
    ngtcp2_ssize n = ngtcp2_crypto_generate_retry_token2(
        token, s->retry_secret, sizeof(s->retry_secret), hd->version,
        (const ngtcp2_sockaddr *)remote, (ngtcp2_socklen)remotelen, &scid, &hd->dcid, now);
    if (n < 0) return 0;
    n = ngtcp2_crypto_write_retry(out, cap, hd->version, &hd->scid, &scid, &hd->dcid, token,
                                  (size_t)n);
    return n < 0 ? 0 : (size_t)n;
}

h3q_conn *h3q_accept(h3q_server *s, const uint8_t *data, size_t len,
                     const struct sockaddr *local, socklen_t locallen,
                     const struct sockaddr *remote, socklen_t remotelen, uint64_t now,
                     void *conn_host, int retry, uint8_t *out, size_t *outlen) {
    ngtcp2_pkt_hd hd;
    ngtcp2_cid odcid;
    size_t cap = *outlen;
    *outlen = 0;
    if (ngtcp2_accept(&hd, data, len) != 0) return NULL;
    int proven = retried(s, &hd, remote, remotelen, now, &odcid);
    if (proven < 0) {
        ngtcp2_ssize n = ngtcp2_crypto_write_connection_close(
            out, cap, hd.version, &hd.scid, &hd.dcid, NGTCP2_INVALID_TOKEN, NULL, 0);
        *outlen = n < 0 ? 0 : (size_t)n;
        return NULL;
    }
    if (retry && !proven) {
        *outlen = write_retry(s, &hd, remote, remotelen, now, out, cap);
        return NULL;
    }
    h3q_conn *c = calloc(1, sizeof(*c));
    if (c == NULL) return NULL;
    c->s = s;
    c->host = conn_host;
    c->peer_ctrl = -1;
    c->last_sid = -4;
    c->ctrl.uni = c->enc.uni = c->dec.uni = -1;
    ngtcp2_ccerr_default(&c->ccerr);
    ngtcp2_path_storage_init(&c->path, local, locallen, remote, remotelen, NULL);

    ngtcp2_callbacks cb;
    memset(&cb, 0, sizeof(cb));
    cb.recv_client_initial = ngtcp2_crypto_recv_client_initial_cb;
    cb.recv_crypto_data = ngtcp2_crypto_recv_crypto_data_cb;
    cb.encrypt = ngtcp2_crypto_encrypt_cb;
    cb.decrypt = ngtcp2_crypto_decrypt_cb;
    cb.hp_mask = ngtcp2_crypto_hp_mask_cb;
    cb.update_key = ngtcp2_crypto_update_key_cb;
    cb.delete_crypto_aead_ctx = ngtcp2_crypto_delete_crypto_aead_ctx_cb;
    cb.delete_crypto_cipher_ctx = ngtcp2_crypto_delete_crypto_cipher_ctx_cb;
    cb.get_path_challenge_data = ngtcp2_crypto_get_path_challenge_data_cb;
    cb.version_negotiation = ngtcp2_crypto_version_negotiation_cb;
    cb.recv_stream_data = recv_stream_data;
    cb.stream_close = stream_close;
    cb.stream_reset = stream_reset;
    cb.stream_stop_sending = stream_stop_sending;
    cb.extend_max_stream_data = extend_max_stream_data;
    cb.handshake_completed = handshake_completed;
    cb.rand = rand_cb;
    cb.get_new_connection_id = new_cid;
    cb.remove_connection_id = remove_cid;

    ngtcp2_settings settings;
    ngtcp2_settings_default(&settings);
    settings.initial_ts = now;
    settings.handshake_timeout = s->limits.handshake_timeout;
    settings.max_stream_window = s->limits.stream_window;
    if (proven) {
        settings.token = hd.token;
        settings.tokenlen = hd.tokenlen;
        settings.token_type = NGTCP2_TOKEN_TYPE_RETRY;
    }

    ngtcp2_transport_params params;
    ngtcp2_transport_params_default(&params);
    params.initial_max_stream_data_bidi_remote = s->limits.stream_window;
    params.initial_max_stream_data_uni = s->limits.stream_window;
    params.initial_max_data = s->limits.stream_window * s->limits.max_streams;
    params.initial_max_streams_bidi = s->limits.max_streams;
    params.initial_max_streams_uni = 3;
    params.max_idle_timeout = s->limits.idle_timeout;
    params.active_connection_id_limit = 7;
    params.original_dcid = proven ? odcid : hd.dcid;
    params.original_dcid_present = 1;
    if (proven) {  /* §7.3: the Retry's source ID */
        params.retry_scid = hd.dcid;
        params.retry_scid_present = 1;
    }
    params.stateless_reset_token_present = 1;

    ngtcp2_cid scid;
    scid.datalen = s->limits.cid_len;
    s->calls.cid(s->host, c, scid.data, scid.datalen);
    if (ngtcp2_crypto_generate_stateless_reset_token(params.stateless_reset_token,
                                                     s->reset_secret, sizeof(s->reset_secret),
                                                     &scid) != 0)
        goto fail;
    if (ngtcp2_conn_server_new(&c->conn, &hd.scid, &scid, &c->path.path, hd.version, &cb,
                               &settings, &params, NULL, c) != 0)
        goto fail;
    if (gnutls_init(&c->tls, GNUTLS_SERVER | GNUTLS_NO_AUTO_SEND_TICKET
                                 | GNUTLS_NO_END_OF_EARLY_DATA
                                 | (s->tickets ? GNUTLS_ENABLE_EARLY_DATA : GNUTLS_NO_TICKETS))
        != 0)
        goto fail;
    if (gnutls_priority_set(c->tls, s->priority) != 0
        || ngtcp2_crypto_gnutls_configure_server_session(c->tls) != 0
        || gnutls_credentials_set(c->tls, GNUTLS_CRD_CERTIFICATE, s->creds[0].cred) != 0)
        goto fail;
    gnutls_handshake_set_hook_function(c->tls, GNUTLS_HANDSHAKE_CLIENT_HELLO, GNUTLS_HOOK_PRE,
                                       hello_hook);
    if (s->tickets) {
        gnutls_anti_replay_enable(c->tls, s->anti_replay);
        gnutls_record_set_max_early_data_size(c->tls, 0xffffffffu);
    }
    {
        gnutls_datum_t alpn = {(unsigned char *)"h3", 2};
        if (gnutls_alpn_set_protocols(c->tls, &alpn, 1, GNUTLS_ALPN_MANDATORY) != 0) goto fail;
    }
    c->ref.get_conn = get_conn;
    c->ref.user_data = c;
    gnutls_session_set_ptr(c->tls, &c->ref);
    ngtcp2_conn_set_tls_native_handle(c->conn, c->tls);
    if (nghttp3_qpack_decoder_new(&c->qpack, 0, 0, nghttp3_mem_default()) != 0) goto fail;
    nghttp3_qpack_decoder_set_max_concurrent_streams(c->qpack, s->limits.max_streams);
    s->calls.route(s->host, c, hd.dcid.data, hd.dcid.datalen, 1);
    s->calls.route(s->host, c, scid.data, scid.datalen, 1);
    return c;
fail:
    h3q_conn_del(c);
    return NULL;
}

void h3q_conn_del(h3q_conn *c) {
    if (c == NULL) return;
    while (c->all) free_stream(c, c->all); /* ngtcp2_conn_del calls no stream_close */
    if (c->conn) ngtcp2_conn_del(c->conn);
    if (c->tls) gnutls_deinit(c->tls);
    if (c->qpack) nghttp3_qpack_decoder_del(c->qpack);
    free(c->closebuf);
    free(c);
}

void *h3q_conn_host(h3q_conn *c) { return c->host; }
int h3q_state(h3q_conn *c) { return c->state; }
size_t h3q_open_streams(h3q_conn *c) { return c->open_requests; }

const char *h3q_server_name(h3q_conn *c) {
    if (!c->sni[0] && c->tls) {
        size_t len = sizeof(c->sni) - 1;
        unsigned int type;
        if (gnutls_server_name_get(c->tls, c->sni, &len, &type, 0) != 0) c->sni[0] = 0;
    }
    return c->sni;
}


static void closed(h3q_conn *c, uint64_t now, int silently) {
    if (silently) {
        c->state = H3Q_GONE;
        return;
    }
    c->state = H3Q_CLOSING;
    c->close_until = now + 3 * ngtcp2_conn_get_pto(c->conn);
}

void h3q_read(h3q_conn *c, const uint8_t *data, size_t len, const struct sockaddr *local,
              socklen_t locallen, const struct sockaddr *remote, socklen_t remotelen,
              uint64_t now) {
    if (c->state == H3Q_GONE) return;
    if (c->state == H3Q_CLOSING) {
        if (c->closelen) c->close_pending = 2; /* answer with the CONNECTION_CLOSE again */
        return;
    }
    ngtcp2_path path = {{(struct sockaddr *)local, locallen},
                        {(struct sockaddr *)remote, remotelen}, NULL};
    ngtcp2_pkt_info pi = {0};
    int rv = ngtcp2_conn_read_pkt(c->conn, &path, &pi, data, len, now);
    if (rv == 0) return;
    switch (rv) {
    case NGTCP2_ERR_DRAINING:       /* the client closed it */
    case NGTCP2_ERR_DROP_CONN:
    case NGTCP2_ERR_RETRY:          /* only for a Retry of ours, which this server never sends */
        closed(c, now, 1);
        return;
    case NGTCP2_ERR_CRYPTO:
        if (!c->ccerr.error_code)
            ngtcp2_ccerr_set_tls_alert(&c->ccerr, ngtcp2_conn_get_tls_alert(c->conn), NULL, 0);
        break;
    default:
        if (!c->ccerr.error_code) ngtcp2_ccerr_set_liberr(&c->ccerr, rv, NULL, 0);
    }
    c->close_pending = 1;
}

void h3q_expire(h3q_conn *c, uint64_t now) {
    if (c->state == H3Q_CLOSING) {
        if (now >= c->close_until) c->state = H3Q_GONE;
        return;
    }
    if (c->state == H3Q_GONE) return;
    int rv = ngtcp2_conn_handle_expiry(c->conn, now);
    if (rv == NGTCP2_ERR_IDLE_CLOSE || rv == NGTCP2_ERR_HANDSHAKE_TIMEOUT) {
        closed(c, now, 1); /* RFC 9000 §10.1: silently */
    } else if (rv != 0) {
        ngtcp2_ccerr_set_liberr(&c->ccerr, rv, NULL, 0);
        c->close_pending = 1;
    }
}

uint64_t h3q_expiry(h3q_conn *c) {
    if (c->state == H3Q_GONE) return 0;
    if (c->close_pending) return 0;
    if (c->state == H3Q_CLOSING) return c->close_until;
    return ngtcp2_conn_get_expiry(c->conn);
}

static size_t write_close(h3q_conn *c, uint8_t *buf, size_t cap, size_t *sizes,
                          struct sockaddr_storage *to, socklen_t *tolen, uint64_t now) {
    if (c->close_pending == 2) { /* the same CONNECTION_CLOSE again */
        c->close_pending = 0;
        if (c->closelen > cap) return 0;
        memcpy(buf, c->closebuf, c->closelen);
        sizes[0] = c->closelen;
        memcpy(to, c->path.path.remote.addr, c->path.path.remote.addrlen);
        *tolen = c->path.path.remote.addrlen;
        return 1;
    }
    c->close_pending = 0;
    if (ngtcp2_conn_in_closing_period(c->conn) || ngtcp2_conn_in_draining_period(c->conn)) {
        closed(c, now, 0);
        return 0;
    }
    ngtcp2_path_storage ps;
    ngtcp2_path_storage_zero(&ps);
    ngtcp2_pkt_info pi;
    size_t max = ngtcp2_conn_get_max_tx_udp_payload_size(c->conn);
    if (max > cap) max = cap;
    ngtcp2_ssize n = ngtcp2_conn_write_connection_close(c->conn, &ps.path, &pi, buf, max,
                                                        &c->ccerr, now);
    if (n <= 0) {
        closed(c, now, 1);
        return 0;
    }
    free(c->closebuf);
    c->closebuf = malloc((size_t)n);
    if (c->closebuf) {
        memcpy(c->closebuf, buf, (size_t)n);
        c->closelen = (size_t)n;
    }
    closed(c, now, 0);
    sizes[0] = (size_t)n;
    memcpy(to, ps.path.remote.addr, ps.path.remote.addrlen);
    *tolen = ps.path.remote.addrlen;
    return 1;
}

size_t h3q_write(h3q_conn *c, uint8_t *buf, size_t cap, size_t *sizes, size_t max,
                 struct sockaddr_storage *to, socklen_t *tolen, uint64_t now) {
    if (c->state == H3Q_GONE) return 0;
    if (c->close_pending) return write_close(c, buf, cap, sizes, to, tolen, now);
    if (c->state == H3Q_CLOSING) return 0;
    ngtcp2_path_storage ps;
    ngtcp2_path_storage_zero(&ps);
    ngtcp2_pkt_info pi;
    size_t pkt = ngtcp2_conn_get_max_tx_udp_payload_size(c->conn);
    size_t quantum = ngtcp2_conn_get_send_quantum(c->conn);
    size_t count = 0, used = 0;
    if (quantum < cap) cap = quantum < pkt ? pkt : quantum;
    while (count < max && used + pkt <= cap) {
        stream *st = c->sendq;
        ngtcp2_vec vec[2];
        size_t nvec = 0;
        uint32_t flags = NGTCP2_WRITE_STREAM_FLAG_MORE;
        int64_t sid = -1;
        if (st) {
            sid = st->id;
            uint64_t off = st->off;
            if (off < st->frameslen) {
                vec[nvec].base = st->frames + off;
                vec[nvec++].len = st->frameslen - off;
                off = 0;
            } else {
                off -= st->frameslen;
            }
            if (off < st->bodylen) {
                vec[nvec].base = (uint8_t *)st->body + off;
                vec[nvec++].len = st->bodylen - off;
            }
            if (st->fin) flags |= NGTCP2_WRITE_STREAM_FLAG_FIN;
        }
        ngtcp2_ssize datalen = -1;
        ngtcp2_ssize n = ngtcp2_conn_writev_stream(c->conn, &ps.path, &pi, buf + used, pkt,
                                                   &datalen, flags, sid, vec, nvec, now);
        if (st && datalen >= 0) {
            st->off += (uint64_t)datalen;
            if (!pending_bytes(st)) dequeue_head(c); /* all of it, FIN included, taken */
        }
        if (n < 0) {
            if (n == NGTCP2_ERR_WRITE_MORE) continue;
            if (n == NGTCP2_ERR_STREAM_DATA_BLOCKED) {
                dequeue_head(c);
                st->blocked = 2; /* until extend_max_stream_data */
                continue;
            }
            if (n == NGTCP2_ERR_STREAM_SHUT_WR || n == NGTCP2_ERR_STREAM_NOT_FOUND) {
                dequeue_head(c);
                continue;
            }
            ngtcp2_ccerr_set_liberr(&c->ccerr, (int)n, NULL, 0);
            c->close_pending = 1;
            if (count) break;
            return write_close(c, buf, cap, sizes, to, tolen, now);
        }
        if (n == 0) break; /* nothing more, or congestion and pacing say wait */
        if (count == 0) {
            memcpy(to, ps.path.remote.addr, ps.path.remote.addrlen);
            *tolen = ps.path.remote.addrlen;
        } else if (ps.path.remote.addrlen != *tolen
                   || memcmp(ps.path.remote.addr, to, *tolen) != 0) {
            /* another path (a migration's probe): it goes with the next call */
            break;
        }
        sizes[count++] = (size_t)n;
        used += (size_t)n;
    }
    ngtcp2_conn_update_pkt_tx_time(c->conn, now);
    return count;
}

int h3q_respond(h3q_conn *c, int64_t sid, const uint8_t *frames, size_t frameslen,
                const uint8_t *body, size_t bodylen, void *owner) {
    stream *st = find(c, sid);
    if (st == NULL || st->answered) return -1;
    st->frames = malloc(frameslen ? frameslen : 1);
    if (st->frames == NULL) return -1;
    memcpy(st->frames, frames, frameslen);
    st->frameslen = frameslen;
    st->body = body;
    st->bodylen = bodylen;
    st->owner = owner;
    st->fin = 1;
    st->answered = 1;
    enqueue(c, st);
    return 0;
}

void h3q_reset(h3q_conn *c, int64_t sid, uint64_t code) {
    stream *st = find(c, sid);
    if (st) {
        unqueue(c, st);
        st->answered = 1;
        st->blocked = 1;
    }
    ngtcp2_conn_shutdown_stream(c->conn, 0, sid, code);
}

void h3q_stop_reading(h3q_conn *c, int64_t sid, uint64_t code) {
    ngtcp2_conn_shutdown_stream_read(c->conn, 0, sid, code);
}

void h3q_goaway(h3q_conn *c) {
    if (c->goaway || c->state >= H3Q_CLOSING) return;
    c->goaway = 1;
    if (!c->opened) return; /* no control stream yet: nothing was taken either */
    /* appended to the control stream's bytes, which ngtcp2 references until acked:
     * ctrl_bytes never moves */
    uint8_t *p = c->ctrl_bytes + c->ctrl.bodylen;
    uint8_t id[8];
    size_t n = put_vint(id, (uint64_t)(c->last_sid + 4));
    p[0] = F_GOAWAY;
    p[1] = (uint8_t)n;
    memcpy(p + 2, id, n);
    c->ctrl.bodylen += 2 + n;
    c->ctrl.fin = 0;
    enqueue(c, &c->ctrl);
}

int h3q_drained(h3q_conn *c) {
    return c->open_requests == 0 && c->sendq == NULL;
}

void h3q_close(h3q_conn *c, uint64_t app_error) {
    conn_error(c, app_error);
}
