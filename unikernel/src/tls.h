/*
 * TLS for the HTTP glue (http.c): mbedTLS between lwIP's raw callbacks and the
 * request core. A kernel built with a certificate (`orisha build --loop
 * unikernel --tls-cert C --tls-key K`) links tls.c and mbedTLS; one built
 * without links tls_none.c, where tls_init() says 0 and nothing else is called.
 *
 * Per connection: ciphertext stays in the connection's pbuf queue (`*in`, as
 * lwIP delivered it) until mbedTLS reads a record, and counts as received
 * (tcp_recved) only then, so the core's backpressure reaches the TCP window as
 * on the plain port. Records go out with tcp_write (copied: mbedTLS reuses its
 * buffer).
 */
#ifndef ORISHA_TLS_H
#define ORISHA_TLS_H
#include <stddef.h>
#include <stdint.h>

struct tls;
struct tcp_pcb;
struct pbuf;

#define TLS_PORT 443
/* tls_plain/tls_write: the peer's close_notify or EOF; a broken session (close). */
#define TLS_CLOSED (-1)
#define TLS_FAILED (-2)

/* What one connection may take from the TLS heap: a session in its handshake
 * (about 40 KB with two 16 KiB record buffers, more while the handshake runs)
 * and an HTTP/2 connection's state (h2_size(), reserved at admission). */
#define TLS_SLOT (80u * 1024)
/* 1 if this kernel serves TLS: takes heap_bytes of guest RAM for mbedTLS's heap,
 * parses the linked certificate and key (PANICs on bad ones: the build checked
 * them) and seeds the random generator. A kernel without TLS returns 0. */
int tls_init(size_t heap_bytes);
/* 1 in a kernel linked with mbedTLS (tls.c), 0 in one without (tls_none.c). */
int tls_built(void);
/* A session for a new connection reading ciphertext from *in (and the peer's
 * FIN from *eof); NULL when the TLS heap is full. */
struct tls *tls_new(struct tcp_pcb *pcb, struct pbuf **in, const uint8_t *eof);
void tls_free(struct tls *t);
/* Plaintext for the core: > 0 bytes at *p (the handshake done, a record read),
 * 0 for none yet, TLS_CLOSED or TLS_FAILED. */
long tls_plain(struct tls *t, const uint8_t **p);
void tls_consume(struct tls *t, size_t n);
/* Encrypt up to n bytes (never more than `room` bytes of records into the
 * send queue) and queue them: bytes taken, 0 when blocked, or TLS_FAILED.
 * After a 0 call again with the same p (mbedTLS holds the record). */
long tls_write(struct tls *t, const uint8_t *p, size_t n, size_t room);
/* Queue a close_notify (RFC 8446 §6.1); the peer's is not awaited. */
void tls_close_notify(struct tls *t);
/* Still in the handshake (bounded by the head timeout, as the Python layer). */
int tls_handshaking(const struct tls *t);
/* The handshake got past the ClientHello: our flight is out, the client's turn. */
int tls_replied(const struct tls *t);
/* Work for an idle loop: makes one ephemeral ECDHE key for a later handshake
 * if a pool is short (tls.c); 1 if it did. */
int tls_prepare(void);
/* A stats line of what handshakes cost the guest (median, per step), if any finished. */
void tls_log_stats(void);
/* Handshakes that failed so far (http.c logs its stats line when this grows). */
uint64_t tls_failed_handshakes(void);
/* Drive the handshake: 1 done, 0 waiting for lwIP, TLS_CLOSED or TLS_FAILED. */
int tls_handshake(struct tls *t);
/* After the handshake: whether ALPN chose "h2" (RFC 7301; RFC 9113 §3.2). */
int tls_alpn_h2(const struct tls *t);
/* Memory from the TLS heap (zeroed; NULL when full), for state TLS connections carry. */
void *tls_alloc(size_t n);
void tls_release(void *p);
#endif
