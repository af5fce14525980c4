/*
 * Monotonic clock: the TSC, scaled to ns. The TSC rate comes from, in order:
 * kvmclock (KVM publishes its TSC->ns multiplier), CPUID leaf 0x15, CPUID
 * leaf 0x16 (nominal base MHz), or a 5 ms calibration against PIT channel 0
 * (read back via the latch command; no port 0x61 needed, so it also works on
 * microvm). Wall clock: the CMOS RTC read once at boot plus monotonic time.
 */
#include <stdint.h>
#include "platform.h"
#include "boot.h"
#include "io.h"

#define NSEC_PER_SEC 1000000000ull
#define PIT_HZ 1193182u
#define MSR_KVM_SYSTEM_TIME_NEW 0x4b564d01u
#define MSR_KVM_SYSTEM_TIME 0x12u
#define MSR_KVM_WALL_CLOCK_NEW 0x4b564d00u
#define MSR_KVM_WALL_CLOCK 0x11u

/* KVM writes here the wall-clock time at which kvmclock's system_time was 0. */
struct pvclock_wall_clock {
    uint32_t version;
    uint32_t sec;
    uint32_t nsec;
} __attribute__((packed));
static volatile struct pvclock_wall_clock kvm_wall __attribute__((aligned(16)));
static uint64_t kvm_unix_ns_at_boot; /* 0 = no kvmclock wall clock: use the RTC */

struct pvclock_time_info {
    uint32_t version;
    uint32_t pad0;
    uint64_t tsc_timestamp;
    uint64_t system_time;
    uint32_t tsc_to_system_mul;
    int8_t tsc_shift;
    uint8_t flags;
    uint8_t pad[2];
} __attribute__((packed));

static volatile struct pvclock_time_info kvmclock __attribute__((aligned(64)));
static uint64_t tsc_boot;       /* TSC at clock init */
static uint64_t ns_per_tick_q32; /* ns per TSC tick, 32.32 fixed point */
static uint64_t tsc_hz;
static const char *source = "none";
static uint64_t rand_state;

static int kvmclock_calibrate(void)
{
    uint32_t r[4];
    cpuid(0x40000000, 0, r);
    if (r[1] != 0x4b4d564b || r[2] != 0x564b4d56 || r[3] != 0x0000004d) /* "KVMKVMKVM" */
        return 0;
    cpuid(0x40000001, 0, r);
    uint32_t msr;
    if (r[0] & (1u << 3))
        msr = MSR_KVM_SYSTEM_TIME_NEW;
    else if (r[0] & 1u)
        msr = MSR_KVM_SYSTEM_TIME;
    else
        return 0;
    wrmsr(msr, (uint64_t)(uintptr_t)&kvmclock | 1);
    uint32_t v;
    uint32_t mul;
    int8_t shift;
    uint64_t stamp, system;
    int tries = 0;
    do {
        v = kvmclock.version;
        compiler_barrier();
        mul = kvmclock.tsc_to_system_mul;
        shift = kvmclock.tsc_shift;
        stamp = kvmclock.tsc_timestamp;
        system = kvmclock.system_time;
        compiler_barrier();
        if (++tries > 1000000)
            break;
    } while ((v & 1) || v != kvmclock.version || v == 0);
    wrmsr(msr, 0); /* we only needed the scale; stop KVM updating it */
    if (mul == 0)
        return 0;
    ns_per_tick_q32 = shift >= 0 ? (uint64_t)mul << shift : (uint64_t)mul >> -shift;
    /* The host's wall clock to the nanosecond (the RTC only has whole seconds, and
     * QEMU starts it on a whole host second): wall = boot epoch + system_time. */
    wrmsr(msr == MSR_KVM_SYSTEM_TIME_NEW ? MSR_KVM_WALL_CLOCK_NEW : MSR_KVM_WALL_CLOCK,
          (uint64_t)(uintptr_t)&kvm_wall);
    uint32_t wv, sec, nsec;
    tries = 0;
    do {
        wv = kvm_wall.version;
        compiler_barrier();
        sec = kvm_wall.sec;
        nsec = kvm_wall.nsec;
        compiler_barrier();
        if (++tries > 1000000)
            break;
    } while ((wv & 1) || wv != kvm_wall.version);
    if (sec > 1000000000u) { /* after 2001: a real answer */
        int64_t ticks = (int64_t)(tsc_boot - stamp); /* TSC at clock init, from the stamp */
        int64_t delta = ticks >= 0
            ? (int64_t)(((unsigned __int128)(uint64_t)ticks * ns_per_tick_q32) >> 32)
            : -(int64_t)(((unsigned __int128)(uint64_t)(-ticks) * ns_per_tick_q32) >> 32);
        kvm_unix_ns_at_boot = (uint64_t)sec * NSEC_PER_SEC + nsec + system + (uint64_t)delta;
    }
    tsc_hz = (NSEC_PER_SEC << 32) / ns_per_tick_q32;
    source = "tsc (kvmclock scale)";
    return 1;
}

