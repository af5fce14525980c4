/*
 * More cores: starting the application processors, and letting an idle core wait.
 *
 * Strategy: microvm has no ACPI, so no MADT lists the processors; `orisha boot
 * --cpus N` puts orisha.cpus=N on the command line and QEMU numbers the LAPICs of
 * -smp N from 0 to N-1 (one socket per vCPU, no threads), which are the ids the
 * INIT and SIPI messages go to. Core 0 does it all from ring 3 (the LAPIC is plain
 * uncached MMIO in boot.S's map): it copies boot.S's real-mode trampoline to AP_BASE,
 * and for one AP at a time sets aside a stack, a ring-0 stack and descriptor tables
 * from the RAM above the image, sends INIT, SIPI, SIPI (Intel SDM Vol. 3 §8.4.4.1,
 * with Linux's short delays for CPUs that need no 10 ms after INIT: a virtual one
 * never does), and waits, bounded, until the AP reports from ring 3. An AP that does
 * not report in time is left out with one line; the cores after it are not tried.
 *
 * Waiting without spinning: ring 3 cannot HLT, so an idle core arms its LAPIC timer
 * (one-shot, calibrated against the TSC at start) and executes HLT; the #GP that
 * raises in ring 3 HLTs in ring 0 until that timer or a wake IPI (platform_wake)
 * comes (boot.S gp_or_idle).
 */
#include <stdint.h>
#include <string.h>
#include "platform.h"
#include "boot.h"
#include "io.h"
#include "policy.h"

#define LAPIC_ID 0x20
#define LAPIC_ICR_LO 0x300
#define LAPIC_ICR_HI 0x310
#define LAPIC_TIMER_INIT 0x380
#define LAPIC_TIMER_COUNT 0x390
#define ICR_PENDING (1u << 12)
#define ICR_ASSERT (1u << 14)
#define ICR_INIT 0x500u
#define ICR_STARTUP 0x600u
#define AP_STACK (64 * 1024)      /* as the boot processor's (boot.S STACK_SIZE) */
#define AP_TRAP_STACK (16 * 1024) /* as cpu.c's trap_stack */
#define AP_START_MS 1000          /* generous: ring 0 is instruction-emulated on some hosts */
#define CALIBRATE_NS 200000ull

#define PAGE_2M (2u << 20)
#define PTE_P_RW_US 0x7ull
#define PTE_BIG 0x80ull        /* PS: a 2 MiB page in a PD */
#define PTE_UNCACHED 0x18ull   /* PWT | PCD, for the MMIO at the top of the 4th GiB */
#define MMIO_START 0xfe000000ull

extern const uint8_t platform_ap_trampoline[], platform_ap_trampoline_end[];

/* What core 0 prepared for each AP (platform_smp_prepare); all of this file's state is
 * the platform's, mapped alike on every core (linker.ld). */
struct ap {
    uint64_t cr3;                       /* its page tables: its private copy mapped in */
    struct platform_cpu_tables *tables;
    void *trap_stack_top, *stack_top;
    uintptr_t ram_next, ram_end;        /* its share of the RAM above the image */
};

volatile uint64_t platform_ap_stack;
volatile uint32_t platform_ap_cpu;
static struct ap aps[POLICY_CPUS_MAX];
static unsigned asked = 1;
static volatile uint32_t ap_reported; /* the last AP that reached ring 3 */
static void (*ap_entry)(unsigned cpu);
static uint32_t timer_ticks_per_us;
static unsigned online = 1;

static uint32_t lapic_read(uint32_t reg)
{
    return mmio_read32(platform_lapic + reg);
}

static void lapic_write(uint32_t reg, uint32_t v)
{
    mmio_write32(platform_lapic + reg, v);
}

/* orisha.cpus=N (default 1), within 1..POLICY_CPUS_MAX as `orisha boot` checks it. */
static unsigned cpus_asked(void)
{
    const char *cmd = platform_cmdline(), *key = "orisha.cpus=";
    for (const char *p = cmd; *p; p++) {
        if ((p != cmd && p[-1] != ' ') || strncmp(p, key, strlen(key)) != 0)
            continue;
        unsigned n = 0;
        const char *v = p + strlen(key);
        while (*v >= '0' && *v <= '9' && n <= POLICY_CPUS_MAX)
            n = n * 10 + (unsigned)(*v++ - '0');
        if (n >= 1 && n <= POLICY_CPUS_MAX && (*v == 0 || *v == ' '))
            return n;
        platform_printf("orisha: ignoring orisha.cpus (expected 1 to %u)\n", POLICY_CPUS_MAX);
        return 1;
    }
    return 1;
}

static void delay_us(uint32_t us)
{
    uint64_t end = platform_now_ns() + (uint64_t)us * 1000;
    while (platform_now_ns() < end)
        cpu_relax();
}

/* One interprocessor message; 0 if the LAPIC still had it pending after 1 ms. */
static int send_ipi(uint32_t apic_id, uint32_t low)
{
    lapic_write(LAPIC_ICR_HI, apic_id << 24);
    lapic_write(LAPIC_ICR_LO, low);
    uint64_t end = platform_now_ns() + 1000000;
    while (lapic_read(LAPIC_ICR_LO) & ICR_PENDING)
        if (platform_now_ns() > end)
            return 0;
    return 1;
}

