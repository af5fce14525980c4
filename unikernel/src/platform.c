/*
 * Boot and the platform's services: the PVH start info, the command line, the
 * arena, panic and exit. Boot ends by calling the application's main() in
 * ring 3 (main.c), whose return value leaves QEMU; nothing here knows what the
 * application is.
 */
#include <stdint.h>
#include <string.h>
#include "platform.h"
#include "boot.h"
#include "serial.h"
#include "io.h"

#define HVM_START_MAGIC 0x336ec578u
#define DEBUG_EXIT_PORT 0xf4
#define ARENA_SIZE (2u * 1024 * 1024)

struct hvm_start_info {
    uint32_t magic;
    uint32_t version;
    uint32_t flags;
    uint32_t nr_modules;
    uint64_t modlist_paddr;
    uint64_t cmdline_paddr;
    uint64_t rsdp_paddr;
    uint64_t memmap_paddr;     /* version >= 1 */
    uint32_t memmap_entries;
    uint32_t reserved;
};

struct hvm_memmap_entry {
    uint64_t addr;
    uint64_t size;
    uint32_t type;
    uint32_t reserved;
};

/* Embedded site blob (.incbin, see the Makefile). */
extern const uint8_t platform_site_start[];
extern const uint8_t platform_site_end[];

/*
 * The arena lives in the platform's bss, which every core maps alike (linker.ld).
 * QEMU hands us zeroed RAM, and under KVM the first touch of every page costs an
 * EPT fault, so bss is deliberately not cleared.
 */
static uint8_t arena[ARENA_SIZE] __attribute__((aligned(4096)));
static size_t arena_used;
/* The RAM above the loaded image (bss included), from the PVH memory map: the
 * tables sized from the guest's memory (--memory) are carved from it. */
extern uint8_t __image_end[];
static uintptr_t ram_next PLATFORM_PRIVATE, ram_end PLATFORM_PRIVATE;
static unsigned this_cpu PLATFORM_PRIVATE;
static const char *cmdline = "";

static int in_panic;
static int verbose;
static uint32_t boot_info_paddr;

/* isa-debug-exit: QEMU exits with status (code << 1) | 1. */
static void __attribute__((noreturn)) exit_qemu(uint8_t code)
{
    outl(DEBUG_EXIT_PORT, code);
    /* No isa-debug-exit device: stop here (we may be in ring 3: no hlt). */
    for (;;)
        cpu_relax();
}

void platform_panic(const char *file, int line, const char *fmt, ...)
{
    if (!in_panic) {
        in_panic = 1;
        char buf[256];
        va_list ap;
        va_start(ap, fmt);
        platform_vsnprintf(buf, sizeof buf, fmt, ap);
        va_end(ap);
        platform_printf("PANIC at %s:%d: %s\n", file, line, buf);
    }
    exit_qemu(0x7f);
}

int platform_verbose(void)
{
    return verbose;
}

const char *platform_cmdline(void)
{
    return cmdline;
}

void *platform_arena_alloc(size_t size, size_t align)
{
    static int lock;
    ASSERT(align && (align & (align - 1)) == 0);
    while (__atomic_exchange_n(&lock, 1, __ATOMIC_ACQUIRE))
        cpu_relax();
    size_t off = (arena_used + align - 1) & ~(align - 1);
    if (off + size > ARENA_SIZE)
        PANIC("arena exhausted: want %zu, used %zu of %u", size, arena_used, ARENA_SIZE);
    arena_used = off + size;
    __atomic_store_n(&lock, 0, __ATOMIC_RELEASE);
    return arena + off;
}

int platform_is_shared(const void *p, size_t len)
{
    uintptr_t a = (uintptr_t)p;
    return a + len >= a && (a + len <= (uintptr_t)__private_start || a >= (uintptr_t)__private_end);
}

unsigned platform_cpu(void)
{
    return this_cpu;
}

void platform_ram_range(uintptr_t *next, uintptr_t *end)
{
    *next = ram_next;
    *end = ram_end;
}

void platform_ram_set(uintptr_t next, uintptr_t end, unsigned cpu)
{
    ram_next = next;
    ram_end = end;
    this_cpu = cpu;
}

size_t platform_ram_left(void)
{
    return ram_end - ram_next;
}

