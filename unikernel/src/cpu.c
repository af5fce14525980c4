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
 */
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include "platform.h"
#include "boot.h"

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

extern uint64_t platform_gdt[];
extern const uint64_t platform_trap_stubs[32];
void platform_enter_user(void (*fn)(void)) __attribute__((noreturn));
void platform_trap(struct trap_frame *f) __attribute__((noreturn));

static struct tss tss __attribute__((aligned(16)));
static struct idt_gate idt[32] __attribute__((aligned(16)));
static uint8_t trap_stack[16384] __attribute__((aligned(16)));

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

void platform_cpu_init(void)
{
    for (int i = 0; i < 32; i++) {
        uint64_t a = platform_trap_stubs[i];
        idt[i].off_lo = (uint16_t)a;
        idt[i].sel = 0x08;
        idt[i].ist = 0;
        idt[i].type = 0x8e; /* present, DPL 0, 64-bit interrupt gate */
        idt[i].off_mid = (uint16_t)(a >> 16);
        idt[i].off_hi = (uint32_t)(a >> 32);
        idt[i].reserved = 0;
    }
    struct desc_ptr idtr = { sizeof idt - 1, (uint64_t)(uintptr_t)idt };
    __asm__ volatile("lidt %0" : : "m"(idtr));

    tss.rsp[0] = (uint64_t)(uintptr_t)(trap_stack + sizeof trap_stack);
    tss.iomap_base = (uint16_t)offsetof(struct tss, iomap);
    tss.iomap_end = 0xff;
    uint64_t base = (uint64_t)(uintptr_t)&tss;
    uint64_t limit = sizeof tss - 1;
    platform_gdt[5] = (limit & 0xffff) | ((base & 0xffffff) << 16) | (0x89ull << 40) |
                      (((limit >> 16) & 0xf) << 48) | (((base >> 24) & 0xff) << 56);
    platform_gdt[6] = base >> 32;
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

static void cpuid(uint32_t leaf, uint32_t sub, uint32_t r[4])
{
    __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
}

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
