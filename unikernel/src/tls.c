/*
 * TLS 1.3 (and 1.2) with mbedTLS for the HTTP glue (see tls.h). Strategy:
 * mbedTLS does the protocol; this file gives it the kernel's memory, entropy,
 * clocks and lwIP, and nothing more.
 *
 * - Memory: mbedTLS allocates and frees per session, which the kernel's bump
 *   allocators cannot do, so its own first-fit heap (memory_buffer_alloc) runs
 *   over a region of the guest's RAM that http.c sizes from the memory it has
 *   (TLS_SLOT a connection it admits). A session costs about 40 KB (two 16 KiB
 *   record buffers); when the heap is full a new connection waits (http.c).
 * - Entropy: PSA's CTR_DRBG, which every key share, nonce and signature draws
 *   from, is seeded (and reseeded) from an entropy context holding a strong
 *   source for each generator the machine has: RDSEED/RDRAND
 *   (platform_entropy) and virtio-rng (virtio_rng_read). mbedtls_entropy_func
 *   wants its threshold from every source it holds, so one the machine lacks
 *   is not added rather than failing (the config has no default sources).
 *   Either alone serves TLS; with neither the kernel refuses: PANIC at boot.
 * - Time: mbedtls_time is the wall clock (platform_unix_time), mbedtls_ms_time
 *   the monotonic clock.
 * - I/O: mbedtls_ssl_set_bio over the connection's pbuf queue (input) and
 *   tcp_write (output); WANT_READ / WANT_WRITE mean "wait for the next lwIP
 *   callback", never a busy loop.
 * - The certificate chain and key are PEM text linked into the kernel (the
 *   Makefile's tls.o, from the files given to `orisha build`, which checked
 *   them with Python's ssl module); ALPN offers h2 and http/1.1.
 */
#include <stdint.h>
#include <string.h>
#include "lwip/tcp.h"
#include "mbedtls/ssl.h"
#include "mbedtls/x509_crt.h"
#include "mbedtls/pk.h"
#include "mbedtls/error.h"
#include "mbedtls/entropy.h"
#include "mbedtls/platform.h"
#include "mbedtls/platform_time.h"
#include "mbedtls/memory_buffer_alloc.h"
#include "mbedtls/psa_util.h"
#include "psa/crypto.h"
#include "platform.h"
#include "virtio_rng.h"
#include "tls.h"

#define PLAIN_MAX 2048           /* plaintext read ahead of the core per record read */
#define RECORD_OVERHEAD 64       /* header, type byte, tag (22 in TLS 1.3), with room */

/* Linked by the Makefile (tls.o): PEM text, each NUL-terminated for mbedTLS. */
extern const unsigned char tls_cert_pem[], tls_cert_pem_end[];
extern const unsigned char tls_key_pem[], tls_key_pem_end[];

struct tls {
    mbedtls_ssl_context ssl;
    struct tcp_pcb *pcb;
    struct pbuf **in;            /* the connection's ciphertext queue */
    const uint8_t *eof;          /* the peer's FIN */
    size_t pending;              /* plaintext bytes of a record mbedTLS holds (WANT_WRITE) */
    uint64_t hs_ns;              /* the guest's time in this handshake's steps so far */
    uint16_t plain_off, plain_len;
    uint8_t plain[PLAIN_MAX];
};

static mbedtls_ssl_config conf;
static mbedtls_x509_crt chain;
static mbedtls_pk_context key;
/* h2 first: mbedTLS picks the first of ours the client offers. */
static const char *alpn[] = { "h2", "http/1.1", NULL };

/* mbedTLS's hook for PSA's entropy context (psa_crypto_invasive.h, in the
 * library's own headers: declared here). */
psa_status_t mbedtls_psa_crypto_configure_entropy_sources(
    void (*entropy_init)(mbedtls_entropy_context *ctx),
    void (*entropy_free)(mbedtls_entropy_context *ctx));

