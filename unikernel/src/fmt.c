/* Small printf-style formatter: %d %i %u %x %X %p %s %c %%, flags '0' '-' '#',
 * width, precision for %s (digits or '*'), length modifiers l ll z; and the
 * console log built on it. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include "platform.h"
#include "boot.h"
#include "serial.h"

struct out {
    char *buf;
    size_t size;
    size_t len;
};

static void out_c(struct out *o, char c)
{
    if (o->len + 1 < o->size)
        o->buf[o->len] = c;
    o->len++;
}

static void out_pad(struct out *o, char c, int n)
{
    while (n-- > 0)
        out_c(o, c);
}

static void out_num(struct out *o, uint64_t v, int neg, unsigned base, int upper,
                    int width, int zero, int left)
{
    char tmp[24];
    const char *digits = upper ? "0123456789ABCDEF" : "0123456789abcdef";
    int n = 0;
    do {
        tmp[n++] = digits[v % base];
        v /= base;
    } while (v);
    int len = n + (neg ? 1 : 0);
    if (!left && !zero)
        out_pad(o, ' ', width - len);
    if (neg)
        out_c(o, '-');
    if (!left && zero)
        out_pad(o, '0', width - len);
    while (n)
        out_c(o, tmp[--n]);
    if (left)
        out_pad(o, ' ', width - len);
}

/* A width or precision: decimal digits, or '*' for the next int argument. */
static int field(const char **fmt, va_list *args)
{
    if (**fmt == '*') {
        (*fmt)++;
        return va_arg(*args, int);
    }
    int n = 0;
    while (**fmt >= '0' && **fmt <= '9')
        n = n * 10 + (*(*fmt)++ - '0');
    return n;
}

int platform_vsnprintf(char *buf, size_t size, const char *fmt, va_list ap)
{
    struct out o = { buf, size, 0 };
    va_list args; /* a copy the helpers can take the address of (va_list may be an array) */
    va_copy(args, ap);
    for (; *fmt; fmt++) {
        if (*fmt != '%') {
            out_c(&o, *fmt);
            continue;
        }
        fmt++;
        int zero = 0, left = 0, alt = 0, width = 0, prec = -1, lng = 0;
        for (;; fmt++) {
            if (*fmt == '0') zero = 1;
            else if (*fmt == '-') left = 1;
            else if (*fmt == '#') alt = 1;
            else break;
        }
        width = field(&fmt, &args);
        if (*fmt == '.') {
            fmt++;
            prec = field(&fmt, &args);
        }
        while (*fmt == 'l' || *fmt == 'z') {
            lng++;
            fmt++;
        }
        switch (*fmt) {
        case 'd':
        case 'i': {
            int64_t v = lng ? va_arg(args, int64_t) : va_arg(args, int);
            out_num(&o, v < 0 ? (uint64_t)-v : (uint64_t)v, v < 0, 10, 0, width, zero, left);
            break;
        }
        case 'u':
        case 'x':
        case 'X': {
            uint64_t v = lng ? va_arg(args, uint64_t) : va_arg(args, unsigned);
            if (alt && *fmt != 'u') {
                out_c(&o, '0');
                out_c(&o, 'x');
            }
            out_num(&o, v, 0, *fmt == 'u' ? 10 : 16, *fmt == 'X', width, zero, left);
            break;
        }
        case 'p':
            out_c(&o, '0');
            out_c(&o, 'x');
            out_num(&o, (uintptr_t)va_arg(args, void *), 0, 16, 0, width, zero, left);
            break;
        case 's': {
            const char *s = va_arg(args, const char *);
            if (!s)
                s = "(null)";
            int n = 0;
            while (s[n] && (prec < 0 || n < prec))
                n++;
            if (!left)
                out_pad(&o, ' ', width - n);
            for (int i = 0; i < n; i++)
                out_c(&o, s[i]);
            if (left)
                out_pad(&o, ' ', width - n);
            break;
        }
        case 'c':
            out_c(&o, (char)va_arg(args, int));
            break;
        case '%':
            out_c(&o, '%');
            break;
        case 0:
            fmt--;
            break;
        default:
            out_c(&o, '%');
            out_c(&o, *fmt);
            break;
        }
    }
    va_end(args);
    if (size)
        buf[o.len < size ? o.len : size - 1] = 0;
    return (int)o.len;
}

int platform_snprintf(char *buf, size_t size, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = platform_vsnprintf(buf, size, fmt, ap);
    va_end(ap);
    return n;
}

/* Console output; every line starts with "[seconds.millis] " since boot. One core
 * at a time writes (a spin lock: a line costs milliseconds here, so it is formatted
 * before the lock is taken). */
void platform_printf(const char *fmt, ...)
{
    static int at_line_start = 1;
    static int lock;
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = platform_vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof buf - 1)
        n = sizeof buf - 1;
    while (__atomic_exchange_n(&lock, 1, __ATOMIC_ACQUIRE))
        __asm__ volatile("pause");
    int start = 0;
    for (int i = 0; i < n; i++) {
        if (at_line_start && buf[i] != '\n') {
            char ts[24];
            uint32_t ms = platform_now_ms();
            int t = platform_snprintf(ts, sizeof ts, "[%4u.%03u] ", ms / 1000, ms % 1000);
            serial_write(buf + start, (size_t)(i - start));
            serial_write(ts, (size_t)t);
            start = i;
        }
        at_line_start = buf[i] == '\n';
    }
    serial_write(buf + start, (size_t)(n - start));
    __atomic_store_n(&lock, 0, __ATOMIC_RELEASE);
}
