/* assert() for mbedTLS, always on as the kernel's own ASSERT (platform.h). */
#ifndef ORISHA_MBEDTLS_ASSERT_H
#define ORISHA_MBEDTLS_ASSERT_H
void platform_panic(const char *file, int line, const char *fmt, ...)
    __attribute__((noreturn, format(printf, 3, 4)));
#define assert(c) \
    do { if (__builtin_expect(!(c), 0)) platform_panic(__FILE__, __LINE__, "mbedtls assert: %s", #c); } while (0)
#ifndef static_assert
#define static_assert _Static_assert
#endif
#endif