#define SOURCE_THRESHOLD 32 /* bytes from each source before output (MBEDTLS_ENTROPY_MIN_HARDWARE) */

static int have_cpu, have_virtio;

static int cpu_poll(void *data, unsigned char *out, size_t len, size_t *olen)
{
    (void)data;
    *olen = 0;
    if (platform_entropy(out, len) != 0)
        return MBEDTLS_ERR_ENTROPY_SOURCE_FAILED;
    *olen = len;
    return 0;
}

static int virtio_poll(void *data, unsigned char *out, size_t len, size_t *olen)
{
    (void)data;
    *olen = 0;
    if (virtio_rng_read(out, len) != 0)
        return MBEDTLS_ERR_ENTROPY_SOURCE_FAILED;
    *olen = len;
    return 0;
}

static void entropy_init(mbedtls_entropy_context *ctx)
{
    mbedtls_entropy_init(ctx); /* no sources of its own (MBEDTLS_NO_DEFAULT_ENTROPY_SOURCES) */
    if (have_cpu && mbedtls_entropy_add_source(ctx, cpu_poll, NULL, SOURCE_THRESHOLD,
                                               MBEDTLS_ENTROPY_SOURCE_STRONG) != 0)
        PANIC("tls: cannot add the CPU's entropy source");
    if (have_virtio && mbedtls_entropy_add_source(ctx, virtio_poll, NULL, SOURCE_THRESHOLD,
                                                  MBEDTLS_ENTROPY_SOURCE_STRONG) != 0)
        PANIC("tls: cannot add virtio-rng's entropy source");
}

long long tls_time(long long *t)
{
    long long now = (long long)platform_unix_time();
    if (t)
        *t = now;
    return now;
}

mbedtls_ms_time_t mbedtls_ms_time(void)
{
    return (mbedtls_ms_time_t)(platform_now_ns() / 1000000u);
}

/*
 * Ephemeral ECDHE keys made while the loop is idle. A handshake's key share is
 * a fresh key pair (psa_generate_key in mbedTLS's TLS code: a whole scalar
 * multiplication, a third of the guest's handshake with X25519) which mbedTLS
 * uses once and destroys. The link wraps that call (the Makefile's
 * --wrap=psa_generate_key): a request for an ECDH key of a pooled group takes a
 * key made earlier, the same way from the same DRBG, each used once, so
 * forward secrecy is what it was; an empty pool (a sustained burst) makes one
 * then and there, as before.
 */
#define KEY_POOL 8
#define PUB_MAX 65               /* an uncompressed P-256 point; X25519's is 32 bytes */
struct pooled_key {
    mbedtls_svc_key_id_t id;
    uint8_t pub_len;
    uint8_t pub[PUB_MAX];
};
struct key_pool {
    psa_key_type_t type;
    size_t bits;
    int n;
    struct pooled_key key[KEY_POOL];
};
static struct key_pool pools[] = {
    { PSA_KEY_TYPE_ECC_KEY_PAIR(PSA_ECC_FAMILY_MONTGOMERY), 255, 0, { { 0 } } },
    { PSA_KEY_TYPE_ECC_KEY_PAIR(PSA_ECC_FAMILY_SECP_R1), 256, 0, { { 0 } } },
};
/* The key last handed out, until mbedTLS exports its public half (the very next
 * PSA call it makes): PSA keeps only the private scalar, and would multiply again. */
static struct pooled_key issued;
static int pools_on;             /* PSA is up (tls_init) */
static uint64_t keys_pooled;     /* key shares that came from a pool */

psa_status_t __real_psa_generate_key(const psa_key_attributes_t *a, mbedtls_svc_key_id_t *key);
psa_status_t __wrap_psa_generate_key(const psa_key_attributes_t *a, mbedtls_svc_key_id_t *key);
psa_status_t __real_psa_export_public_key(mbedtls_svc_key_id_t key, uint8_t *data, size_t size,
                                          size_t *len);
psa_status_t __wrap_psa_export_public_key(mbedtls_svc_key_id_t key, uint8_t *data, size_t size,
                                          size_t *len);

