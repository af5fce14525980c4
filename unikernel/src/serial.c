/* COM1 16550 UART: the console. Output is the log; input carries the host's
 * commands (`orisha boot` writes them to QEMU's stdin, see main.c). */
#include "serial.h"
#include "platform.h"
#include "io.h"

#define COM1 0x3f8
#define LSR_DATA_READY 0x01

void serial_init(void)
{
    outb(COM1 + 1, 0x00);   /* no interrupts */
    outb(COM1 + 3, 0x80);   /* DLAB */
    outb(COM1 + 0, 0x01);   /* 115200 baud */
    outb(COM1 + 1, 0x00);
    outb(COM1 + 3, 0x03);   /* 8N1 */
    outb(COM1 + 2, 0xc7);   /* FIFO on, cleared */
    outb(COM1 + 4, 0x03);   /* DTR | RTS */
}

/*
 * QEMU's emulated 16550 transmits synchronously, so the transmitter is always
 * empty and we do not poll LSR. Each port access is a VM exit (expensive,
 * especially nested), but KVM batches a "rep outsb" into a single exit to
 * QEMU, so output goes out in chunks.
 */
static void serial_out(const char *s, size_t n)
{
    __asm__ volatile("rep outsb" : "+S"(s), "+c"(n) : "d"((uint16_t)COM1) : "memory");
}

void serial_write(const char *s, size_t n)
{
    char buf[256];
    size_t len = 0;
    for (size_t i = 0; i < n; i++) {
        if (len + 2 > sizeof buf) {
            serial_out(buf, len);
            len = 0;
        }
        if (s[i] == '\n')
            buf[len++] = '\r';
        buf[len++] = s[i];
    }
    if (len)
        serial_out(buf, len);
}

int platform_console_getc(void)
{
    if (!(inb(COM1 + 5) & LSR_DATA_READY))
        return -1;
    return inb(COM1);
}
