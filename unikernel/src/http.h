/*
 * HTTP on lwIP's raw TCP API. For now: every complete request head gets the
 * embedded site blob as a 200 response (keep-alive, pipelining-safe).
 * Platform-independent apart from platform_unix_time()/platform_printf().
 */
#ifndef ORISHA_HTTP_H
#define ORISHA_HTTP_H
#include <stddef.h>
#include <stdint.h>
void http_init(const uint8_t *body, size_t len);
#endif