static void ecdh_attributes(psa_key_attributes_t *a, const struct key_pool *p)
{
    *a = psa_key_attributes_init();
    psa_set_key_usage_flags(a, PSA_KEY_USAGE_DERIVE);
    psa_set_key_algorithm(a, PSA_ALG_ECDH);
    psa_set_key_type(a, p->type);
    psa_set_key_bits(a, p->bits);
}

psa_status_t __wrap_psa_generate_key(const psa_key_attributes_t *a, mbedtls_svc_key_id_t *key)
{
    for (size_t i = 0; i < sizeof pools / sizeof *pools; i++) {
        struct key_pool *p = &pools[i];
        psa_key_attributes_t want;
        ecdh_attributes(&want, p);
        if (p->n && psa_get_key_type(a) == p->type && psa_get_key_bits(a) == p->bits &&
            psa_get_key_usage_flags(a) == psa_get_key_usage_flags(&want) &&
            psa_get_key_algorithm(a) == PSA_ALG_ECDH &&
            psa_get_key_lifetime(a) == PSA_KEY_LIFETIME_VOLATILE) {
            struct pooled_key *k = &p->key[--p->n];
            *key = k->id;
            keys_pooled++;
            issued = *k;
            return PSA_SUCCESS;
        }
    }
    issued.pub_len = 0;
    return __real_psa_generate_key(a, key);
}

psa_status_t __wrap_psa_export_public_key(mbedtls_svc_key_id_t key, uint8_t *data, size_t size,
                                          size_t *len)
{
    struct pooled_key *k = &issued;
    if (k->pub_len && mbedtls_svc_key_id_equal(k->id, key) && size >= k->pub_len) {
        memcpy(data, k->pub, k->pub_len);
        *len = k->pub_len;
        k->pub_len = 0; /* once: the id is reused after mbedTLS destroys the key */
        return PSA_SUCCESS;
    }
    k->pub_len = 0;
    return __real_psa_export_public_key(key, data, size, len);
}

int tls_prepare(void)
{
    if (!pools_on)
        return 0;
    for (size_t i = 0; i < sizeof pools / sizeof *pools; i++) {
        struct key_pool *p = &pools[i];
        if (p->n == KEY_POOL)
            continue;
        psa_key_attributes_t a;
        ecdh_attributes(&a, p);
        struct pooled_key *k = &p->key[p->n];
        size_t len;
        if (__real_psa_generate_key(&a, &k->id) != PSA_SUCCESS)
            return 0; /* no entropy or memory now: the handshakes make their own */
        if (__real_psa_export_public_key(k->id, k->pub, sizeof k->pub, &len) != PSA_SUCCESS) {
            psa_destroy_key(k->id);
            return 0;
        }
        k->pub_len = (uint8_t)len;
        p->n++;
        return 1;
    }
    return 0;
}

/* Codes only: MBEDTLS_ERROR_C's message table would cost more than the rest of
 * this file; `programs/util/strerror` in the mbedTLS sources reads them. */
static void fail(const char *what, int ret)
{
    PANIC("tls: %s: mbedTLS error -0x%04x", what, (unsigned)-ret);
}

int tls_built(void)
{
    return 1;
}

static size_t heap_total; /* the TLS heap's bytes (the failed-handshakes line) */

