/* The container's PID 1 and its HEALTHCHECK: one small static executable, /init.
 *
 * Strategy: the image is FROM scratch, so nothing else in it reaps orphans or probes the admin
 * port cheaply. /orisha is staticx's launcher, which forks PyInstaller's, which forks Python:
 * three processes and the whole bundle unpacked into /tmp at every start. Two jobs follow.
 *
 * 1. `/init PROGRAM ARGS...` (the ENTRYPOINT, `/init /orisha`): PID 1 that runs PROGRAM as its
 *    one child, passes each signal it catches on to the nearest process of that child's tree
 *    that handles it (docker stop's SIGTERM to the launcher; docker kill -s HUP, the reload,
 *    to the server itself: `handler_below`),
 *    reaps every process that ends up its child, and exits with PROGRAM's status
 *    (128+N when a signal N ended it). A process `docker exec` starts has no parent inside the
 *    container's PID namespace; when it dies (a HEALTHCHECK past its timeout is SIGKILLed),
 *    its own children are reparented to the namespace's init, never to a subreaper outside it
 *    (kernel/exit.c, find_new_reaper stops at the namespace's level). staticx's launcher as
 *    PID 1 waits for its own child only, so each killed check used to leave a zombie behind.
 *    Outside a container (PID != 1) it makes itself a child subreaper, so the same holds.
 * 2. `/init --health [URL]` (the HEALTHCHECK): GET URL (default
 *    http://127.0.0.1:$ADMIN_PORT + READY_PATH), exit 0 on a 2xx, else 1 with the reason:
 *    `orisha health`'s probe (orisha/serving/admin.py check) in one process that forks nothing,
 *    unpacks nothing and allocates nothing, so a killed check leaves nothing behind.
 *
 * Built with musl-gcc -static (71 KB). READY_PATH and CHECK_TIMEOUT come from orisha/serving/admin.py
 * on the compiler's command line
 * (orisha/targets/container/build.py), not retyped here.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef READY_PATH
#error "build with -DREADY_PATH=\"/readyz\" (orisha/targets/container/build.py does)"
#endif
#ifndef CHECK_TIMEOUT
#error "build with -DCHECK_TIMEOUT=3 (orisha/targets/container/build.py does)"
#endif

/* Signals a fault raises in this process itself: left to their default action. */
static const int SYNCHRONOUS[] = {SIGFPE, SIGILL, SIGSEGV, SIGBUS, SIGABRT, SIGTRAP, SIGSYS};

/* Whether `pid` has a handler for `sig` or ignores it (/proc/PID/status: SigCgt, SigIgn). A
 * signal it leaves at its default action is not passed to it: staticx's launcher catches only
 * SIGTERM and SIGINT, so a SIGHUP sent to it would end the server instead of reloading it.
 * Without /proc it is passed on. */
static int handles(pid_t pid, int sig)
{
    char path[32], line[128];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "re");
    if (!f)
        return 1;
    unsigned long long mask = 0, bits;
    while (fgets(line, sizeof line, f))
        if ((sscanf(line, "SigCgt: %llx", &bits) == 1 || sscanf(line, "SigIgn: %llx", &bits) == 1))
            mask |= bits;
    fclose(f);
    return (int)((mask >> (sig - 1)) & 1);
}

/* The parent of `pid` (/proc/PID/stat's fourth field), or -1. */
static pid_t parent_of(pid_t pid)
{
    char path[32], stat[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "re");
    if (!f)
        return -1;
    size_t n = fread(stat, 1, sizeof stat - 1, f);
    fclose(f);
    stat[n] = 0;
    char *close = strrchr(stat, ')'); /* the name in parentheses may hold anything */
    int ppid;
    return close && sscanf(close + 1, " %*c %d", &ppid) == 1 ? (pid_t)ppid : -1;
}

/* The nearest process at or below `pid` that handles `sig`, or 0. staticx's launcher and
 * PyInstaller's bootloader sit between PID 1 and the server: a signal only the server
 * catches (SIGHUP, the reload) goes to the server, past launchers that would die of it. */
static pid_t handler_below(pid_t pid, int sig, int depth)
{
    if (handles(pid, sig))
        return pid;
    if (depth == 0)
        return 0;
    DIR *proc = opendir("/proc");
    if (!proc)
        return 0;
    pid_t found = 0;
    struct dirent *e;
    while (!found && (e = readdir(proc)) != NULL) {
        char *end;
        long other = strtol(e->d_name, &end, 10);
        if (*end == 0 && other > 0 && parent_of((pid_t)other) == pid)
            found = handler_below((pid_t)other, sig, depth - 1);
    }
    closedir(proc);
    return found;
}

