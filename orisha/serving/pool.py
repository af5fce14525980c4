"""The worker processes: what a generation is forked with, and the pool that forks,
reaps, restarts and SIGKILLs them.

Strategy: a ``Generation`` is what one generation's workers serve (the site, the TLS and
QUIC configuration); ``Pool`` forks one worker per listener of the current generation with
stop and reload signals blocked around the fork, reaps without blocking, restarts a worker
that died unasked (after ``RESTART_PAUSE`` if it died young) and SIGKILLs one that outlives
its grace by ``KILL_AFTER``. ``Steering`` is what HTTP/3's workers of every generation share
to hand datagrams to each other. Every worker asks the kernel for SIGTERM at its
supervisor's death (``die_with``). The supervisor (orisha/serving/supervisor.py) drives it.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import sys
import time
from typing import Callable

from ..core.connection import App
from ..core.policy import Limits
from .stats import SharedStats

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # graceful stop (Docker and Kubernetes send SIGTERM)
RELOAD_SIGNAL = signal.SIGHUP
HANDLED = (*STOP_SIGNALS, RELOAD_SIGNAL, signal.SIGCHLD)  # blocked around a fork
KILL_AFTER = 2.0  # seconds past the stop grace before a worker that has not exited is SIGKILLed
RESTART_PAUSE = 1.0  # a worker that died younger than this is restarted after this long
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _libc_prctl():
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    return ctypes.CDLL(None, use_errno=True).prctl


_PRCTL = _libc_prctl()  # looked up once, before any fork


class Steering:
    """What every HTTP/3 worker of every generation shares to steer datagrams by connection
    ID (orisha/protocols/quic_steer.py): a private folder for the workers' hand-over
    sockets (0700: no other user can hand datagrams in) and the key that masks the tags."""

    def __init__(self, folder: str) -> None:
        self.folder, self.key = folder, os.urandom(16)

    @classmethod
    def make(cls) -> "Steering | None":
        import tempfile
        try:
            return cls(tempfile.mkdtemp(prefix="orisha-quic-"))
        except OSError as e:  # no writable temporary folder (TMPDIR, /tmp): connections
            print(f"orisha: HTTP/3 connections will not outlive a reload: no private "  # as before
                  f"folder for the hand-over sockets ({e})", file=sys.stderr)
            return None

    def steer(self, gen: int, index: int):
        from ..protocols.quic_steer import Steer
        return Steer(self.folder, self.key, gen, index)

    def remove(self) -> None:
        import shutil
        shutil.rmtree(self.folder, ignore_errors=True)


class Generation:
    """What one generation of workers is forked with, and its number.

    Strategy: a reload (SIGHUP: the build again) and a renewal (new certificate files,
    ACME challenges or a certificate: the same build) each make a new ``Generation`` and
    hand it to the pool; nothing a worker serves changes under a live worker. Making one
    runs the user's code paths that can fail (loading a build, reading certificates), so
    ``anew`` raises ``ServeError`` and the generation in service stays.
    """
    __slots__ = ("number", "site", "protocols", "quic")

    def __init__(self, number: int, site, protocols, quic) -> None:
        self.number, self.site, self.protocols, self.quic = number, site, protocols, quic

    def anew(self, load: Callable[[], object] | None, make_protocols, make_quic) -> "Generation":
        """The next generation: the build loaded again (``load``; None keeps this one's
        site) and the protocols and QUIC configuration made anew, the files read again."""
        site = load() if load else self.site
        protocols = make_protocols() if make_protocols else None
        quic = make_quic() if make_quic else None
        return Generation(self.number + 1, site, protocols, quic)


class Worker:
    """The supervisor's record of one worker process."""
    __slots__ = ("slot", "index", "gen", "began", "kill_at")

    def __init__(self, slot: int, index: int, gen: int, began: float) -> None:
        self.slot, self.index, self.gen, self.began = slot, index, gen, began
        self.kill_at: float | None = None  # set when told to stop: SIGKILL after this