int tls_init(size_t heap_bytes)
{
    unsigned char *heap = platform_ram_alloc(heap_bytes, 64);
    unsigned char probe[8];
    have_cpu = platform_entropy(probe, sizeof probe) == 0;
    have_virtio = virtio_rng_read(probe, sizeof probe) == 0;
    if (!have_cpu && !have_virtio)
        PANIC("tls: no entropy source (no RDSEED/RDRAND in the CPU, no virtio-rng device): "
              "refusing to serve TLS");
    mbedtls_memory_buffer_alloc_init(heap, heap_bytes);
    heap_total = heap_bytes;
    psa_status_t st = mbedtls_psa_crypto_configure_entropy_sources(entropy_init, mbedtls_entropy_free);
    if (st == PSA_SUCCESS)
        st = psa_crypto_init();
    if (st != PSA_SUCCESS)
        PANIC("tls: psa_crypto_init failed (%d)", (int)st);
    int ret;
    mbedtls_x509_crt_init(&chain);
    if ((ret = mbedtls_x509_crt_parse(&chain, tls_cert_pem,
                                      (size_t)(tls_cert_pem_end - tls_cert_pem))) != 0)
        fail("certificate", ret);
    mbedtls_pk_init(&key);
    if ((ret = mbedtls_pk_parse_key(&key, tls_key_pem, (size_t)(tls_key_pem_end - tls_key_pem),
                                    NULL, 0, mbedtls_psa_get_random, MBEDTLS_PSA_RANDOM_STATE)) != 0)
        fail("key", ret);
    mbedtls_ssl_config_init(&conf);
    if ((ret = mbedtls_ssl_config_defaults(&conf, MBEDTLS_SSL_IS_SERVER, MBEDTLS_SSL_TRANSPORT_STREAM,
                                           MBEDTLS_SSL_PRESET_DEFAULT)) != 0)
        fail("config", ret);
    mbedtls_ssl_conf_rng(&conf, mbedtls_psa_get_random, MBEDTLS_PSA_RANDOM_STATE);
    mbedtls_ssl_conf_min_tls_version(&conf, MBEDTLS_SSL_VERSION_TLS1_2);
    if ((ret = mbedtls_ssl_conf_own_cert(&conf, &chain, &key)) != 0)
        fail("certificate and key", ret);
    if ((ret = mbedtls_ssl_conf_alpn_protocols(&conf, alpn)) != 0)
        fail("alpn", ret);
    pools_on = 1;
    if (platform_verbose())
        platform_printf("orisha: tls: %s key, %u-byte chain, heap %u KiB\n",
                        mbedtls_pk_get_name(&key), (unsigned)(tls_cert_pem_end - tls_cert_pem),
                        (unsigned)(heap_bytes / 1024));
    return 1;
}

/* mbedTLS's output: records copied into lwIP's send queue, as much as fits. */
static int bio_send(void *ctx, const unsigned char *buf, size_t len)
{
    struct tls *t = ctx;
    size_t n = tcp_sndbuf(t->pcb);
    if (n > len)
        n = len;
    err_t e;
    while (n && (e = tcp_write(t->pcb, buf, (u16_t)n, TCP_WRITE_FLAG_COPY)) == ERR_MEM && n > TCP_MSS)
        n /= 2;
    if (!n || e == ERR_MEM)
        return MBEDTLS_ERR_SSL_WANT_WRITE; /* resumed from tcp_sent or the poll timer */
    if (e != ERR_OK)
        return MBEDTLS_ERR_SSL_INTERNAL_ERROR;
    return (int)n;
}

/* mbedTLS's input: bytes from the connection's pbuf queue, received as taken. */
static int bio_recv(void *ctx, unsigned char *buf, size_t len)
{
    struct tls *t = ctx;
    size_t got = 0;
    while (got < len && *t->in) {
        struct pbuf *p = *t->in;
        if (!p->len) { /* an empty pbuf heading the chain: pbuf_free_header(p, 0) would keep it */
            *t->in = p->next;
            p->next = NULL;
            pbuf_free(p);
            continue;
        }
        size_t k = len - got < p->len ? len - got : p->len;
        memcpy(buf + got, p->payload, k);
        got += k;
        tcp_recved(t->pcb, (u16_t)k);
        *t->in = pbuf_free_header(p, (u16_t)k);
    }
    if (got)
        return (int)got;
    return *t->eof ? 0 : MBEDTLS_ERR_SSL_WANT_READ;
}

