/* time.h for mbedTLS: the type names its headers mention. Time itself comes
 * from the kernel's clocks (MBEDTLS_PLATFORM_TIME_MACRO, tls.c). */
#ifndef ORISHA_MBEDTLS_TIME_H
#define ORISHA_MBEDTLS_TIME_H
typedef long long time_t;
struct tm {
    int tm_sec, tm_min, tm_hour, tm_mday, tm_mon, tm_year, tm_wday, tm_yday, tm_isdst;
};
#endif