static int cpuid_calibrate(void)
{
    uint32_t r[4];
    cpuid(0, 0, r);
    uint32_t max = r[0];
    if (max >= 0x15) {
        cpuid(0x15, 0, r);
        if (r[0] && r[1] && r[2]) {
            tsc_hz = (uint64_t)r[2] * r[1] / r[0];
            source = "tsc (cpuid 0x15)";
            return 1;
        }
    }
    if (max >= 0x16) {
        cpuid(0x16, 0, r);
        if (r[0] & 0xffff) {
            tsc_hz = (uint64_t)(r[0] & 0xffff) * 1000000u;
            source = "tsc (cpuid 0x16)";
            return 1;
        }
    }
    return 0;
}

static uint16_t pit_read_ch0(void)
{
    outb(0x43, 0x00); /* latch channel 0 */
    uint8_t lo = inb(0x40);
    uint8_t hi = inb(0x40);
    return (uint16_t)(lo | (hi << 8));
}

static int pit_calibrate(void)
{
    const uint32_t ticks = PIT_HZ / 200; /* 5 ms */
    outb(0x43, 0x34);                   /* ch0, lo/hi, mode 2, binary */
    outb(0x40, 0xff);
    outb(0x40, 0xff);
    uint16_t start = pit_read_ch0();
    if (start == 0xffff && pit_read_ch0() == 0xffff) {
        /* Either just loaded or no PIT: give it a moment. */
        for (int i = 0; i < 10000; i++)
            cpu_relax();
        if (pit_read_ch0() == 0xffff)
            return 0;
        start = pit_read_ch0();
    }
    uint64_t t0 = rdtsc();
    uint32_t elapsed = 0;
    uint16_t prev = start;
    uint64_t guard = 0;
    while (elapsed < ticks) {
        uint16_t now = pit_read_ch0();
        elapsed += (uint16_t)(prev - now);
        prev = now;
        if (++guard > 100000000ull)
            return 0;
    }
    uint64_t t1 = rdtsc();
    tsc_hz = (t1 - t0) * PIT_HZ / elapsed;
    source = "tsc (pit calibrated)";
    return 1;
}

static uint8_t cmos_read(uint8_t reg)
{
    outb(0x70, reg);
    return inb(0x71);
}

static unsigned bcd(uint8_t v)
{
    return (v & 0x0f) + (v >> 4) * 10;
}

/* Days since 1970-01-01 for a proleptic Gregorian date. */
static int64_t days_from_civil(int64_t y, unsigned m, unsigned d)
{
    y -= m <= 2;
    int64_t era = (y >= 0 ? y : y - 399) / 400;
    unsigned yoe = (unsigned)(y - era * 400);
    unsigned doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    unsigned doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + (int64_t)doe - 719468;
}

static uint8_t rtc_raw_seconds; /* seconds register (as read) behind the last rtc_read_unix */

static uint64_t rtc_read_unix(void)
{
    uint8_t t[7], u[7];
    int tries = 0;
    if (cmos_read(0x0b) == 0xff)
        return 0; /* no RTC */
    do {
        for (int i = 0; i < 100000 && (cmos_read(0x0a) & 0x80); i++)
            cpu_relax();
        t[0] = cmos_read(0x00); t[1] = cmos_read(0x02); t[2] = cmos_read(0x04);
        t[3] = cmos_read(0x07); t[4] = cmos_read(0x08); t[5] = cmos_read(0x09);
        t[6] = cmos_read(0x32);
        for (int i = 0; i < 100000 && (cmos_read(0x0a) & 0x80); i++)
            cpu_relax();
        u[0] = cmos_read(0x00); u[1] = cmos_read(0x02); u[2] = cmos_read(0x04);
        u[3] = cmos_read(0x07); u[4] = cmos_read(0x08); u[5] = cmos_read(0x09);
        u[6] = cmos_read(0x32);
    } while (__builtin_memcmp(t, u, sizeof t) != 0 && ++tries < 10);
    rtc_raw_seconds = t[0];
    uint8_t b = cmos_read(0x0b);
    int pm = t[2] & 0x80;
    t[2] &= 0x7f;
    unsigned sec = t[0], min = t[1], hour = t[2], day = t[3], mon = t[4], year = t[5];
    unsigned century = t[6];
    if (!(b & 0x04)) {
        sec = bcd(t[0]); min = bcd(t[1]); hour = bcd(t[2]);
        day = bcd(t[3]); mon = bcd(t[4]); year = bcd(t[5]);
        century = bcd(t[6]);
    }
    if (!(b & 0x02) && pm)
        hour = (hour % 12) + 12;
    if (century < 19 || century > 30)
        century = 20;
    if (mon < 1 || mon > 12 || day < 1 || day > 31)
        return 0;
    int64_t days = days_from_civil((int64_t)century * 100 + year, mon, day);
    return (uint64_t)(days * 86400 + hour * 3600 + min * 60 + sec);
}

