/* COM1 16550 UART console. */
#ifndef ORISHA_SERIAL_H
#define ORISHA_SERIAL_H
#include <stddef.h>
void serial_init(void);
void serial_write(const char *s, size_t n);
#endif
