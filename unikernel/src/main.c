/*
 * The application: starts the subsystems on the platform (platform.h) and
 * runs the polling loop. Solo5's shape: the platform boots and calls main();
 * virtio-rng (an entropy source), net.c (lwIP over virtio-net) and http.c (the
 * request core over lwIP) are started from here and only ever call down into
 * the platform.
 *
 * The host talks to the guest over the serial console (`orisha boot` writes
 * to QEMU's stdin, orisha/targets/unikernel/boot.py): "stop" asks for a
 * graceful stop (no new connections, open ones end after their current
 * response; "orisha: drained" is logged once nothing is left unacknowledged),
 * "stats" has every core log its stats lines (bench/unikernel_cores.py reads a
 * window's guest cycles from two of them),
 * "exit" leaves QEMU now. The host decides when to send "exit": once QEMU's
 * user networking has passed every byte on, or when its grace time is up.
 */
#include <stdint.h>
#include <string.h>
#include "platform.h"
#include "net.h"
#include "http.h"
#include "io.h"
#include "virtio_rng.h"
#include "tls.h"
#include "policy.h"

#define CONSOLE_POLL_MS 50   /* a console read is a VM exit: 20 a second cost nothing */
#define STATS_MS 10000       /* orisha.verbose: net counters this often */
#define DHCP_WARN_MS 5000
#define IDLE_US 50000        /* an idle core sleeps at most this long (wake IPIs and core 0's
                              * device interrupt end it; lwIP's timers are kept): the console's pace */

enum command { NONE, STOP, EXIT, STATS };

/* The console's "stats": every core logs its stats lines (http_log_stats) once it
 * sees the count move (within its longest nap). */
static uint32_t stats_asked PLATFORM_SHARED;

static void stats_if_asked(void)
{
    static uint32_t seen; /* this core's */
    uint32_t asked = __atomic_load_n(&stats_asked, __ATOMIC_ACQUIRE);
    if (seen != asked) {
        seen = asked;
        http_log_stats();
    }
}

/* One pass of the loop: the network, and the RTC edge the wall clock waits for;
 * when the network had nothing, http.c hears the kernel is not behind, and a key
 * for a later TLS handshake is made (tls.h). */
static void step(void)
{
    if (!net_poll()) {
        http_idle();
        if (!tls_prepare())
            net_wait(IDLE_US); /* core 0: polls on briefly after a frame, then naps */
    }
    platform_wallclock_poll();
}

/*
 * More cores (platform_start_cpus): each runs this same application on its own
 * state (lwIP, the request core, TLS: net.c, linker.ld) on the address core 0's
 * DHCP got, fed with the segments core 0 hands it. What the cores share is here:
 * core 0 hears the console and tells the others to stop; each says when it is idle.
 */
#define CORES_UP_MS 5000    /* every core listening within this, else PANIC */

static int stop_all PLATFORM_SHARED;
static struct {
    int stopped, busy;
} __attribute__((aligned(64))) cores[POLICY_CPUS_MAX] PLATFORM_SHARED;

static void secondary(unsigned cpu)
{
    size_t site_len;
    const uint8_t *site = platform_site(&site_len);
    net_init_secondary(); /* waits for core 0's address */
    http_init(site, site_len);
    net_up();
    for (;;) {
        if (!net_poll()) {
            http_idle();
            if (!tls_prepare())
                net_wait(IDLE_US);
        }
        if (!cores[cpu].stopped && __atomic_load_n(&stop_all, __ATOMIC_ACQUIRE)) {
            http_stop();
            __atomic_store_n(&cores[cpu].stopped, 1, __ATOMIC_RELEASE);
        }
        __atomic_store_n(&cores[cpu].busy, http_busy(), __ATOMIC_RELEASE);
        stats_if_asked();
    }
}

/* Every core has stopped and has nothing left unacknowledged. */
static int all_drained(void)
{
    if (http_busy())
        return 0;
    for (unsigned k = 1; k < platform_cpus(); k++)
        if (!__atomic_load_n(&cores[k].stopped, __ATOMIC_ACQUIRE) ||
            __atomic_load_n(&cores[k].busy, __ATOMIC_ACQUIRE))
            return 0;
    return 1;
}

