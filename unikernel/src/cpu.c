/*
 * CPU setup after entering long mode: an IDT whose every exception PANICs,
 * a TSS so exceptions raised in ring 3 land on a kernel stack, and the switch
 * to ring 3. Also the CPU's random number instructions (platform_entropy).
 *
 * Why ring 3: on hosts where "KVM" is a software (PVM, shadow paging)
 * hypervisor, guest ring-0 code is instruction-emulated (~100x slower than
 * TCG) while ring-3 code runs natively. After privileged setup (page tables,
 * MSRs, IDT) nothing needs ring 0: port I/O works at IOPL 3 and MMIO is plain
 * memory access. On hardware-assisted KVM/TCG this costs nothing.
 *
 * More cores (smp.c): the IDT is one table for all; each core gets its own GDT
 * (its TSS descriptor is marked busy by ltr) and TSS (its ring-0 stack: exceptions,
 * and the idle wait, which ring 3 enters by a HLT's #GP: boot.S gp_or_idle), SSE,
 * and its LAPIC enabled with the timer on WAKE_VECTOR, one-shot.
 */
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include "platform.h"
#include "boot.h"
#include "io.h"

struct trap_frame {
    uint64_t vector, error, rip, cs, rflags, rsp, ss;
};

struct tss {
    uint32_t reserved0;
    uint64_t rsp[3];
    uint64_t reserved1;
    uint64_t ist[7];
    uint64_t reserved2;
    uint16_t reserved3;
    uint16_t iomap_base;
    /* All-zero I/O permission bitmap: every port allowed in ring 3 even if
     * the hypervisor checks the bitmap rather than IOPL (PVM does). */
    uint8_t iomap[65536 / 8];
    uint8_t iomap_end; /* must be 0xff */
} __attribute__((packed));

struct idt_gate {
    uint16_t off_lo;
    uint16_t sel;
    uint8_t ist;
    uint8_t type;
    uint16_t off_mid;
    uint32_t off_hi;
    uint32_t reserved;
} __attribute__((packed));

struct desc_ptr {
    uint16_t limit;
    uint64_t base;
} __attribute__((packed));

/* A core's own descriptor tables (the boot processor's in bss, the others' from the
 * RAM above the image: smp.c). */
struct platform_cpu_tables {
    uint64_t gdt[7];
    struct tss tss;
} __attribute__((aligned(16)));

#define GDT_KERNEL_ENTRIES 5 /* null, kernel code/data, user data/code: boot.S's layout */
#define MSR_APIC_BASE 0x1bu
#define APIC_BASE_ENABLE (1u << 11)
#define APIC_BASE_X2APIC (1u << 10)
#define LAPIC_SVR 0xf0
#define LAPIC_LVT_TIMER 0x320
#define LAPIC_TIMER_DIVIDE 0x3e0
#define LAPIC_DIVIDE_BY_1 0xb

extern uint64_t platform_gdt[];
extern const uint64_t platform_trap_stubs[32];
extern const uint8_t platform_wake_interrupt[], platform_spurious_interrupt[],
    platform_device_interrupt[];
void platform_enter_user(void (*fn)(void)) __attribute__((noreturn));
void platform_trap(struct trap_frame *f) __attribute__((noreturn));

static struct platform_cpu_tables boot_tables;
static struct idt_gate idt[256] __attribute__((aligned(16)));
static uint8_t trap_stack[16384] __attribute__((aligned(16)));
uintptr_t platform_lapic;
uint64_t platform_lapic_eoi;

static const char *const trap_names[32] = {
    "divide error", "debug", "NMI", "breakpoint", "overflow", "bound range",
    "invalid opcode", "device not available", "double fault", "coprocessor",
    "invalid TSS", "segment not present", "stack fault", "general protection",
    "page fault", "reserved", "x87 FP", "alignment check", "machine check",
    "SIMD FP", "virtualization", "control protection",
};