void *platform_ram_alloc(size_t size, size_t align)
{
    ASSERT(align && (align & (align - 1)) == 0);
    uintptr_t p = (ram_next + align - 1) & ~(uintptr_t)(align - 1);
    if (p > ram_end || size > ram_end - p)
        PANIC("guest RAM exhausted: want %zu, %zu left (more --memory)", size,
              (size_t)(ram_end - ram_next));
    ram_next = p + size;
    return (void *)p;
}

const uint8_t *platform_site(size_t *len)
{
    *len = (size_t)(platform_site_end - platform_site_start);
    return platform_site_start;
}

int platform_cmdline_has(const char *word)
{
    size_t n = strlen(word);
    for (const char *p = cmdline; *p; p++) {
        if ((p == cmdline || p[-1] == ' ') && strncmp(p, word, n) == 0 &&
            (p[n] == 0 || p[n] == ' '))
            return 1;
    }
    return 0;
}

int platform_boot_info_within(uintptr_t lo, uintptr_t hi)
{
    const struct hvm_start_info *si = (const void *)(uintptr_t)boot_info_paddr;
    uintptr_t at[] = { boot_info_paddr, (uintptr_t)si->cmdline_paddr,
                       (uintptr_t)si->memmap_paddr };
    size_t len[] = { sizeof *si, strlen(cmdline) + 1,
                     si->memmap_entries * sizeof(struct hvm_memmap_entry) };
    for (size_t i = 0; i < sizeof at / sizeof at[0]; i++)
        if (at[i] && at[i] < hi && at[i] + len[i] > lo)
            return 1;
    return 0;
}

static void parse_start_info(uint32_t paddr)
{
    const struct hvm_start_info *si = (const void *)(uintptr_t)paddr;
    if (!si || si->magic != HVM_START_MAGIC)
        PANIC("bad PVH start info at %#x", paddr);
    if (si->cmdline_paddr)
        cmdline = (const char *)(uintptr_t)si->cmdline_paddr;
    uint64_t ram = 0;
    if (si->version >= 1 && si->memmap_paddr) {
        const struct hvm_memmap_entry *e = (const void *)(uintptr_t)si->memmap_paddr;
        uintptr_t end = (uintptr_t)__image_end;
        for (uint32_t i = 0; i < si->memmap_entries; i++) {
            if (e[i].type != 1)
                continue;
            ram += e[i].size;
            /* The entry holding the image: what lies above it. Only what boot.S maps
             * (the low 3 GiB: the fourth is MMIO) is used. */
            uint64_t top = e[i].addr + e[i].size, limit = 3ull << 30;
            if (e[i].addr <= end && top > end) {
                ram_next = end;
                ram_end = (uintptr_t)(top < limit ? top : limit);
            }
        }
    }
    /* QEMU hands over zeroed RAM; the start info and command line sit below the
     * image (microvm's PVH tables are under 1 MiB), so nothing above it is in use. */
    if (((uintptr_t)si >= ram_next && (uintptr_t)si < ram_end) ||
        (si->cmdline_paddr >= ram_next && si->cmdline_paddr < ram_end) ||
        (si->memmap_paddr >= ram_next && si->memmap_paddr < ram_end))
        PANIC("PVH start info at %#x lies above the image", paddr);
    verbose = platform_cmdline_has("orisha.verbose");
    if (verbose)
        platform_printf("orisha: pvh boot, %u MiB RAM (%u MiB above the image), cmdline \"%s\"\n",
                        (unsigned)(ram >> 20), (unsigned)((ram_end - ram_next) >> 20), cmdline);
}

static void start_app(void) __attribute__((noreturn));

/* Entered from boot.S in ring 0, long mode, identity mapped. */
void platform_main(uint32_t start_info_paddr)
{
    serial_init();
    platform_cpu_init();
    platform_clock_init(); /* may program kvmclock MSRs: ring 0 only */
    boot_info_paddr = start_info_paddr;
    platform_run_in_ring3(start_app);
}

static void start_app(void)
{
    parse_start_info(boot_info_paddr);
    /* Before main: it seeds platform_random (DHCP's transaction id). Under KVM
     * it reads kvmclock, elsewhere a few CMOS ports: no cost worth overlapping. */
    platform_wallclock_init();
    if (verbose)
        platform_printf("orisha: clock %s %lu kHz, unix time %lu, site %zu bytes\n",
                        platform_clock_source(), (unsigned long)(platform_tsc_hz() / 1000),
                        (unsigned long)platform_unix_time(),
                        (size_t)(platform_site_end - platform_site_start));
    platform_smp_prepare(); /* before main: the copies take the application as linked */
    exit_qemu((uint8_t)main());
}
