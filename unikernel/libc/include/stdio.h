/* Placeholder: the unikernel has no stdio; logging is platform_printf(). */
#ifndef ORISHA_STDIO_H
#define ORISHA_STDIO_H
#include <stddef.h>
#endif