void platform_trap(struct trap_frame *f)
{
    uint64_t cr2 = 0;
    if (f->vector == 14)
        __asm__ volatile("mov %%cr2, %0" : "=r"(cr2));
    const char *name = f->vector < 32 && trap_names[f->vector] ? trap_names[f->vector] : "?";
    PANIC("CPU exception %lu (%s) rip %#lx err %#lx cr2 %#lx rsp %#lx cs %#lx",
          (unsigned long)f->vector, name, (unsigned long)f->rip, (unsigned long)f->error,
          (unsigned long)cr2, (unsigned long)f->rsp, (unsigned long)f->cs);
}

/* type 0x8e: present, DPL 0, 64-bit interrupt gate. */
static void set_gate(int vector, uint64_t a, uint8_t type)
{
    idt[vector].off_lo = (uint16_t)a;
    idt[vector].sel = 0x08;
    idt[vector].ist = 0;
    idt[vector].type = type;
    idt[vector].off_mid = (uint16_t)(a >> 16);
    idt[vector].off_hi = (uint32_t)(a >> 32);
    idt[vector].reserved = 0;
}

/* The boot processor, once: the shared IDT, where the LAPIC is, then its own tables. */
void platform_cpu_init(void)
{
    for (int i = 0; i < 32; i++)
        set_gate(i, platform_trap_stubs[i], 0x8e);
    set_gate(WAKE_VECTOR, (uint64_t)(uintptr_t)platform_wake_interrupt, 0x8e);
    set_gate(SPURIOUS_VECTOR, (uint64_t)(uintptr_t)platform_spurious_interrupt, 0x8e);
    set_gate(DEVICE_VECTOR, (uint64_t)(uintptr_t)platform_device_interrupt, 0x8e);
    uint64_t apic = rdmsr(MSR_APIC_BASE);
    /* Reset leaves the xAPIC on in MMIO mode; ring 3 reaches it through the uncached,
     * user-accessible 4th GiB of boot.S's map (x2APIC would need ring-0 MSRs). */
    if (!(apic & APIC_BASE_ENABLE) || (apic & APIC_BASE_X2APIC))
        PANIC("LAPIC not in xAPIC mode (IA32_APIC_BASE %#lx)", (unsigned long)apic);
    platform_lapic = (uintptr_t)(apic & ~0xfffull);
    platform_lapic_eoi = platform_lapic + 0xb0;
    platform_cpu_setup(&boot_tables, trap_stack + sizeof trap_stack);
}

size_t platform_cpu_tables_size(void)
{
    return sizeof(struct platform_cpu_tables);
}

/* Any core, in ring 0: its GDT (the kernel's layout plus its own TSS at 0x28), the
 * shared IDT, its TSS with trap_stack_top for exceptions, SSE, and its LAPIC. The selectors stay those boot.S loaded: same descriptors, new table. */
