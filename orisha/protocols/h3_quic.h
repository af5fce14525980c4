/* HTTP/3 over ngtcp2 and GnuTLS: the plain-C half of the compiled HTTP/3 path (issue 46).
 *
 * Strategy: ngtcp2 does QUIC (packets, protection, loss recovery, congestion and flow
 * control, connection IDs, path MTU probing, pacing) and its GnuTLS helper the TLS 1.3
 * handshake. This file adds what HTTP/3 needs on top (RFC 9114): the control and QPACK
 * streams, the request streams' framing, and the field sections decoded with nghttp3's
 * standalone QPACK decoder (no dynamic table is offered: capacity 0). What a request is
 * answered with is not decided here: the host (a thin wrapper, compiled_h3.pyx hosted)
 * gets each decoded request through `h3q_calls.request` and answers with `h3q_respond`
 * (frames it made, the build's QPACK section among them, and a body it keeps alive until
 * `h3q_calls.release`) or `h3q_reset`. Datagrams come in and go out through the host,
 * which also routes them to connections by ID (`h3q_calls.route`) and draws every ID
 * (`h3q_calls.cid`), so an ID can name its worker. No I/O and no clock here: times are
 * the host's, in nanoseconds.
 */
#ifndef H3_QUIC_H
#define H3_QUIC_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

typedef struct h3q_server h3q_server;
typedef struct h3q_conn h3q_conn;

typedef struct {
    const uint8_t *name, *value;
    size_t namelen, valuelen;
} h3q_field;

typedef struct {
    /* A request stream's field section, as sent (`section`: with no dynamic table the same
     * bytes always decode to the same fields, so the host may memoise by them) and decoded;
     * `flags`: H3Q_ENDED (the stream ended with it), H3Q_EARLY (it came as 0-RTT: the
     * handshake has not completed). The host answers now (h3q_respond, h3q_reset) or never. */
    void (*request)(void *host, h3q_conn *c, int64_t sid, const uint8_t *section,
                    size_t sectionlen, const h3q_field *fields, size_t n, unsigned flags);
    /* A response's body owner (h3q_respond) is no longer read. */
    void (*release)(void *host, void *owner);
    /* Fill `cid` with `len` bytes: a new connection ID for connection `c`. */
    void (*cid)(void *host, h3q_conn *c, uint8_t *cid, size_t len);
    /* `cid` names `c` from now on (added) or no longer. */
    void (*route)(void *host, h3q_conn *c, const uint8_t *cid, size_t len, int added);
    /* Which certificate (index into h3q_server_new's) answers a client hello naming
     * `name` ("" for none). */
    size_t (*credential)(void *host, const char *name);
} h3q_calls;

typedef struct {
    uint64_t idle_timeout;      /* ns: QUIC's max_idle_timeout */
    uint64_t handshake_timeout; /* ns */
    uint64_t stream_window;     /* a request stream's receive window */
    size_t max_section;         /* a HEADERS or SETTINGS frame longer: H3_EXCESSIVE_LOAD */
    uint64_t max_streams;       /* request streams open at once */
    size_t cid_len;
    uint64_t retry_lifetime;    /* ns a Retry's token is taken back */
} h3q_limits;

enum { H3Q_ENDED = 1, H3Q_EARLY = 2 };

/* What a datagram of no known connection is. */
enum { H3Q_DROP = 0, H3Q_NEW = 1, H3Q_ANSWERED = 2 };
/* A connection's state (h3q_state). */
enum { H3Q_HANDSHAKING = 0, H3Q_OPEN = 1, H3Q_CLOSING = 2, H3Q_GONE = 3 };

/* One certificate chain and its private key, PEM, in memory: read by the host once (the
 * supervisor, before it forks the workers), never from a file here, so a worker started
 * later serves what was checked even when the files have changed since. */
typedef struct {
    const uint8_t *cert;
    size_t cert_len;
    const uint8_t *key;
    size_t key_len;
} h3q_pem;

/* `pems`: `n` certificates (index `i` of h3q_calls.credential). `ticket_key`: 64 bytes
 * every worker shares, for TLS session tickets and 0-RTT (each certificate's tickets are
 * sealed with a key of its own drawn from it, so a ticket resumes only under the
 * certificate it was issued with), or NULL for none. On failure `err` says which
 * certificate ("certificate I: why"). */
h3q_server *h3q_server_new(const h3q_calls *calls, void *host, const h3q_limits *limits,
                           const h3q_pem *pems, size_t n, const uint8_t *ticket_key,
                           char *err, size_t errlen);
void h3q_server_del(h3q_server *s);

/* A datagram of no known connection: H3Q_NEW (a client's first Initial: h3q_accept it),
 * H3Q_ANSWERED (a version negotiation written to `out`, `*outlen` bytes) or H3Q_DROP. */
int h3q_classify(h3q_server *s, const uint8_t *data, size_t len, uint8_t *out, size_t *outlen);
/* A connection for a client's first Initial; or NULL, with `*outlen` bytes in `out` to send
 * back when it was answered instead: a Retry (RFC 9000 §8.1.2) when `retry` and the
 * Initial carries no token of ours, or CONNECTION_CLOSE with INVALID_TOKEN for a Retry token
 * of ours that fails (expired, another address). A valid Retry token is taken whether
 * `retry` is asked or not. `out` holds at least 1,200 bytes. */
h3q_conn *h3q_accept(h3q_server *s, const uint8_t *data, size_t len,
                     const struct sockaddr *local, socklen_t locallen,
                     const struct sockaddr *remote, socklen_t remotelen, uint64_t now,
                     void *conn_host, int retry, uint8_t *out, size_t *outlen);
void h3q_conn_del(h3q_conn *c);
void *h3q_conn_host(h3q_conn *c);

/* Feed one datagram; then h3q_write. */
void h3q_read(h3q_conn *c, const uint8_t *data, size_t len, const struct sockaddr *local,
              socklen_t locallen, const struct sockaddr *remote, socklen_t remotelen,
              uint64_t now);
/* Up to `max` packets into `buf` (each at most the configured UDP payload size), their sizes in
 * `sizes`, not all one size (the path's size, a shorter last one, a larger PMTU probe: the
 * host groups equal runs for GSO); all go to `*to` (`*tolen`). Returns how many. */
size_t h3q_write(h3q_conn *c, uint8_t *buf, size_t cap, size_t *sizes, size_t max,
                 struct sockaddr_storage *to, socklen_t *tolen, uint64_t now);
uint64_t h3q_expiry(h3q_conn *c); /* UINT64_MAX: none */
void h3q_expire(h3q_conn *c, uint64_t now);
int h3q_state(h3q_conn *c);
/* The client's server name (SNI), or "" for none. */
const char *h3q_server_name(h3q_conn *c);

int h3q_respond(h3q_conn *c, int64_t sid, const uint8_t *frames, size_t frameslen,
                const uint8_t *body, size_t bodylen, void *owner);
void h3q_reset(h3q_conn *c, int64_t sid, uint64_t code);
void h3q_stop_reading(h3q_conn *c, int64_t sid, uint64_t code);
/* GOAWAY naming the first request stream not taken; then close once drained. */
void h3q_goaway(h3q_conn *c);
int h3q_drained(h3q_conn *c);
void h3q_close(h3q_conn *c, uint64_t app_error);
/* Request streams still open (answered or not), and requests taken. */
size_t h3q_open_streams(h3q_conn *c);

#endif
