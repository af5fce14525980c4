/* Minimal freestanding stdlib.h for the Orisha unikernel (see src/libc.c). */
#ifndef ORISHA_STDLIB_H
#define ORISHA_STDLIB_H
#include <stddef.h>
int atoi(const char *s);
#endif