static void wait_for_address(void)
{
    uint32_t warned = 0;
    while (!net_has_address()) {
        step();
        uint32_t now = platform_now_ms();
        if (now / DHCP_WARN_MS > warned) {
            warned = now / DHCP_WARN_MS;
            platform_printf("orisha: still waiting for DHCP (%u s)\n", now / 1000);
        }
    }
}

/* The next complete command line on the console, if any ("stop", "exit"). */
static enum command console_command(void)
{
    static char line[16];
    static size_t len;
    int ch;
    while ((ch = platform_console_getc()) >= 0) {
        if (ch != '\n' && ch != '\r') {
            if (len < sizeof line)
                line[len++] = (char)ch;
            continue;
        }
        size_t n = len;
        len = 0;
        if (n == 4 && memcmp(line, "stop", 4) == 0)
            return STOP;
        if (n == 4 && memcmp(line, "exit", 4) == 0)
            return EXIT;
        if (n == 5 && memcmp(line, "stats", 5) == 0)
            return STATS;
        if (n)
            platform_printf("orisha: unknown console command (%zu bytes)\n", n);
    }
    return NONE;
}

static void serve(void)
{
    uint32_t next_console = platform_now_ms(), next_stats = next_console + STATS_MS;
    int stopping = 0, drained = 0;
    for (;;) {
        step();
        uint32_t now = platform_now_ms();
        if ((int32_t)(now - next_console) >= 0) {
            next_console = now + CONSOLE_POLL_MS;
            enum command cmd = console_command();
            if (cmd == EXIT)
                return;
            if (cmd == STATS)
                __atomic_add_fetch(&stats_asked, 1, __ATOMIC_RELEASE);
            if (cmd == STOP && !stopping) {
                stopping = 1;
                platform_printf("orisha: stopping: no new connections, finishing responses\n");
                http_stop();
                __atomic_store_n(&stop_all, 1, __ATOMIC_RELEASE);
            }
        }
        stats_if_asked();
        if (stopping && !drained && all_drained()) {
            drained = 1;
            platform_printf("orisha: drained\n");
        }
        if (platform_verbose() && (int32_t)(now - next_stats) >= 0) {
            net_log_stats();
            next_stats += STATS_MS;
        }
    }
}

int main(void)
{
    size_t site_len;
    const uint8_t *site = platform_site(&site_len);
    /* Serial output costs a VM exit per byte on some hosts (~3 ms a line),
     * so the default boot log is two lines; orisha.verbose adds details. */
    int rng = virtio_rng_init(); /* before net_init: its TCP ISN key reads it */
    if (platform_verbose()) {
        const char *cpu = platform_entropy_source();
        platform_printf("orisha: entropy sources: %s%s%s%s\n", cpu ? cpu : "",
                        cpu && rng ? ", " : "", rng ? "virtio-rng " : "",
                        rng ? virtio_rng_describe() : cpu ? "" : "none");
    }
    net_init(); /* starts DHCP */
    int tls = http_init(site, site_len);
    net_share(platform_cpus_asked());
    unsigned cpus = platform_start_cpus(secondary); /* while DHCP runs */
    wait_for_address(); /* net.c logs the address */
    if (cpus > 1 && !net_spread(cpus, CORES_UP_MS))
        PANIC("not every core was listening within %u ms", CORES_UP_MS);
    uint32_t slots, table = http_table(&slots);
    platform_printf("orisha: serving http on port 80%s, site %zu bytes, table %u of %u slots, "
                    "%u core%s online, boot %u ms\n", tls ? " and https on port 443" : "",
                    site_len, table, slots, cpus, cpus == 1 ? "" : "s", platform_now_ms());
    if (platform_cmdline_has("orisha.exit=ready"))
        return 0; /* boot-time measurements */
    serve();
    return 0;
}
