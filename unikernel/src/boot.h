/* What the platform's own files share (boot.S, platform.c, cpu.c, clock.c,
 * fmt.c, smp.c); the application includes platform.h only. */
#ifndef ORISHA_BOOT_H
#define ORISHA_BOOT_H

/* The application processors' real-mode trampoline (boot.S, copied by smp.c): a page
 * below 1 MiB, its SIPI vector AP_BASE >> 12. */
#define AP_BASE 0x8000
/* Interrupt vectors (cpu.c's IDT): the LAPIC timer and the wake IPI share one; the
 * LAPIC's spurious one. (Ring 3 reaches the idle wait through a HLT's #GP, not INT n
 * or SYSCALL, which this host's PVM does not take into guest ring 0: boot.S.) */
#define WAKE_VECTOR 0x40
#define DEVICE_VECTOR 0x41 /* a device's interrupt (platform_irq_to_core0): a wake, counted */
#define SPURIOUS_VECTOR 0xff

#ifndef __ASSEMBLER__
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

/* The platform's state is shared by every core (linker.ld); a platform variable that
 * must be per core (zero-initialised) is marked PLATFORM_PRIVATE. */
#define PLATFORM_PRIVATE __attribute__((section(".private")))
extern uint8_t __private_start[], __private_data_end[], __private_end[];
extern uint8_t __shared_start[], __shared_end[];

/* Entered from boot.S in ring 0, long mode, identity mapped. */
void platform_main(uint32_t start_info_paddr) __attribute__((noreturn));

/* cpu.c: IDT (exceptions PANIC but a ring-3 HLT's #GP, the wake interrupt) + TSS; then
 * continue fn() in ring 3, IOPL 3. platform_cpu_init on the boot processor builds the
 * shared IDT; platform_cpu_setup(cpu, ...) gives a core its own GDT and TSS (its
 * ring-0 stack) and turns on SSE and its LAPIC. */
void platform_cpu_init(void);
struct platform_cpu_tables;
size_t platform_cpu_tables_size(void);
void platform_cpu_setup(struct platform_cpu_tables *t, void *trap_stack_top);
void platform_run_in_ring3(void (*fn)(void)) __attribute__((noreturn));

/* smp.c: the AP that is starting, its stack (read by boot.S's ap_long_entry), and its
 * C entry in ring 0; the LAPIC's EOI register (boot.S's wake interrupt). */
extern volatile uint64_t platform_ap_stack;
extern volatile uint32_t platform_ap_cpu;
extern uint64_t platform_lapic_eoi;
void platform_ap_main(uint32_t cpu) __attribute__((noreturn));
/* The LAPIC (xAPIC MMIO) at IA32_APIC_BASE, read in ring 0 by platform_cpu_init. */
extern uintptr_t platform_lapic;

/* clock.c: clock_init may touch MSRs (ring 0); wallclock_init may read the
 * CMOS RTC (any ring). */
void platform_clock_init(void);
void platform_wallclock_init(void);
const char *platform_clock_source(void);

int platform_vsnprintf(char *buf, size_t size, const char *fmt, va_list ap);

/* platform.c: whether [lo, hi) holds anything the PVH start info points at; this
 * core's share of the RAM above the image (smp.c splits it, each core sets its own). */
int platform_boot_info_within(uintptr_t lo, uintptr_t hi);
void platform_ram_range(uintptr_t *next, uintptr_t *end);
void platform_ram_set(uintptr_t next, uintptr_t end, unsigned cpu);
/* smp.c, before main(): each further core's private copy of the application's .data
 * (still as linked: main has not run) and page tables; the RAM split between cores. */
void platform_smp_prepare(void);

#endif
#endif
