"""Running a build: listeners, workers and their supervisor.

Strategy: the parent loads the build (so the generated module and the mapped
blob are shared by every worker after fork), opens one SO_REUSEPORT listener
per worker and forks. Worker i serves listener i with the chosen loop body.
The parent keeps the listeners open: when a worker dies, connections queued on
its listener wait for the replacement instead of being refused. SIGTERM or
SIGINT: workers stop accepting, finish what is in flight and exit; the parent
exits 0 when they are gone.
"""

from __future__ import annotations

import errno
import gc
import importlib.util
import mmap
import os
import select
import signal
import socket
import struct
import sys
import time

from . import loops
from .core.connection import App
from .core.policy import ERROR_STATUSES, STATS, STATS_SLOTS, Limits, Stat
from .errors import LoopUnavailable, ServeError
from .manifest import is_build


def load_site(build_dir: str):
    """Import a build's generated module and return its ``Site``."""
    if not is_build(build_dir):
        raise ServeError(f"{build_dir}: not an Orisha build (run `orisha build SITE -o {build_dir}`)")
    path = os.path.join(build_dir, "site.py")
    spec = importlib.util.spec_from_file_location("orisha_site", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except (OSError, ValueError, SyntaxError) as e:
        raise ServeError(f"{path}: cannot load the build ({e})") from None
    return module.SITE


def listeners(host: str, port: int, count: int) -> list[socket.socket]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ServeError(f"{host}: cannot resolve ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(addr)
            s.listen(4096)
            s.setblocking(False)
            addr = s.getsockname()  # port 0: the others join the port the first one got
    except OSError as e:
        for s in socks:
            s.close()
        what = "address already in use" if e.errno == errno.EADDRINUSE else e.strerror
        raise ServeError(f"{host}:{port}: {what}") from None
    return socks


class _Shared:
    """Counters of every live worker in one shared anonymous map (created before fork).

    Each worker writes its slot once a second (``App.tick``); the supervisor reads
    them for the admin port and folds a slot into ``retired`` when its worker exits,
    so totals survive restarts and reloads.
    """

    def __init__(self, slots: int) -> None:
        self.fmt = struct.Struct(f"<{STATS_SLOTS}q")
        self.map = mmap.mmap(-1, slots * self.fmt.size)
        self.free = list(range(slots))
        self.retired: dict[int, list[int]] = {}

    def take(self) -> int:
        slot = self.free.pop(0)
        self.fmt.pack_into(self.map, slot * self.fmt.size, *([0] * STATS_SLOTS))
        return slot

    def publisher(self, slot: int):
        fmt, buf, off = self.fmt, self.map, slot * self.fmt.size
        return lambda stats: fmt.pack_into(buf, off, *stats)

    def read(self, slot: int) -> tuple[int, ...]:
        return self.fmt.unpack_from(self.map, slot * self.fmt.size)

    def release(self, slot: int, index: int) -> None:
        acc = self.retired.setdefault(index, [0] * STATS_SLOTS)
        for k, v in enumerate(self.read(slot)):
            if k != Stat.OPEN_CONNECTIONS:  # a gauge: a dead worker has none
                acc[k] += v
        self.free.append(slot)


def _worker(listener: socket.socket, others: list[socket.socket], site, loop_cls,
            limits: Limits, publish, log) -> None:
    for s in others:
        s.close()
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    for sig in (signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL if sig == signal.SIGCHLD else signal.SIG_IGN)
    signal.set_wakeup_fd(-1)
    loop_cls(listener, App(site, limits, publish=publish, log=log)).run(lambda: bool(stop))


def _spawn(i: int, socks, site, loop_cls, limits, publish=None, log=None) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _worker(socks[i], [s for j, s in enumerate(socks) if j != i], site, loop_cls, limits,
                    publish, log)
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def metrics(shared: _Shared, live: dict[int, tuple[int, int]], restarts: int) -> bytes:
    """Prometheus text exposition of every worker's counters (live + retired)."""
    per: dict[int, list[int]] = {i: list(v) for i, v in shared.retired.items()}
    for slot, index in live.values():
        acc = per.setdefault(index, [0] * STATS_SLOTS)
        for k, v in enumerate(shared.read(slot)):
            acc[k] += v
    out = []
    names = [("requests_total", "counter", "Requests answered."),
             ("response_body_bytes_total", "counter", "Response body bytes queued for sending."),
             ("connections_total", "counter", "Connections accepted."),
             ("open_connections", "gauge", "Connections open now.")]
    for k, (name, kind, doc) in enumerate(names):
        out.append(f"# HELP orisha_{name} {doc}\n# TYPE orisha_{name} {kind}")
        out += [f'orisha_{name}{{worker="{i}"}} {v[k]}' for i, v in sorted(per.items())]
    out.append("# HELP orisha_errors_total Error responses by status.\n# TYPE orisha_errors_total counter")
    for i, v in sorted(per.items()):
        for j, status in enumerate(ERROR_STATUSES):
            out.append(f'orisha_errors_total{{worker="{i}",status="{status}"}} {v[len(STATS) + j]}')
    out.append("# HELP orisha_worker_restarts_total Workers restarted after dying.\n"
               f"# TYPE orisha_worker_restarts_total counter\norisha_worker_restarts_total {restarts}")
    return ("\n".join(out) + "\n").encode()


def _admin_answer(sock: socket.socket, body_fn) -> None:
    """Answer one request on the admin port: GET /metrics, else 404. Never blocks long."""
    try:
        conn, _ = sock.accept()
    except OSError:  # EAGAIN or the client gave up
        return
    with conn:
        conn.settimeout(0.5)
        try:
            head = conn.recv(4096)
            ok = head.startswith(b"GET /metrics ")
            body = body_fn() if ok else b"not found\n"
            status = b"200 OK" if ok else b"404 Not Found"
            conn.sendall(b"HTTP/1.1 %s\r\nContent-Type: text/plain; version=0.0.4\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (status, len(body), body))
        except OSError:  # timeout or reset: the supervisor moves on
            pass


def _access_log(path: str):
    """A writer for access-log batches: appended to PATH, or to stdout for '-'."""
    try:
        fd = 1 if path == "-" else os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        raise ServeError(f"{path}: cannot open the access log ({e.strerror})") from None

    def write(data: bytes) -> None:  # O_APPEND: each worker's batch lands whole in a file
        view = memoryview(data)
        while view:  # a pipe (stdout) may take part of a large batch
            view = view[os.write(fd, view):]
    return write


def run(build_dir, host: str = "127.0.0.1", port: int = 8080, workers: int | None = None,
        loop: str | None = None, limits: Limits | None = None, announce=print,
        access_log: str | None = None, admin_port: int | None = None) -> int:
    """Serve ``build_dir`` (a build folder, or an already-loaded ``Site``: the container).

    SIGHUP reloads a build folder with zero downtime: a new generation of
    workers starts on the same listeners, then the old one stops gracefully.
    """
    reloadable = isinstance(build_dir, (str, os.PathLike))
    site = load_site(build_dir) if reloadable else build_dir
    name, note = loops.resolve(loop or site.loop)
    if note:
        print(f"orisha: {note}", file=sys.stderr)
    try:
        loop_cls = loops.load(name)
    except LoopUnavailable as e:
        raise ServeError(str(e)) from None
    workers = workers or os.cpu_count() or 1
    limits = limits or Limits()
    log = _access_log(access_log) if access_log else None
    admin = None
    if admin_port is not None:
        admin = listeners("127.0.0.1", admin_port, 1)[0]
    socks = listeners(host, port, workers)
    bound = socks[0].getsockname()
    shared = _Shared(2 * workers)
    live: dict[int, tuple[int, int]] = {}  # pid → (stats slot, worker index)
    started: dict[int, float] = {}
    retiring: set[int] = set()

    def spawn(i: int) -> None:
        slot = shared.take()
        pid = _spawn(i, socks, site, loop_cls, limits, shared.publisher(slot), log)
        live[pid], started[pid] = (slot, i), time.monotonic()

    # Signals arrive through a wake-up pipe so the supervisor can also wait on the admin port.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    got: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, lambda signo, _f: got.append(signo))
    signal.set_wakeup_fd(wake_w)
    gc.freeze()  # the site's objects go to a generation the collector never walks: fewer
    for i in range(workers):  # copied-on-write pages in each worker (PSS)
        spawn(i)
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    extra = f", admin http://127.0.0.1:{admin.getsockname()[1]}/metrics" if admin else ""
    announce(f"orisha: serving http://{shown}:{bound[1]}/ (loop {name}, {workers} "
             f"worker{'s' if workers > 1 else ''}, pid {os.getpid()}{extra}): {site.summary}")
    sys.stdout.flush()
    stopping, restarts, kill_at = False, 0, 0.0
    waits = [wake_r] + ([admin] if admin else [])
    while live:
        ready, _, _ = select.select(waits, [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 512)
        if admin in ready:
            _admin_answer(admin, lambda: metrics(shared, live, restarts))
        signals, got[:] = got[:], []
        if (signal.SIGTERM in signals or signal.SIGINT in signals) and not stopping:
            stopping = True
            for pid in live:
                os.kill(pid, signal.SIGTERM)
            kill_at = time.monotonic() + limits.grace + 2
        if signal.SIGHUP in signals and not stopping and reloadable:
            try:
                new = load_site(build_dir)
            except ServeError as e:
                print(f"orisha: reload failed, still serving the previous build: {e}", file=sys.stderr)
            else:
                site, old = new, list(live)
                gc.freeze()
                for i in range(workers):
                    spawn(i)
                for pid in old:  # they stop accepting, finish in-flight responses, exit
                    retiring.add(pid)
                    os.kill(pid, signal.SIGTERM)
                print(f"orisha: reloaded {build_dir}: {site.summary}", file=sys.stderr)
        if stopping and time.monotonic() > kill_at:
            for pid in live:
                os.kill(pid, signal.SIGKILL)
        while live:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # no children left
                live.clear()
                break
            if pid == 0:
                break
            slot, i = live.pop(pid)
            shared.release(slot, i)
            began = started.pop(pid)
            if not stopping and pid not in retiring:
                code = os.waitstatus_to_exitcode(status)
                print(f"orisha: worker {i} (pid {pid}) exited with {code}; restarting", file=sys.stderr)
                if time.monotonic() - began < 1:
                    time.sleep(1)  # a worker that dies at once must not become a fork loop
                restarts += 1
                spawn(i)
            retiring.discard(pid)
    for s in socks:
        s.close()
    return 0
