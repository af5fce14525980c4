/* What the platform's own files share (boot.S, platform.c, cpu.c, clock.c,
 * fmt.c); the application includes platform.h only. */
#ifndef ORISHA_BOOT_H
#define ORISHA_BOOT_H
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

/* Entered from boot.S in ring 0, long mode, identity mapped. */
void platform_main(uint32_t start_info_paddr) __attribute__((noreturn));

/* cpu.c: IDT (exceptions PANIC) + TSS; then continue fn() in ring 3, IOPL 3. */
void platform_cpu_init(void);
void platform_run_in_ring3(void (*fn)(void)) __attribute__((noreturn));

/* clock.c: clock_init may touch MSRs (ring 0); wallclock_init may read the
 * CMOS RTC (any ring). */
void platform_clock_init(void);
void platform_wallclock_init(void);
uint64_t platform_tsc_hz(void);
const char *platform_clock_source(void);

int platform_vsnprintf(char *buf, size_t size, const char *fmt, va_list ap);

#endif
