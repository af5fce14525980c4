/* lwIP compiler/platform glue for the Orisha unikernel (x86-64, freestanding). */
#ifndef ORISHA_LWIP_ARCH_CC_H
#define ORISHA_LWIP_ARCH_CC_H

#include <stdint.h>
#include <stddef.h>

#define LWIP_NO_INTTYPES_H 1
#define LWIP_NO_CTYPE_H 1
#define LWIP_NO_UNISTD_H 1

#define U16_F "u"
#define S16_F "d"
#define X16_F "x"
#define U32_F "u"
#define S32_F "d"
#define X32_F "x"
#define SZT_F "zu"
#define X8_F  "02x"

#define BYTE_ORDER LITTLE_ENDIAN

/* Provided by the platform; declared here to keep lwIP free of our headers. */
void platform_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void platform_panic(const char *file, int line, const char *fmt, ...)
    __attribute__((noreturn, format(printf, 3, 4)));
uint32_t platform_random(void);

#define LWIP_PLATFORM_DIAG(x) do { platform_printf x; } while (0)
#define LWIP_PLATFORM_ASSERT(x) platform_panic(__FILE__, __LINE__, "lwIP assert: %s", x)
#define LWIP_RAND() (platform_random())

#endif
