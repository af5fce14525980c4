/* Platform services: boot info, logging, panic/assert, arena, clocks, exit. */
#ifndef ORISHA_PLATFORM_H
#define ORISHA_PLATFORM_H
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#define PANIC(...) platform_panic(__FILE__, __LINE__, __VA_ARGS__)
/* Always on, in every build. */
#define ASSERT(c) \
    do { if (__builtin_expect(!(c), 0)) PANIC("assertion failed: %s", #c); } while (0)

void platform_main(uint32_t start_info_paddr) __attribute__((noreturn));
void platform_panic(const char *file, int line, const char *fmt, ...)
    __attribute__((noreturn, format(printf, 3, 4)));
/* Leave QEMU via isa-debug-exit: host exit status is (code << 1) | 1. */
void platform_exit(uint8_t code) __attribute__((noreturn));

void platform_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int platform_vsnprintf(char *buf, size_t size, const char *fmt, va_list ap);
int platform_snprintf(char *buf, size_t size, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* cpu.c: IDT (exceptions PANIC) + TSS; then continue fn() in ring 3, IOPL 3. */
void platform_cpu_init(void);
void platform_run_in_ring3(void (*fn)(void)) __attribute__((noreturn));

/* Kernel command line ("" if none). Options: orisha.verbose (more boot log),
 * orisha.exit=ready (leave QEMU once serving; for boot-time measurements). */
const char *platform_cmdline(void);
int platform_verbose(void);

/* Bump allocator over a fixed bss arena; never freed. align: power of 2. */
void *platform_arena_alloc(size_t size, size_t align);
size_t platform_arena_used(void);

/* Clocks (clock.c). clock_init may touch MSRs (ring 0); wallclock_init reads
 * the CMOS RTC (any ring). */
void platform_clock_init(void);
void platform_wallclock_init(void);
void platform_wallclock_poll(void);    /* from the main loop: finds the RTC's second edge */
uint64_t platform_tsc_hz(void);
uint64_t platform_now_ns(void);        /* monotonic since boot */
uint32_t platform_now_ms(void);
uint64_t platform_unix_time(void);     /* wall clock, seconds (CMOS RTC) */
const char *platform_clock_source(void);
uint32_t platform_random(void);

#endif
