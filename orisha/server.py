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
import importlib.util
import json
import os
import signal
import socket
import sys
import time

from . import loops
from .core.connection import App, Limits

_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD}


class ServeError(Exception):
    """A start-up problem, reported as one line."""


def is_build(path: str) -> bool:
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            return json.load(f).get("generator") == "orisha"
    except (OSError, ValueError):  # not there or not ours
        return False


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


def _worker(listener: socket.socket, others: list[socket.socket], site, loop_cls,
            limits: Limits) -> None:
    for s in others:
        s.close()
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
    loop_cls(listener, App(site, limits)).run(lambda: bool(stop))


def _spawn(i: int, socks, site, loop_cls, limits) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _worker(socks[i], [s for j, s in enumerate(socks) if j != i], site, loop_cls, limits)
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def run(build_dir: str, host: str = "127.0.0.1", port: int = 8080, workers: int | None = None,
        loop: str | None = None, limits: Limits | None = None, announce=print) -> int:
    site = load_site(build_dir)
    name, note = loops.resolve(loop or site.loop)
    if note:
        print(f"orisha: {note}", file=sys.stderr)
    try:
        loop_cls = loops.load(name)
    except loops.LoopUnavailable as e:
        raise ServeError(str(e)) from None
    workers = workers or os.cpu_count() or 1
    limits = limits or Limits()
    socks = listeners(host, port, workers)
    bound = socks[0].getsockname()
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    pids = {_spawn(i, socks, site, loop_cls, limits): (i, time.monotonic()) for i in range(workers)}
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    announce(f"orisha: serving http://{shown}:{bound[1]}/ (loop {name}, {workers} "
             f"worker{'s' if workers > 1 else ''}, pid {os.getpid()}): {site.summary}")
    sys.stdout.flush()
    stopping = False
    while pids:
        info = signal.sigtimedwait(_SIGNALS, 1.0)
        if info is not None and info.si_signo in (signal.SIGTERM, signal.SIGINT) and not stopping:
            stopping = True
            for pid in pids:
                os.kill(pid, signal.SIGTERM)
            kill_at = time.monotonic() + limits.grace + 2
        if stopping and time.monotonic() > kill_at:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
        while pids:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # no children left
                pids.clear()
                break
            if pid == 0:
                break
            i, started = pids.pop(pid)
            if not stopping:
                code = os.waitstatus_to_exitcode(status)
                print(f"orisha: worker {i} (pid {pid}) exited with {code}; restarting",
                      file=sys.stderr)
                if time.monotonic() - started < 1:
                    time.sleep(1)  # a worker that dies at once must not become a fork loop
                pids[_spawn(i, socks, site, loop_cls, limits)] = (i, time.monotonic())
    for s in socks:
        s.close()
    return 0