def die_with(parent: int) -> None:
    """In a worker: SIGTERM (the graceful stop) when the supervisor dies, however it dies."""
    if _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        import ctypes
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # it died between fork and the prctl: nobody will signal us
        os.kill(os.getpid(), signal.SIGTERM)  # pending until the unblock, then our stop flag


class Pool:
    """The worker processes: one per listener and generation, forked, reaped, restarted.

    Strategy: ``spawn`` forks a worker of the current generation over one listener (and
    its UDP socket for HTTP/3), with stop and reload signals blocked around the fork; the
    child (``_child``) closes what is not its own — ``keep_out`` closes the supervisor's
    things — and runs its loop body until told to stop. ``reap`` collects exits without
    blocking: a worker of the current generation that died unasked is due for a restart
    (after ``RESTART_PAUSE`` if it died young), one that was told to stop is not; every
    told worker has a SIGKILL deadline (``escalate``). The pool never sleeps: each step
    is one non-blocking turn of the supervisor's loop.
    """

    def __init__(self, socks: list[socket.socket], plain: list[socket.socket],
                 udp: list[socket.socket], loop_cls, limits: Limits, stats: SharedStats,
                 current: Generation, *, log=None, plain_app=None, alt_svc: bytes = b"",
                 steering: "Steering | None" = None,
                 keep_out: Callable[[], None] = lambda: None, endpoint=None,
                 reaped: Callable[[int, int], None] = lambda pid, status: None) -> None:
        # ``plain``: the plain port beside the TLS port (``--http-port``), one more worker per
        # listener, whose app ``plain_app(site, limits, publish=, log=)`` makes (the redirect
        # to https and the ACME HTTP-01 answers, orisha/core/upgrade.py).
        self.first_plain = len(socks)
        self.socks = list(socks) + list(plain)
        # HTTP/3: one UDP socket per TLS worker (worker i reads udp[i]; the plain port's
        # workers have none).
        self.udp = udp
        self.endpoint = endpoint  # the HTTP/3 engine's endpoint class (loops/base.py's contract)
        self.loop_cls, self.limits, self.stats, self.current = loop_cls, limits, stats, current
        self.log, self.plain_app, self.alt_svc, self.steering = log, plain_app, alt_svc, steering
        self.keep_out, self.reaped_other = keep_out, reaped
        self.size = len(self.socks)
        self.live: dict[int, Worker] = {}
        self.due: dict[int, float] = {}  # worker index → when to restart it
        self.restarts = 0
        self.stopping = False
        self.pid = os.getpid()

    def spawn_generation(self, gen: Generation) -> list[int]:
        """Fork ``gen``'s workers; returns the pids of the generation before it."""
        old = [pid for pid, w in self.live.items() if w.gen == self.current.number]
        self.current = gen
        gc.freeze()  # the site's objects go to a generation the collector never walks: fewer
        self.due.clear()  # copied-on-write pages in each worker (PSS)
        for i in range(self.size):
            self.spawn(i)
        return old

    def spawn(self, index: int) -> None:
        slot = self.stats.take()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
        try:
            pid = os.fork()
        except OSError as e:  # EAGAIN/ENOMEM: try again later rather than die
            self.stats.release(slot, index)
            print(f"orisha: cannot fork worker {index} ({e.strerror}); retrying", file=sys.stderr)
            self.due[index] = time.monotonic() + RESTART_PAUSE
            return
        finally:
            if os.getpid() == self.pid:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
        if pid == 0:
            self._child(index, slot, old)
        self.live[pid] = Worker(slot, index, self.current.number, time.monotonic())

    def _child(self, index: int, slot: int, mask) -> None:
        """The worker process: never returns."""
        code = 0
        try:
            stop: list[int] = []
            for sig in STOP_SIGNALS:
                signal.signal(sig, lambda *_: stop.append(1))
            signal.signal(RELOAD_SIGNAL, signal.SIG_IGN)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
            self.keep_out()  # the supervisor's admin port, wake-up pipe, ACME helper's pipe
            mine = (self.socks[index], self.udp[index] if index < len(self.udp) else None)
            for s in self.socks + self.udp:  # a dead supervisor's port must not stay held
                if s not in mine:
                    s.close()
            die_with(self.pid)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a pending SIGTERM lands here
            gen, publish = self.current, self.stats.publisher(slot)
            if index >= self.first_plain and self.plain_app is not None:
                app = self.plain_app(gen.site, self.limits, publish=publish, log=self.log)
            else:
                app = App(gen.site, self.limits, publish=publish, log=self.log,
                          protocols=gen.protocols, alt_svc=self.alt_svc)
            body = self.loop_cls(self.socks[index], app, *self._datagrams(index, app))
            self.stats.mark_started(slot)
            body.run(lambda: bool(stop))
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def _datagrams(self, index: int, app: App) -> tuple:
        """The datagram side of worker ``index``'s loop body (HTTP/3), or nothing."""
        if index >= len(self.udp):  # no HTTP/3, or a plain-port worker
            return ()
        from ..loops.base import Datagrams
        quic = self.current.quic
        steer = self.steering.steer(self.current.number, index) if self.steering else None
        return (Datagrams(self.udp[index], self.endpoint(app, quic), steer),)

    def tell_to_stop(self, pid: int) -> None:
        w = self.live[pid]
        if w.kill_at is None:
            w.kill_at = time.monotonic() + self.limits.grace + KILL_AFTER
            os.kill(pid, signal.SIGTERM)  # stop accepting, finish in-flight responses, exit

    def stop(self) -> None:
        """Every worker stops accepting, finishes what it has, exits; no restarts."""
        self.stopping = True
        self.due.clear()
        for pid in list(self.live):
            self.tell_to_stop(pid)
        for s in self.socks + self.udp:
            s.close()

    def reap(self) -> None:
        while self.live:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # no children left
                self.live.clear()
                return
            if pid == 0:
                return
            w = self.live.pop(pid, None)
            if w is None:  # not a worker: the ACME helper (orisha/serving/acme.py)
                self.reaped_other(pid, status)
                continue
            self.stats.release(w.slot, w.index)
            if w.kill_at is None and not self.stopping and w.gen == self.current.number:
                code = os.waitstatus_to_exitcode(status)
                print(f"orisha: worker {w.index} (pid {pid}) exited with {code}; restarting",
                      file=sys.stderr)
                now = time.monotonic()
                self.due[w.index] = now + (RESTART_PAUSE if now - w.began < RESTART_PAUSE else 0)

    def restart_due(self) -> None:
        now = time.monotonic()
        for index, at in list(self.due.items()):
            if at <= now and not self.stopping:
                del self.due[index]
                self.restarts += 1
                self.spawn(index)

    def escalate(self) -> None:
        now = time.monotonic()
        for pid, w in self.live.items():
            if w.kill_at is not None and now > w.kill_at:
                os.kill(pid, signal.SIGKILL)
                w.kill_at = float("inf")  # once

    def deadlines(self) -> list[float]:
        return [*self.due.values(), *(w.kill_at for w in self.live.values() if w.kill_at)]

    def draining(self) -> set[int]:
        """The older generations that still have workers finishing their responses."""
        return {w.gen for w in self.live.values() if w.gen != self.current.number}

    def of_current(self) -> list[Worker]:
        return [w for w in self.live.values() if w.gen == self.current.number]

    def all_started(self) -> bool:
        """Every worker of the current generation is there and has entered its loop."""
        current = self.of_current()
        return len(current) == self.size and all(self.stats.started(w.slot) for w in current)

    def totals(self) -> dict[int, list[int]]:
        """Counters per worker index: the retired workers' and the live ones' together."""
        per = {i: list(v) for i, v in self.stats.retired.items()}
        for w in self.live.values():
            acc = per.setdefault(w.index, [0] * self.stats.width)
            for k, v in enumerate(self.stats.read(w.slot)):
                acc[k] += v
        return per