static int supervise(char **argv)
{
    sigset_t caught, old;
    sigfillset(&caught);
    for (size_t i = 0; i < sizeof SYNCHRONOUS / sizeof *SYNCHRONOUS; i++)
        sigdelset(&caught, SYNCHRONOUS[i]);
    /* Blocked before the fork: a SIGTERM or SIGCHLD between fork and sigwaitinfo waits. */
    sigprocmask(SIG_SETMASK, &caught, &old);
    if (getpid() != 1)
        prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    pid_t child = fork();
    if (child < 0) {
        perror("orisha-init: fork");
        return 1;
    }
    if (child == 0) {
        sigprocmask(SIG_SETMASK, &old, NULL);
        execv(argv[0], argv);
        fprintf(stderr, "orisha-init: %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    for (;;) {
        siginfo_t info;
        int sig = sigwaitinfo(&caught, &info);
        if (sig < 0)
            continue; /* EINTR: a stop/continue of this process, nothing to do */
        if (sig != SIGCHLD) {
            pid_t to = handler_below(child, sig, 4);
            if (to > 0)
                kill(to, sig); /* ESRCH: it has just ended; its SIGCHLD is pending */
            continue;
        }
        int status;
        pid_t pid;
        /* One SIGCHLD may stand for several ended children: reap until none is left. */
        while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
            if (pid != child)
                continue; /* an orphan: reaped, which is all it needed */
            /* The rest of the namespace is SIGKILLed by the kernel when PID 1 exits. */
            if (WIFSIGNALED(status))
                return 128 + WTERMSIG(status);
            return WEXITSTATUS(status);
        }
    }
}

/* "http://A.B.C.D[:PORT]/PATH" (the admin port is numeric IPv4, or localhost): fills addr. */
static int parse_url(const char *url, struct sockaddr_in *addr, char *host, size_t hostlen,
                     const char **path)
{
    if (strncmp(url, "http://", 7) != 0)
        return -1;
    const char *h = url + 7, *end = h + strcspn(h, "/");
    *path = *end ? end : "/";
    size_t n = (size_t)(end - h);
    if (n == 0 || n >= hostlen)
        return -1;
    memcpy(host, h, n);
    host[n] = 0;
    char name[64];
    char *colon = strchr(host, ':');
    size_t nl = colon ? (size_t)(colon - host) : n;
    if (nl == 0 || nl >= sizeof name)
        return -1;
    memcpy(name, host, nl);
    name[nl] = 0;
    long port = 80;
    if (colon) {
        char *e;
        port = strtol(colon + 1, &e, 10);
        if (e == colon + 1 || *e || port < 1 || port > 65535)
            return -1;
    }
    memset(addr, 0, sizeof *addr);
    addr->sin_family = AF_INET;
    addr->sin_port = htons((unsigned short)port);
    if (strcmp(name, "localhost") == 0)
        strcpy(name, "127.0.0.1");
    return inet_pton(AF_INET, name, &addr->sin_addr) == 1 ? 0 : -1;
}

static int unhealthy(const char *url, const char *why)
{
    fprintf(stderr, "orisha: unhealthy: %s: %s\n", url, why);
    return 1;
}

static int health(const char *url)
{
    char fallback[96];
    if (!url || !*url) {
        const char *port = getenv("ADMIN_PORT");
        if (!port || !*port || strcmp(port, "0") == 0) {
            fputs("orisha: error: --health needs a URL or $ADMIN_PORT\n", stderr);
            return 1;
        }
        snprintf(fallback, sizeof fallback, "http://127.0.0.1:%.8s%s", port, READY_PATH);
        url = fallback;
    }
    struct sockaddr_in addr;
    char host[128], request[512], answer[1024];
    const char *path;
    if (parse_url(url, &addr, host, sizeof host, &path) < 0)
        return unhealthy(url, "not an http://A.B.C.D[:PORT]/PATH URL");
    int len = snprintf(request, sizeof request,
                       "GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", path, host);
    if (len < 0 || (size_t)len >= sizeof request)
        return unhealthy(url, "URL too long");
    int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        return unhealthy(url, strerror(errno));
    /* Linux applies SO_SNDTIMEO to a blocking connect() too: one bound for every step. */
    struct timeval tv = {.tv_sec = (time_t)CHECK_TIMEOUT};
    setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char why[96];
    if (connect(s, (struct sockaddr *)&addr, sizeof addr) < 0 ||
        send(s, request, (size_t)len, MSG_NOSIGNAL) != len) {
        if (errno == EAGAIN || errno == EINPROGRESS)
            snprintf(why, sizeof why, "no answer within %g s", (double)CHECK_TIMEOUT);
        else
            snprintf(why, sizeof why, "%s", strerror(errno));
        return unhealthy(url, why);
    }
    size_t got = 0;
    while (got < sizeof answer - 1 && !memmem(answer, got, "\r\n", 2)) {
        ssize_t r = recv(s, answer + got, sizeof answer - 1 - got, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && errno == EAGAIN) {
            snprintf(why, sizeof why, "no answer within %g s", (double)CHECK_TIMEOUT);
            return unhealthy(url, why);
        }
        if (r <= 0)
            break; /* closed (or reset) before a whole status line: judged below */
        got += (size_t)r;
    }
    answer[got] = 0;
    char *eol = strstr(answer, "\r\n");
    if (eol)
        *eol = 0;
    /* "HTTP/1.1 200 OK": the version, three digits, the reason (as admin.check reads it). */
    char *status = strchr(answer, ' ');
    if (strncmp(answer, "HTTP/", 5) != 0 || !status || strspn(status + 1, "0123456789") != 3) {
        snprintf(why, sizeof why, "not an HTTP answer ('%.60s')", answer);
        return unhealthy(url, why);
    }
    status++;
    if (status[0] != '2')
        return unhealthy(url, status);
    printf("orisha: %s: %s\n", url, status);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc >= 2 && strcmp(argv[1], "--health") == 0)
        return health(argc >= 3 ? argv[2] : NULL);
    if (argc < 2 || argv[1][0] != '/') {
        fputs("usage: /init /PROGRAM [ARGS...] | /init --health [URL]\n", stderr);
        return 2;
    }
    return supervise(argv + 1);
}