struct tls *tls_new(struct tcp_pcb *pcb, struct pbuf **in, const uint8_t *eof)
{
    struct tls *t = mbedtls_calloc(1, sizeof *t);
    if (!t)
        return NULL;
    mbedtls_ssl_init(&t->ssl);
    if (mbedtls_ssl_setup(&t->ssl, &conf) != 0) { /* its record buffers: out of heap */
        mbedtls_ssl_free(&t->ssl);
        mbedtls_free(t);
        return NULL;
    }
    t->pcb = pcb;
    t->in = in;
    t->eof = eof;
    mbedtls_ssl_set_bio(&t->ssl, t, bio_send, bio_recv, NULL);
    return t;
}

void tls_free(struct tls *t)
{
    mbedtls_ssl_free(&t->ssl);
    mbedtls_free(t);
}

int tls_replied(const struct tls *t)
{
    return t->ssl.MBEDTLS_PRIVATE(state) > MBEDTLS_SSL_CLIENT_HELLO;
}

int tls_handshaking(const struct tls *t)
{
    return !mbedtls_ssl_is_handshake_over((mbedtls_ssl_context *)&t->ssl);
}

/* Whether a mbedTLS result means "wait for lwIP" (input, room to send). */
static int waiting(int ret)
{
    return ret == MBEDTLS_ERR_SSL_WANT_READ || ret == MBEDTLS_ERR_SSL_WANT_WRITE;
}

/*
 * What handshakes cost the guest (the stats line): each finished handshake's
 * time in mbedTLS's steps (its own work, the copies into lwIP included, never
 * the waits for the peer), the last HS_SAMPLES of them, and the total per
 * handshake state over all of them (which step the time goes to).
 */
#define HS_SAMPLES 512
#define HS_STATES 32
#define HS_SHOWN_NS (10 * 1000) /* steps of 10 us or more a handshake are shown */
static uint32_t hs_us[HS_SAMPLES];
static uint64_t hs_count, hs_state_ns[HS_STATES];

static void hs_record(uint64_t ns)
{
    hs_us[hs_count++ % HS_SAMPLES] = (uint32_t)(ns / 1000);
}

/* Handshakes that failed (the connection closes after mbedTLS's alert, if it sent
 * one), and the last one's mbedTLS error: a line of their own, once there are any. */
static uint64_t hs_failed;
static int hs_last_error;

uint64_t tls_failed_handshakes(void)
{
    return hs_failed;
}

void tls_log_stats(void)
{
    static uint32_t v[HS_SAMPLES];
    if (hs_failed) /* the heap's use is not known here: MEMORY_DEBUG needs stdio */
        platform_printf("orisha: tls failed_handshakes %lu last_error -0x%04x heap_size %lu\n",
                        (unsigned long)hs_failed, (unsigned)-hs_last_error,
                        (unsigned long)heap_total);
    uint32_t n = hs_count < HS_SAMPLES ? (uint32_t)hs_count : HS_SAMPLES;
    if (!n)
        return;
    memcpy(v, hs_us, n * sizeof *v);
    for (uint32_t i = 1; i < n; i++) { /* insertion sort: at most 512, only at a stats line */
        uint32_t x = v[i], j = i;
        for (; j && v[j - 1] > x; j--)
            v[j] = v[j - 1];
        v[j] = x;
    }
    platform_printf("orisha: tls handshakes %lu pooled_keys %lu median_us %u p90_us %u min_us %u "
                    "steps_us", (unsigned long)hs_count, (unsigned long)keys_pooled, v[n / 2],
                    v[n * 9 / 10], v[0]);
    for (int st = 0; st < HS_STATES; st++)
        if (hs_state_ns[st] / hs_count >= HS_SHOWN_NS)
            platform_printf(" %d:%lu", st, (unsigned long)(hs_state_ns[st] / hs_count / 1000));
    platform_printf("\n");
}

/* Drive the handshake: 1 done, 0 waiting, TLS_CLOSED/TLS_FAILED. A failed one has
 * sent its alert (mbedTLS does) and the connection closes. mbedtls_ssl_handshake's
 * own loop, step by step, timed (see hs_record). */
