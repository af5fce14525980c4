/*
 * HTTP on lwIP's raw TCP API: accepts connections on port 80 and runs the
 * request core (core.h) over them. The image is the site image written by
 * `orisha build --loop unikernel` (orisha/targets/unikernel/layout.py); limits come from
 * the kernel command line as orisha.<name>=<value>, one option per limit in
 * POLICY_LIMITS (the generated policy.h: orisha/core/policy.py LIMITS with kernel
 * set, e.g. orisha.head_timeout=S, orisha.body=B).
 */
#ifndef ORISHA_HTTP_H
#define ORISHA_HTTP_H
#include <stddef.h>
#include <stdint.h>
/* Adopt the site image (PANICs on a bad one), read the limits, listen on 80
 * (and TLS on 443 when the kernel has a certificate: then returns 1). */
int http_init(const uint8_t *image, size_t len);
/* Graceful stop: no new connections; each open one ends after its current response. */
void http_stop(void);
/* This core's stats lines now (a stop logs them too; main.c's console "stats"). */
void http_log_stats(void);
/* From the main loop when a pass found no frame: the kernel is not behind (see stale()). */
void http_idle(void);
/* Connections served at once, and slots (served and waiting), as sized from the RAM. */
uint32_t http_table(uint32_t *slots);
/* 1 while connections are open or sent bytes are unacknowledged (0 after a stop: drained). */
int http_busy(void);
#endif