void platform_clock_init(void)
{
    tsc_boot = rdtsc();
    if (!kvmclock_calibrate() && !cpuid_calibrate() && !pit_calibrate()) {
        tsc_hz = 1000000000ull;
        source = "tsc (UNCALIBRATED, assuming 1 GHz)";
    }
    if (!ns_per_tick_q32)
        ns_per_tick_q32 = (NSEC_PER_SEC << 32) / tsc_hz;
}

/* The RTC counts whole seconds and its phase is unknown, so the first reading
 * can be up to 1 s behind. Rather than wait for the next tick at boot (which
 * would cost up to a second of boot time), platform_wallclock_poll() watches
 * the seconds register from the main loop and re-anchors at its first edge:
 * from then on Date is exact to the second (RFC 9110 §6.6.1). */
static uint64_t unix_ns_base;   /* unix time in ns at tsc_boot; 0 = no RTC */
static uint64_t rtc_unix_read;  /* the whole second the RTC showed at init */
static uint64_t edge_deadline_ns, next_poll_ns;
static int edge_found;

void platform_wallclock_init(void)
{
    if (kvm_unix_ns_at_boot) { /* exact: no need to watch the RTC */
        unix_ns_base = kvm_unix_ns_at_boot;
        edge_found = 1;
        rand_state = rdtsc() ^ (kvm_unix_ns_at_boot << 7) ^ 0x9e3779b97f4a7c15ull;
        return;
    }
    uint64_t now = rtc_read_unix();
    uint64_t t = platform_now_ns();
    rtc_unix_read = now;
    unix_ns_base = now ? now * NSEC_PER_SEC - t : 0;
    edge_deadline_ns = t + 1100 * 1000000ull;
    next_poll_ns = t;
    rand_state = rdtsc() ^ (now << 20) ^ 0x9e3779b97f4a7c15ull;
}

void platform_wallclock_poll(void)
{
    if (edge_found || !unix_ns_base)
        return;
    uint64_t t = platform_now_ns();
    if (t < next_poll_ns)
        return;
    if (t > edge_deadline_ns) {  /* no edge seen (a stopped RTC?): keep the 1 s bound */
        edge_found = 1;
        return;
    }
    next_poll_ns = t + 2 * 1000000ull;  /* 2 ms: the anchor's error, and 2 port reads per poll */
    if (cmos_read(0x0a) & 0x80)
        return;  /* update in progress: the seconds register is not stable */
    if (cmos_read(0x00) != rtc_raw_seconds) {
        /* The RTC just ticked: this instant is the start of second rtc_unix_read + 1. */
        unix_ns_base = (rtc_unix_read + 1) * NSEC_PER_SEC - t;
        edge_found = 1;
    }
}

uint64_t platform_tsc_hz(void)
{
    return tsc_hz;
}

uint64_t platform_now_ns(void)
{
    uint64_t d = rdtsc() - tsc_boot;
    return (uint64_t)(((unsigned __int128)d * ns_per_tick_q32) >> 32);
}

uint32_t platform_now_ms(void)
{
    return (uint32_t)(platform_now_ns() / 1000000u);
}

uint64_t platform_unix_time(void)
{
    if (!unix_ns_base)
        return 0;
    return (unix_ns_base + platform_now_ns()) / NSEC_PER_SEC;
}

const char *platform_clock_source(void)
{
    return source;
}

uint32_t platform_random(void)
{
    uint64_t x = rand_state ^ rdtsc();
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    rand_state = x;
    return (uint32_t)(x >> 16);
}
