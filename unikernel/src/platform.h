/*
 * The platform's interface to the application (Solo5's shape). platform.c
 * boots the machine (PVH entry, CPU tables, clocks, ring 3) and then calls the
 * application's main(); from then on the application calls the platform, never
 * the other way round. Declarations the platform's own files share are in
 * boot.h.
 */
#ifndef ORISHA_PLATFORM_H
#define ORISHA_PLATFORM_H
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

/* The application (main.c). Its return value leaves QEMU through
 * isa-debug-exit: the host sees status (value << 1) | 1. */
int main(void);

#define PANIC(...) platform_panic(__FILE__, __LINE__, __VA_ARGS__)
/* Always on, in every build. */
#define ASSERT(c) \
    do { if (__builtin_expect(!(c), 0)) PANIC("assertion failed: %s", #c); } while (0)

/* Logs the message and leaves QEMU with status 255. */
void platform_panic(const char *file, int line, const char *fmt, ...)
    __attribute__((noreturn, format(printf, 3, 4)));

/* Console (serial) output; every line starts with "[seconds.millis] ". */
void platform_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int platform_snprintf(char *buf, size_t size, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Console input: the next byte, or -1 if none is waiting. A port read (a VM
 * exit) per call, so poll it every few tens of milliseconds, not per pass. */
int platform_console_getc(void);

/* Kernel command line ("" if none). orisha.verbose: more boot log. */
const char *platform_cmdline(void);
int platform_cmdline_has(const char *word);
int platform_verbose(void);

/* The site image linked into the kernel (see the Makefile). */
const uint8_t *platform_site(size_t *len);

/* Bump allocator over a fixed arena, shared by the cores (for DMA: virtio's rings
 * and buffers); never freed. align: power of 2. */
void *platform_arena_alloc(size_t size, size_t align);
/* The guest's RAM above the image (`orisha boot --memory`): bytes left, and a
 * bump allocator over it (zeroed, never freed; PANICs when it runs out). For
 * tables sized from the machine's memory. */
size_t platform_ram_left(void);
void *platform_ram_alloc(size_t size, size_t align);

/* More cores (smp.c). platform_start_cpus starts the cores `orisha boot --cpus`
 * asked for (orisha.cpus=N) and runs entry(cpu) on each, in ring 3 on a stack of its
 * own, cpu = 1..N-1 (the caller is core 0); it returns how many are online, core 0
 * included (fewer if one did not start: logged). platform_idle(us) waits in ring 0
 * with HLT until `us` have passed or platform_wake(cpu) is sent to this core; a wake
 * sent while the core was busy ends its next wait at once. */
unsigned platform_start_cpus(void (*entry)(unsigned cpu));
unsigned platform_cpus(void);
/* How many `orisha boot --cpus` asked for (known before they start). */
unsigned platform_cpus_asked(void);
/* This core's index: 0 for the boot processor. */
unsigned platform_cpu(void);
/* The application's state (.data, .bss) is per core: each core's page tables map it
 * onto a copy of its own. A variable every core must see alike (a lock, a ring the
 * cores share, what a device reads by DMA) is marked PLATFORM_SHARED (zero-
 * initialised only); platform_is_shared says whether memory is mapped alike, as
 * anything handed to a device must be (virtual = physical there). */
#define PLATFORM_SHARED __attribute__((section(".shared")))
int platform_is_shared(const void *p, size_t len);
void platform_idle(uint32_t us);
void platform_wake(unsigned cpu);
/* A device's interrupt (its I/O APIC input `gsi`) routed to core 0 as a wake: it ends
 * core 0's platform_idle. Edge triggered: the driver lowers the line (acknowledges the
 * device) before it checks for work and waits. 0 if no I/O APIC has that input. */
int platform_irq_to_core0(uint32_t gsi);
/* How many such interrupts core 0 has taken. */
uint64_t platform_irqs(void);

/* Clocks (clock.c). */
uint64_t platform_now_ns(void);        /* monotonic since boot */
uint64_t platform_tsc_hz(void);        /* the TSC's rate: guest cycles per second */
uint32_t platform_now_ms(void);
uint64_t platform_unix_time(void);     /* wall clock, seconds */
void platform_wallclock_poll(void);    /* from the main loop: finds the RTC's second edge */
uint32_t platform_random(void);
/* Hardware entropy (cpu.c: RDSEED, else RDRAND) for keys and seeds: fills
 * buf and returns 0, or -1 when the CPU has none or it stays empty. */
int platform_entropy(void *buf, size_t len);
/* Which instruction platform_entropy uses: "rdseed", "rdrand", or NULL (none). */
const char *platform_entropy_source(void);

#endif