/* LAPIC timer ticks per microsecond (KVM and QEMU both model a 1 GHz bus, but that
 * is theirs to change): counted down from the top for CALIBRATE_NS of TSC time. */
static void calibrate_timer(void)
{
    uint64_t t0 = platform_now_ns();
    lapic_write(LAPIC_TIMER_INIT, 0xffffffffu);
    while (platform_now_ns() - t0 < CALIBRATE_NS)
        cpu_relax();
    uint32_t left = lapic_read(LAPIC_TIMER_COUNT);
    uint64_t ns = platform_now_ns() - t0;
    lapic_write(LAPIC_TIMER_INIT, 0);
    uint64_t ticks = (0xffffffffull - left) * 1000 / ns;
    timer_ticks_per_us = ticks ? (uint32_t)ticks : 1;
}

/* Ring 3 on the AP: its RAM share and index (private: this core's copy), report,
 * then the application's entry. */
static void ap_ring3(void)
{
    uint32_t cpu = platform_ap_cpu;
    ASSERT(platform_cpu() == 0); /* a fresh private copy, not core 0's state */
    platform_ram_set(aps[cpu].ram_next, aps[cpu].ram_end, cpu);
    __atomic_store_n(&ap_reported, cpu, __ATOMIC_RELEASE);
    ap_entry(cpu);
    PANIC("cpu %u: the application's entry returned", (unsigned)cpu);
}

/* boot.S's ap_long_entry, ring 0 on the AP's stack: its own page tables (from here on
 * the application's state it sees is its copy), its descriptor tables, then ring 3. */
void platform_ap_main(uint32_t cpu)
{
    __asm__ volatile("mov %0, %%cr3" : : "r"(aps[cpu].cr3) : "memory");
    platform_cpu_setup(aps[cpu].tables, aps[cpu].trap_stack_top);
    platform_run_in_ring3(ap_ring3);
}

/* Start AP `cpu`; 1 once it reported from ring 3 within AP_START_MS. */
static int start_ap(uint32_t cpu)
{
    platform_ap_stack = (uint64_t)(uintptr_t)aps[cpu].stack_top;
    platform_ap_cpu = cpu;
    memory_barrier();
    if (!send_ipi(cpu, ICR_INIT | ICR_ASSERT))
        return 0;
    delay_us(100);
    for (int i = 0; i < 2; i++) { /* the second SIPI is ignored by an AP that took the first */
        if (!send_ipi(cpu, ICR_STARTUP | ICR_ASSERT | (AP_BASE >> 12)))
            return 0;
        delay_us(200);
    }
    uint32_t t0 = platform_now_ms();
    while (__atomic_load_n(&ap_reported, __ATOMIC_ACQUIRE) != cpu)
        if (platform_now_ms() - t0 > AP_START_MS)
            return 0;
        else
            cpu_relax();
    return 1;
}

/* An identity map of the low 4 GiB in 2 MiB pages (boot.S's, MMIO uncached) but for
 * the application's private range, which goes to `copy`. */
static uint64_t page_tables(uintptr_t copy)
{
    uint64_t *pml4 = platform_ram_alloc(6 * 4096, 4096), *pdpt = pml4 + 512, *pd = pml4 + 1024;
    pml4[0] = (uint64_t)(uintptr_t)pdpt | PTE_P_RW_US;
    for (uint64_t g = 0; g < 4; g++)
        pdpt[g] = (uint64_t)(uintptr_t)(pd + g * 512) | PTE_P_RW_US;
    for (uint64_t i = 0; i < 4 * 512; i++) {
        uint64_t a = i * PAGE_2M;
        pd[i] = a | PTE_P_RW_US | PTE_BIG | (a >= MMIO_START ? PTE_UNCACHED : 0);
    }
    for (uintptr_t a = (uintptr_t)__private_start; a < (uintptr_t)__private_end; a += PAGE_2M)
        pd[a / PAGE_2M] = (copy + (a - (uintptr_t)__private_start)) | PTE_P_RW_US | PTE_BIG;
    return (uint64_t)(uintptr_t)pml4;
}

/* Before main() (platform.c start_app): for each further core a private copy of the
 * application's state as linked (its .data; the .bss part stays as QEMU zeroed it),
 * page tables, stacks and descriptor tables; then the RAM above it all in equal
 * shares, core 0 keeping the first (each core sizes its tables from its own share). */