void platform_cpu_setup(struct platform_cpu_tables *t, void *trap_stack_top)
{
    memcpy(t->gdt, platform_gdt, GDT_KERNEL_ENTRIES * sizeof t->gdt[0]);
    struct desc_ptr gdtr = { sizeof t->gdt - 1, (uint64_t)(uintptr_t)t->gdt };
    struct desc_ptr idtr = { sizeof idt - 1, (uint64_t)(uintptr_t)idt };
    __asm__ volatile("lidt %0" : : "m"(idtr));

    t->tss.rsp[0] = (uint64_t)(uintptr_t)trap_stack_top;
    t->tss.iomap_base = (uint16_t)offsetof(struct tss, iomap);
    t->tss.iomap_end = 0xff;
    uint64_t base = (uint64_t)(uintptr_t)&t->tss;
    uint64_t limit = sizeof t->tss - 1;
    t->gdt[5] = (limit & 0xffff) | ((base & 0xffffff) << 16) | (0x89ull << 40) |
                (((limit >> 16) & 0xf) << 48) | (((base >> 24) & 0xff) << 56);
    t->gdt[6] = base >> 32;
    __asm__ volatile("lgdt %0" : : "m"(gdtr) : "memory");
    __asm__ volatile("ltr %w0" : : "r"(0x28));

    /* SSE on (CR4.OSFXSR, OSXMMEXCPT; CR0.MP set, EM clear): the kernel itself is
     * built -mgeneral-regs-only, but mbedTLS's AES-NI and PCLMULQDQ code (one file,
     * the Makefile's aesni.o) runs in xmm registers, which #UD until the OS says it
     * saves them. Nothing preempts the polling loop, so nothing needs saving. */
    uint64_t cr0, cr4;
    __asm__ volatile("mov %%cr0, %0" : "=r"(cr0));
    __asm__ volatile("mov %0, %%cr0" : : "r"((cr0 & ~(1ull << 2)) | (1ull << 1)));
    __asm__ volatile("mov %%cr4, %0" : "=r"(cr4));
    __asm__ volatile("mov %0, %%cr4" : : "r"(cr4 | (1ull << 9) | (1ull << 10)));

    /* LAPIC software-enabled (an AP's comes out of INIT disabled), its timer one-shot
     * on WAKE_VECTOR at the bus clock: smp.c arms it before the idle HLT. Ring 3 runs
     * with IF=0, so it only ever interrupts an idle HLT. */
    mmio_write32(platform_lapic + LAPIC_SVR, 0x100 | SPURIOUS_VECTOR);
    mmio_write32(platform_lapic + LAPIC_TIMER_DIVIDE, LAPIC_DIVIDE_BY_1);
    mmio_write32(platform_lapic + LAPIC_LVT_TIMER, WAKE_VECTOR);
}

/*
 * Hardware entropy. RDSEED reads the conditioned entropy source itself (for
 * seeding, as here), RDRAND a DRBG reseeded from it; both may come back empty
 * (CF=0) when drained, so each step retries a bounded number of times (Intel's
 * DRNG guide: 10 for RDRAND) and RDSEED falls back to RDRAND. Both run in ring
 * 3. Under KVM with -cpu host and under TCG's -cpu max both exist; CPUID says.
 */
enum { RNG_UNKNOWN, RNG_NONE, RNG_RDRAND, RNG_RDSEED };
static int rng = RNG_UNKNOWN;

static int rng_kind(void)
{
    if (rng == RNG_UNKNOWN) {
        uint32_t r[4];
        cpuid(0, 0, r);
        uint32_t max = r[0];
        cpuid(1, 0, r);
        int rdrand = (r[2] >> 30) & 1;
        int rdseed = 0;
        if (max >= 7) {
            cpuid(7, 0, r);
            rdseed = (r[1] >> 18) & 1;
        }
        rng = rdseed ? RNG_RDSEED : rdrand ? RNG_RDRAND : RNG_NONE;
    }
    return rng;
}

const char *platform_entropy_source(void)
{
    static const char *const names[] = { [RNG_RDRAND] = "rdrand", [RNG_RDSEED] = "rdseed" };
    return names[rng_kind()];
}

static int rdseed64(uint64_t *v)
{
    uint8_t ok;
    for (int i = 0; i < 64; i++) {
        __asm__ volatile("rdseed %0; setc %1" : "=r"(*v), "=qm"(ok));
        if (ok)
            return 1;
        __asm__ volatile("pause");
    }
    return 0;
}

static int rdrand64(uint64_t *v)
{
    uint8_t ok;
    for (int i = 0; i < 10; i++) {
        __asm__ volatile("rdrand %0; setc %1" : "=r"(*v), "=qm"(ok));
        if (ok)
            return 1;
    }
    return 0;
}

int platform_entropy(void *buf, size_t len)
{
    int kind = rng_kind();
    if (kind == RNG_NONE)
        return -1;
    uint8_t *out = buf;
    while (len) {
        uint64_t v;
        if (!(kind == RNG_RDSEED && rdseed64(&v)) && !rdrand64(&v))
            return -1;
        size_t n = len < sizeof v ? len : sizeof v;
        memcpy(out, &v, n);
        out += n;
        len -= n;
    }
    return 0;
}

void platform_run_in_ring3(void (*fn)(void))
{
    platform_enter_user(fn);
}
