/*
 * The request core: an interpreter of the site image `orisha build --loop
 * unikernel` writes (orisha/targets/unikernel/layout.py). It is the C twin of the
 * Python core in orisha/core/ and must answer every request head with the
 * same bytes. It is sans-I/O like its twin: the lwIP glue (http.c) feeds it
 * bytes and the time, and writes the segments of one response at a time.
 *
 * Its policy (methods, statuses, limits, the image layout) is in policy.h,
 * generated at build time from the Python tables by
 * orisha/targets/unikernel/policy_header.py: nothing of it is typed in C.
 *
 * Per connection: feed input with core_take() while core_wants_input(), ask
 * core_next() for the next response, write c->resp (segments in order; a
 * segment with `copy` set lives in the connection — its tail, dyn or input
 * buffer — and must be copied before the next core_take() or core_next()),
 * call core_sent() when the peer acknowledges bytes, core_tick() about twice a
 * second, and close once core_done() says so.
 */
#ifndef ORISHA_CORE_H
#define ORISHA_CORE_H
#include <stddef.h>
#include <stdint.h>
#include "policy.h"

/* The fixed buffers hold the default head and target limits (policy.LIMITS);
 * http.c clamps larger ones. A redirect copies the query of a target. */
#define CORE_HEAD_MAX POLICY_DEFAULT_HEAD
#define CORE_TARGET_MAX POLICY_DEFAULT_TARGET

/* One member per limit the kernel takes (POLICY_LIMITS): counts and bytes as
 * they are, timeouts in milliseconds. Defaults from policy.h; http.c overrides
 * them from the kernel command line before the first connection. */
struct core_limits {
#define CORE_LIMIT_MEMBER(name, def, scale) uint64_t name;
    POLICY_LIMITS(CORE_LIMIT_MEMBER)
#undef CORE_LIMIT_MEMBER
};
extern struct core_limits core_limits;

struct core_seg {
    const uint8_t *p;
    uint32_t len;
    uint8_t copy;            /* 1: bytes live in the connection (copy them) */
};

/* The most segments of one response: a multipart/byteranges 206 (head, length,
 * fields, tail, four per part, the close delimiter), or a rule's redirect
 * (Location prefix, its pieces, "?", query, tail, Date). */
#define CORE_SEGS (5 + 4 * POLICY_RANGE_PARTS_MAX)
_Static_assert(CORE_SEGS >= IMAGE_PIECES_MAX + 5, "segments of a rule's redirect");
/* Per-connection bytes of a response: a 206 status block, a multipart's part
 * numbers, or a rule redirect's captures percent-encoded (3 bytes per byte of
 * a path at most: the captures are disjoint parts of it). */
#define CORE_DYN_MAX (3 * (CORE_TARGET_MAX + 2))
_Static_assert(CORE_DYN_MAX >= POLICY_RANGE_PARTS_MAX * 64 + 32, "multipart part numbers");
struct core_resp {
    struct core_seg seg[CORE_SEGS];
    uint8_t n;               /* 0: no response pending */
    /* When the response starts with a head the image stores (a variant's 200 or 304,
     * a 416, an error page, a redirect without a query): its HTTP/2 header block,
     * encoded by the build (image.py, hpack_blocks.block) and stored beside it, and
     * h2_head, the bytes of that head (the segments' first bytes; its field lines,
     * each with its CRLF). h2_len 0: a head made per request (a 206, a redirect with
     * a query or captures), which h2.c converts. */
    const uint8_t *h2;
    uint32_t h2_len, h2_head;
    /* A variant's 200 with early hints: the HTTP/2 block of its 103 (image.py,
     * hpack_blocks.early_hints), which h2.c sends first. h2_103_len 0: none. */
    const uint8_t *h2_103;
    uint32_t h2_103_len;
};

struct core_conn {
    uint32_t start, len;     /* unparsed input: buf[start, len) */
    uint64_t discard;        /* request body bytes still to skip */
    uint64_t since;          /* ms: start of the current wait, for timeouts */
    uint8_t eof;             /* the peer finished sending */
    uint8_t close_after;     /* no more requests: close once resp is written */
    struct core_resp resp;
    char tail[64];           /* Date + Connection lines of resp */
    char dyn[CORE_DYN_MAX];  /* see CORE_DYN_MAX */
    uint8_t buf[CORE_HEAD_MAX + 4];
};

/* Check and adopt the site image; PANICs on a bad one. Returns the number of routes. */
uint32_t core_init(const uint8_t *image, size_t len);
/* A new connection; `open` counts it. Over the limit it is answered 503 and closes. */
void core_connect(struct core_conn *c, uint64_t now_ms, uint32_t open);
/* Input bytes; returns how many were consumed (the rest: offer again later). */
size_t core_take(struct core_conn *c, const uint8_t *data, size_t n);
int core_wants_input(const struct core_conn *c);
/* Plan the next response into c->resp (which must be empty): 1 if there is one. */
int core_next(struct core_conn *c, uint64_t now_ms);
void core_eof(struct core_conn *c);
void core_sent(struct core_conn *c, uint64_t now_ms);
/* Timeouts; `writing`: output not yet acknowledged. May plan a 408.
 * Returns 1 when the connection must be closed now (dropped). */
int core_tick(struct core_conn *c, uint64_t now_ms, int writing);
/* No more responses will come: close once the last one is written. */
int core_done(const struct core_conn *c);
/* A response from outside the site, in place of any planned one (the TLS port's
 * answer to plain HTTP, see http.c): head, the Date/close tail, body; then the
 * connection closes and its input is dropped, as after a fatal error. */
void core_refuse(struct core_conn *c, const void *head, size_t head_len,
                 const void *body, size_t body_len);

/* Test hook for the twin property: parse a date as dates.parse_http_date. */
int core_parse_http_date(const uint8_t *s, size_t n, int64_t *out);

#endif
