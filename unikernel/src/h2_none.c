/* A kernel without TLS has no HTTP/2 (h2 is only reached through ALPN, tls.h):
 * http.c's h2 paths are unreachable here, and these keep it linking. */
#include "h2.h"

size_t h2_size(void)
{
    return 0;
}

void h2_init(struct h2 *h, struct core_conn *core, uint64_t now_ms, uint32_t open)
{
    (void)h, (void)core, (void)now_ms, (void)open;
}

size_t h2_take(struct h2 *h, const uint8_t *p, size_t n, uint64_t now_ms)
{
    (void)h, (void)p, (void)now_ms;
    return n;
}

void h2_free(struct h2 *h)
{
    (void)h;
}

void h2_eof(struct h2 *h)
{
    (void)h;
}

struct core_resp *h2_output(struct h2 *h, uint64_t now_ms)
{
    (void)h, (void)now_ms;
    return NULL;
}

void h2_written(struct h2 *h, uint64_t now_ms)
{
    (void)h, (void)now_ms;
}

int h2_tick(struct h2 *h, uint64_t now_ms, int writing)
{
    (void)h, (void)now_ms, (void)writing;
    return 1;
}

void h2_stop(struct h2 *h)
{
    (void)h;
}

int h2_done(const struct h2 *h)
{
    (void)h;
    return 1;
}

uint64_t h2_requests(void)
{
    return 0;
}
