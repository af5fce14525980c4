/*
 * HTTP on lwIP's raw TCP API: accepts connections on port 80 and runs the
 * request core (core.h) over them. The image is the site image written by
 * `orisha build --loop unikernel` (orisha/targets/unikernel/image.py); limits come from
 * the kernel command line (orisha.idle_timeout=S, orisha.head_timeout=S,
 * orisha.send_timeout=S, orisha.connections=N, orisha.head=B,
 * orisha.target=B, orisha.body=B).
 */
#ifndef ORISHA_HTTP_H
#define ORISHA_HTTP_H
#include <stddef.h>
#include <stdint.h>
void http_init(const uint8_t *image, size_t len);
uint64_t http_responses(void);
#endif