int tls_handshake(struct tls *t)
{
    if (mbedtls_ssl_is_handshake_over(&t->ssl))
        return 1;
    int ret = 0;
    while (!mbedtls_ssl_is_handshake_over(&t->ssl)) {
        int st = t->ssl.MBEDTLS_PRIVATE(state);
        uint64_t t0 = platform_now_ns();
        ret = mbedtls_ssl_handshake_step(&t->ssl);
        uint64_t dt = platform_now_ns() - t0;
        t->hs_ns += dt;
        if (st >= 0 && st < HS_STATES)
            hs_state_ns[st] += dt;
        if (ret != 0)
            break;
    }
    if (ret == 0) {
        hs_record(t->hs_ns);
        return 1;
    }
    if (waiting(ret))
        return 0;
    if (ret == MBEDTLS_ERR_SSL_CONN_EOF)
        return TLS_CLOSED;
    if (platform_verbose())
        platform_printf("orisha: tls handshake failed: mbedTLS error -0x%04x\n", (unsigned)-ret);
    hs_failed++;
    hs_last_error = ret;
    return TLS_FAILED;
}

long tls_plain(struct tls *t, const uint8_t **p)
{
    if (t->plain_off == t->plain_len) {
        int h = tls_handshake(t);
        if (h <= 0)
            return h;
        int ret = mbedtls_ssl_read(&t->ssl, t->plain, sizeof t->plain);
        if (ret > 0) {
            t->plain_off = 0;
            t->plain_len = (uint16_t)ret;
        } else if (waiting(ret)) {
            return 0;
        } else if (ret == 0 || ret == MBEDTLS_ERR_SSL_PEER_CLOSE_NOTIFY || ret == MBEDTLS_ERR_SSL_CONN_EOF) {
            return TLS_CLOSED; /* a bare EOF too: the core answers what it has (as tls.py) */
        } else {
            return TLS_FAILED; /* a bad record: mbedTLS sent its alert */
        }
    }
    *p = t->plain + t->plain_off;
    return t->plain_len - t->plain_off;
}

void tls_consume(struct tls *t, size_t n)
{
    t->plain_off = (uint16_t)(t->plain_off + n);
}

long tls_write(struct tls *t, const uint8_t *p, size_t n, size_t room)
{
    int h = tls_handshake(t);
    if (h < 0)
        return TLS_FAILED;
    if (h == 0)
        return 0;
    if (t->pending) {
        n = t->pending; /* mbedTLS holds this record: the same call again flushes it */
    } else {
        if (room < RECORD_OVERHEAD + 1)
            return 0;
        if (n > room - RECORD_OVERHEAD)
            n = room - RECORD_OVERHEAD;
        if (n > MBEDTLS_SSL_OUT_CONTENT_LEN)
            n = MBEDTLS_SSL_OUT_CONTENT_LEN;
    }
    int ret = mbedtls_ssl_write(&t->ssl, p, n);
    if (ret == MBEDTLS_ERR_SSL_WANT_WRITE) {
        /* After the handshake this comes only from flushing the record just
         * encrypted: mbedTLS holds it, and the same call later sends the rest. */
        t->pending = n;
        return 0;
    }
    if (ret == MBEDTLS_ERR_SSL_WANT_READ)
        return 0;
    t->pending = 0;
    return ret < 0 ? TLS_FAILED : ret;
}

int tls_alpn_h2(const struct tls *t)
{
    const char *p = mbedtls_ssl_get_alpn_protocol(&t->ssl);
    return p && strcmp(p, "h2") == 0;
}

void *tls_alloc(size_t n)
{
    return mbedtls_calloc(1, n);
}

void tls_release(void *p)
{
    mbedtls_free(p);
}

void tls_close_notify(struct tls *t)
{
    if (mbedtls_ssl_is_handshake_over(&t->ssl))
        (void)mbedtls_ssl_close_notify(&t->ssl); /* WANT_WRITE: lost, as an unacknowledged FIN would be */
}
