/* A kernel without a certificate: no TLS port (see tls.h). */
#include "tls.h"

int tls_built(void)
{
    return 0;
}

int tls_init(size_t heap_bytes)
{
    (void)heap_bytes;
    return 0;
}

struct tls *tls_new(struct tcp_pcb *pcb, struct pbuf **in, const uint8_t *eof)
{
    (void)pcb, (void)in, (void)eof;
    return NULL;
}

void tls_free(struct tls *t)
{
    (void)t;
}

long tls_plain(struct tls *t, const uint8_t **p)
{
    (void)t, (void)p;
    return TLS_FAILED;
}

void tls_consume(struct tls *t, size_t n)
{
    (void)t, (void)n;
}

long tls_write(struct tls *t, const uint8_t *p, size_t n, size_t room)
{
    (void)t, (void)p, (void)n, (void)room;
    return TLS_FAILED;
}

void tls_close_notify(struct tls *t)
{
    (void)t;
}

void tls_log_stats(void)
{
}

int tls_prepare(void)
{
    return 0;
}

int tls_replied(const struct tls *t)
{
    (void)t;
    return 0;
}

int tls_handshaking(const struct tls *t)
{
    (void)t;
    return 0;
}

int tls_handshake(struct tls *t)
{
    (void)t;
    return TLS_FAILED;
}

int tls_alpn_h2(const struct tls *t)
{
    (void)t;
    return 0;
}

void *tls_alloc(size_t n)
{
    (void)n;
    return NULL;
}

void tls_release(void *p)
{
    (void)p;
}

uint64_t tls_failed_handshakes(void)
{
    return 0;
}
