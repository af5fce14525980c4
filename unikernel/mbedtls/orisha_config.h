/*
 * mbedTLS configuration for the Orisha unikernel (MBEDTLS_CONFIG_FILE): a TLS
 * 1.3 server (and TLS 1.2, cheap once the same primitives are in), nothing
 * else. Built freestanding from Debian's source package (fetch-mbedtls.sh):
 *   - key exchange ECDHE over x25519 and secp256r1; certificates with ECDSA
 *     (P-256/P-384) or RSA keys (PKCS#1 v1.5 and PSS signatures);
 *   - AES-GCM and ChaCha20-Poly1305; SHA-256 and SHA-384;
 *   - no file system, sockets, threads, session cache or client side;
 *   - memory from a heap carved once from the kernel's arena
 *     (memory_buffer_alloc), randomness from RDSEED/RDRAND and virtio-rng, each
 *     a strong entropy source when the machine has it (tls.c adds them to PSA's
 *     entropy context: no default sources here), feeding PSA's DRBG, time from
 *     the kernel's clocks (tls.c).
 * The PSA_WANT_* set follows from these legacy options (no PSA config file).
 */
#ifndef ORISHA_MBEDTLS_CONFIG_H
#define ORISHA_MBEDTLS_CONFIG_H

#include <stddef.h>
/* The kernel's functions the options below name (platform.h, tls.c). */
int platform_snprintf(char *buf, size_t size, const char *fmt, ...);
void platform_printf(const char *fmt, ...);
void platform_panic(const char *file, int line, const char *fmt, ...) __attribute__((noreturn));
long long tls_time(long long *t);

/* Platform. */
#define MBEDTLS_HAVE_ASM
#define MBEDTLS_NO_UDBL_DIVISION /* no libgcc: 128-bit division would need __udivti3 */
#define MBEDTLS_HAVE_TIME
#define MBEDTLS_PLATFORM_C
#define MBEDTLS_PLATFORM_MEMORY
#define MBEDTLS_PLATFORM_NO_STD_FUNCTIONS
#define MBEDTLS_PLATFORM_TIME_TYPE_MACRO long long
#define MBEDTLS_PLATFORM_MS_TIME_TYPE_MACRO long long
#define MBEDTLS_PLATFORM_TIME_MACRO tls_time
#define MBEDTLS_PLATFORM_MS_TIME_ALT
#define MBEDTLS_PRINTF_MS_TIME "lld"
#define MBEDTLS_PLATFORM_SNPRINTF_MACRO platform_snprintf
#define MBEDTLS_PLATFORM_PRINTF_MACRO platform_printf
#define MBEDTLS_PLATFORM_SETBUF_MACRO(s, b) ((void)(s), (void)(b))
#define MBEDTLS_PLATFORM_EXIT_MACRO(code) platform_panic(__FILE__, __LINE__, "mbedtls exit %d", (code))
#define MBEDTLS_MEMORY_BUFFER_ALLOC_C
#define MBEDTLS_NO_PLATFORM_ENTROPY
#define MBEDTLS_NO_DEFAULT_ENTROPY_SOURCES /* tls.c adds the ones the machine has */
#define MBEDTLS_ENTROPY_C
#define MBEDTLS_CTR_DRBG_C
#define MBEDTLS_PSA_CRYPTO_C
#define MBEDTLS_USE_PSA_CRYPTO
#define MBEDTLS_PSA_KEY_STORE_DYNAMIC

/* Numbers and curves. */
#define MBEDTLS_BIGNUM_C
#define MBEDTLS_ECP_C
#define MBEDTLS_ECP_DP_SECP256R1_ENABLED
#define MBEDTLS_ECP_DP_SECP384R1_ENABLED
#define MBEDTLS_ECP_DP_CURVE25519_ENABLED
#define MBEDTLS_ECP_NIST_OPTIM
#define MBEDTLS_ECDH_C
#define MBEDTLS_ECDSA_C
#define MBEDTLS_RSA_C
#define MBEDTLS_PKCS1_V15
#define MBEDTLS_PKCS1_V21
#define MBEDTLS_GENPRIME /* PSA's RSA key import checks need it compiled in */

/* Symmetric. */
#define MBEDTLS_AES_C
#define MBEDTLS_AES_FEWER_TABLES
/* AES-NI and PCLMULQDQ (checked with CPUID at run time; the software tables
 * remain the fallback): software AES-GCM ran at 3 MB/s here, ChaCha20 at 30.
 * mbedTLS's inline-assembly variant names the xmm registers itself, so the
 * kernel's -mgeneral-regs-only stands; cpu.c turns SSE on (CR4.OSFXSR). */
#define MBEDTLS_AESNI_C
#define MBEDTLS_GCM_C
#define MBEDTLS_CHACHA20_C
#define MBEDTLS_POLY1305_C
#define MBEDTLS_CHACHAPOLY_C
#define MBEDTLS_CIPHER_C
#define MBEDTLS_MD_C
#define MBEDTLS_SHA224_C /* SHA-256's code also answers SHA-224; the config wants both */
#define MBEDTLS_SHA256_C
#define MBEDTLS_SHA384_C
#define MBEDTLS_SHA512_C
#define MBEDTLS_HKDF_C

/* Keys and certificates (DER or PEM, handed over from the site image). */
#define MBEDTLS_ASN1_PARSE_C
#define MBEDTLS_ASN1_WRITE_C
#define MBEDTLS_OID_C
#define MBEDTLS_PK_C
#define MBEDTLS_PK_PARSE_C
#define MBEDTLS_PK_WRITE_C
#define MBEDTLS_PEM_PARSE_C
#define MBEDTLS_BASE64_C
#define MBEDTLS_X509_USE_C
#define MBEDTLS_X509_CRT_PARSE_C
/* Without it mbedTLS's default signature list has no rsa_pss_rsae_*: no TLS 1.3 with RSA keys. */
#define MBEDTLS_X509_RSASSA_PSS_SUPPORT

/* TLS. */
#define MBEDTLS_SSL_TLS_C
#define MBEDTLS_SSL_SRV_C
#define MBEDTLS_SSL_PROTO_TLS1_3
#define MBEDTLS_SSL_PROTO_TLS1_2
#define MBEDTLS_SSL_TLS1_3_COMPATIBILITY_MODE
#define MBEDTLS_SSL_TLS1_3_KEY_EXCHANGE_MODE_EPHEMERAL_ENABLED
#define MBEDTLS_KEY_EXCHANGE_ECDHE_ECDSA_ENABLED
#define MBEDTLS_KEY_EXCHANGE_ECDHE_RSA_ENABLED
#define MBEDTLS_SSL_KEEP_PEER_CERTIFICATE /* required by the TLS 1.3 code */
#define MBEDTLS_SSL_SERVER_NAME_INDICATION
#define MBEDTLS_SSL_ALPN
#define MBEDTLS_SSL_EXTENDED_MASTER_SECRET
#define MBEDTLS_SSL_ENCRYPT_THEN_MAC
/* Records up to the protocol's 16 KiB both ways: a client may send full-size
 * records, and large ones cost the least per byte sent. */
#define MBEDTLS_SSL_IN_CONTENT_LEN  16384
#define MBEDTLS_SSL_OUT_CONTENT_LEN 16384
#define MBEDTLS_SSL_MAX_EARLY_DATA_SIZE 0

#endif