void platform_smp_prepare(void)
{
    asked = cpus_asked();
    if (asked == 1)
        return;
    size_t private = (size_t)(__private_end - __private_start);
    size_t data = (size_t)(__private_data_end - __private_start);
    for (unsigned cpu = 1; cpu < asked; cpu++) {
        uint8_t *copy = platform_ram_alloc(private, PAGE_2M);
        memcpy(copy, __private_start, data);
        aps[cpu].cr3 = page_tables((uintptr_t)copy);
        aps[cpu].tables = platform_ram_alloc(platform_cpu_tables_size(), 64);
        aps[cpu].trap_stack_top = (uint8_t *)platform_ram_alloc(AP_TRAP_STACK, 16) + AP_TRAP_STACK;
        aps[cpu].stack_top = (uint8_t *)platform_ram_alloc(AP_STACK, 16) + AP_STACK;
    }
    uintptr_t next, end;
    platform_ram_range(&next, &end);
    uintptr_t share = ((end - next) / asked) & ~(uintptr_t)4095;
    for (unsigned cpu = 1; cpu < asked; cpu++) {
        aps[cpu].ram_next = next + cpu * share;
        aps[cpu].ram_end = aps[cpu].ram_next + share;
    }
    platform_ram_set(next, next + share, 0);
}

unsigned platform_start_cpus(void (*entry)(unsigned cpu))
{
    if (asked == 1) {
        calibrate_timer(); /* core 0 naps in HLT on its timer too (net_wait) */
        return online;
    }
    if (platform_boot_info_within(AP_BASE, AP_BASE + 4096))
        PANIC("the PVH start info lies in the AP trampoline's page %#x", AP_BASE);
    size_t len = (size_t)(platform_ap_trampoline_end - platform_ap_trampoline);
    ASSERT(len <= 4096 - 256); /* the page's top is the AP's first stack */
    memcpy((void *)(uintptr_t)AP_BASE, platform_ap_trampoline, len);
    calibrate_timer();
    ap_entry = entry;
    uint32_t self = lapic_read(LAPIC_ID) >> 24;
    ASSERT(self == 0); /* QEMU's boot processor; the APs are 1..N-1 */
    for (unsigned cpu = 1; cpu < asked; cpu++) {
        uint64_t t0 = platform_now_ns();
        int ok = start_ap(cpu);
        if (platform_verbose())
            platform_printf("orisha: cpu %u %s after %lu us\n", cpu, ok ? "online" : "silent",
                            (unsigned long)((platform_now_ns() - t0) / 1000));
        if (!ok) {
            platform_printf("orisha: cpu %u did not start within %u ms: serving on %u of %u\n",
                            cpu, AP_START_MS, online, asked);
            break;
        }
        online++;
    }
    ASSERT(platform_cpu() == 0); /* no AP wrote core 0's private state */
    return online;
}

unsigned platform_cpus_asked(void)
{
    return asked;
}

unsigned platform_cpus(void)
{
    return online;
}

void platform_idle(uint32_t us)
{
    if (!timer_ticks_per_us) { /* one core: nothing calibrated the timer */
        cpu_relax();
        return;
    }
    uint64_t ticks = (uint64_t)us * timer_ticks_per_us;
    lapic_write(LAPIC_TIMER_INIT, ticks > 0xffffffffu ? 0xffffffffu : (uint32_t)ticks);
    __asm__ volatile("hlt" : : : "memory"); /* #GP in ring 3: boot.S gp_or_idle waits */
}

/* The I/O APICs at their standard addresses (no ACPI on microvm to say otherwise):
 * the first's inputs are GSIs 0..23, microvm's second one's (ioapic2) 24..47. */
#define IOAPIC_BASE 0xfec00000u
#define IOAPIC_SECOND (IOAPIC_BASE + 0x10000u)
#define IOAPIC_INPUTS 24u
#define IOAPIC_VERSION 0x01
#define IOAPIC_REDIRECT 0x10 /* entry n: 0x10 + 2n (low: vector, mode, mask), + 1 (high) */

static uint32_t ioapic_read(uintptr_t base, uint32_t reg)
{
    mmio_write32(base, reg);
    return mmio_read32(base + 0x10);
}

static void ioapic_write(uintptr_t base, uint32_t reg, uint32_t v)
{
    mmio_write32(base, reg);
    mmio_write32(base + 0x10, v);
}

int platform_irq_to_core0(uint32_t gsi)
{
    uintptr_t base = gsi < IOAPIC_INPUTS ? IOAPIC_BASE : IOAPIC_SECOND;
    uint32_t input = gsi % IOAPIC_INPUTS;
    uint32_t version = ioapic_read(base, IOAPIC_VERSION);
    if (version == 0xffffffffu || ((version >> 16) & 0xff) < input) /* none, or too few inputs */
        return 0;
    /* Fixed delivery, physical destination (APIC ID 0: core 0), active high, edge
     * triggered (a device's line raised after its driver acknowledged it), unmasked. */
    ioapic_write(base, IOAPIC_REDIRECT + 2 * input + 1, 0);
    ioapic_write(base, IOAPIC_REDIRECT + 2 * input, DEVICE_VECTOR);
    return 1;
}

uint64_t platform_device_irqs; /* boot.S platform_device_interrupt counts them (core 0's) */

uint64_t platform_irqs(void)
{
    return __atomic_load_n(&platform_device_irqs, __ATOMIC_RELAXED);
}

void platform_wake(unsigned cpu)
{
    send_ipi(cpu, WAKE_VECTOR | ICR_ASSERT);
}
