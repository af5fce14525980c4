/*
 * HTTP/2 (RFC 9113) for TLS connections whose ALPN chose "h2": a frame layer in
 * front of the request core, sans-I/O like it. Each request's header block is
 * decoded (HPACK, RFC 7541) into the HTTP/1.1 head the core takes, as the Python
 * layer (orisha/protocols/h2.py) does, and the core's response becomes a HEADERS
 * frame and DATA frames. Tables and bounds come from the generated h2tables.h.
 *
 * Use: h2_init once the handshake chose h2; feed plaintext with h2_take (it may
 * take less when its output is full); write what h2_output returns, segment by
 * segment, then call h2_written; h2_tick about twice a second; close (after a
 * linger) once h2_done says so.
 */
#ifndef ORISHA_H2_H
#define ORISHA_H2_H
#include <stddef.h>
#include <stdint.h>
#include "core.h"

struct h2;

/* Bytes an h2 connection needs (its buffers included): the caller allocates. */
size_t h2_size(void);
/* Start: queues our SETTINGS. `core` is the connection's core, reused per request;
 * `open` counts connections (over the limit every request is answered 503). */
void h2_init(struct h2 *h, struct core_conn *core, uint64_t now_ms, uint32_t open);
/* Plaintext from the peer; returns how much was consumed (the rest: offer again
 * after h2_written). */
size_t h2_take(struct h2 *h, const uint8_t *p, size_t n, uint64_t now_ms);
/* Give back what the connection took from the TLS heap beyond h2_size() (before
 * freeing h itself). */
void h2_free(struct h2 *h);
/* The peer finished sending (TLS close_notify or EOF). */
void h2_eof(struct h2 *h);
/* Frames to write now (NULL: none). The same list comes back until h2_written. */
struct core_resp *h2_output(struct h2 *h, uint64_t now_ms);
void h2_written(struct h2 *h, uint64_t now_ms);
/* Timeouts and the abuse budget's refill; `writing`: bytes not yet acknowledged.
 * 1 when the connection must be closed now. */
int h2_tick(struct h2 *h, uint64_t now_ms, int writing);
/* Graceful stop: GOAWAY, finish what was asked, then done. */
void h2_stop(struct h2 *h);
/* Requests answered over HTTP/2 so far. */
uint64_t h2_requests(void);
/* Nothing more will be sent: close (or linger). */
int h2_done(const struct h2 *h);
#endif
