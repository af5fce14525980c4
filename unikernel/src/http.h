/*
 * HTTP on lwIP's raw TCP API: accepts connections on port 80 and runs the
 * request core (core.h) over them. The image is the site image written by
 * `orisha build --loop unikernel` (orisha/embed/image.py); limits come from
 * the kernel command line (orisha.idle_timeout=S, orisha.head_timeout=S,
 * orisha.send_timeout=S, orisha.max_connections=N, orisha.head_limit=B,
 * orisha.target_limit=B, orisha.body_limit=B).
 */
#ifndef ORISHA_HTTP_H
#define ORISHA_HTTP_H
#include <stddef.h>
#include <stdint.h>
void http_init(const uint8_t *image, size_t len);
uint64_t http_responses(void);
#endif
