"""Workers and their supervisor: spawn, reap, reload, stop, answer the admin port.

Strategy: the supervisor forks one worker per listener (a *generation*) and
then only waits — for signals (through a wake-up pipe), for admin requests,
and for the next deadline (a restart that is due, a worker past its grace).
One class per concern: ``Generation`` (what a generation's workers are forked
with), ``Pool`` (the processes: fork, reap, restart, SIGKILL), ``Supervisor``
(the loop: signals, reloads, renewals, stops, the admin port's status),
``SharedStats`` (the counters), ``FileWatch`` (certificate files), ``_Steering``
(HTTP/3's hand-over between workers); ACME is orisha/acme.py's ``Manager``. The
workers run a loop body over the core and know nothing of this module beyond a
stop flag and two shared slots.

Certificates are run-time data handed over the same way: ``_renew`` starts a new
generation with protocols made anew (no build reload) when the watched certificate
files change (``FileWatch``) or the ACME manager (orisha/acme.py, stepped every turn,
its helper process reaped here) has challenges or a certificate for the workers. The
plain port beside a TLS port (``plain``) is served by one more worker per listener.

No fault may leave the service down or a process behind:

- Signals at any rate: SIGHUP while older generations are still draining
  starts another generation, up to ``MAX_DRAINING`` draining at once; beyond
  that the reload is *deferred* (logged once) and runs as soon as one has
  drained, so the last SIGHUP always wins. Counter slots are recycled, sized
  for that bound, so a storm can never run out of them.
- A worker that is told to stop gets ``grace + KILL_AFTER`` seconds, then SIGKILL
  (stuck or not, stopping or retired by a reload).
- A worker that dies is restarted (after ``RESTART_PAUSE`` if it died young:
  no fork loop), without the supervisor ever sleeping: it keeps answering probes.
- The supervisor dying for any reason (kill -9, the OOM killer, a bug) stops
  every worker: each asks the kernel for SIGTERM on its parent's death
  (``PR_SET_PDEATHSIG``) — its graceful stop — and checks its parent is still
  the one that forked it, which closes the race with a death before the prctl.
- Stop and reload signals are blocked around ``fork``: a SIGTERM sent to a
  worker before it has installed its handler stays pending instead of being lost.
- Once the stop is done, stop and reload signals are ignored: a second SIGTERM
  while the interpreter exits cannot turn the exit status 0 into death by signal.
"""

from __future__ import annotations

import gc
import mmap
import os
import select
import signal
import socket
import struct
import sys
import time
from typing import Callable

from .admin import Status, answer
from .core.connection import App
from .core.policy import STATS_SLOTS, Limits, Stat
from .errors import ServeError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # graceful stop (Docker and Kubernetes send SIGTERM)
RELOAD_SIGNAL = signal.SIGHUP
_HANDLED = (*STOP_SIGNALS, RELOAD_SIGNAL, signal.SIGCHLD)
KILL_AFTER = 2.0  # seconds past the stop grace before a worker that has not exited is SIGKILLed
MAX_DRAINING = 4  # older generations that may finish their responses at once
RESTART_PAUSE = 1.0  # a worker that died younger than this is restarted after this long
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _libc_prctl():
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    return ctypes.CDLL(None, use_errno=True).prctl


_PRCTL = _libc_prctl()  # looked up once, before any fork


class SharedStats:
    """Counters and a started flag per worker slot, in one map shared across fork.

    Each worker writes its counters once a second (``App.tick``) and sets its
    started flag when it enters its loop body; the supervisor reads them for the
    admin port and folds a slot into ``retired`` when its worker exits, so totals
    survive restarts and reloads. ``sites``: several sites (``--site``), whose request
    counters follow the worker's in each slot (``App.site_stats``).
    """

    def __init__(self, slots: int, sites: int = 0) -> None:
        self.width = STATS_SLOTS * (1 + sites)
        self.fmt = struct.Struct(f"<{self.width}q")
        self.started_at = slots * self.fmt.size  # then one byte per slot
        self.map = mmap.mmap(-1, self.started_at + slots)
        self.free = list(range(slots))
        self.retired: dict[int, list[int]] = {}

    def take(self) -> int:
        if not self.free:  # sized for MAX_DRAINING: reaching this is a bug, not a load
            raise RuntimeError("no free counter slot")
        slot = self.free.pop()
        self.fmt.pack_into(self.map, slot * self.fmt.size, *([0] * self.width))
        self.map[self.started_at + slot] = 0
        return slot

    def publisher(self, slot: int) -> Callable[[list[int]], None]:
        fmt, buf, off = self.fmt, self.map, slot * self.fmt.size
        return lambda stats: fmt.pack_into(buf, off, *stats)

    def mark_started(self, slot: int) -> None:
        self.map[self.started_at + slot] = 1

    def started(self, slot: int) -> bool:
        return self.map[self.started_at + slot] == 1

    def read(self, slot: int) -> tuple[int, ...]:
        return self.fmt.unpack_from(self.map, slot * self.fmt.size)

    def release(self, slot: int, index: int) -> None:
        acc = self.retired.setdefault(index, [0] * self.width)
        for k, v in enumerate(self.read(slot)):
            if k != Stat.OPEN_CONNECTIONS:  # a gauge: a dead worker has none
                acc[k] += v
        self.free.append(slot)


class FileWatch:
    """Files polled for change (certbot renew, a Kubernetes Secret's symlink swap): their
    device, inode, size and mtime, through symlinks, compared about once a second."""

    def __init__(self, paths: list[str], every: float = 1.0) -> None:
        self.paths, self.every = paths, every
        self.seen = self._look()
        self.next = time.monotonic() + every

    def _look(self) -> tuple:
        out = []
        for p in self.paths:
            try:
                st = os.stat(p)
            except OSError as e:  # mid-rename, or gone: a change the reload will report
                out.append(e.errno)
                continue
            out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def changed(self) -> bool:
        now = time.monotonic()
        if now < self.next:
            return False
        self.next = now + self.every
        seen = self._look()
        if seen == self.seen:
            return False
        self.seen = seen
        return True


class _Steering:
    """What every HTTP/3 worker of every generation shares to steer datagrams by connection
    ID (orisha/protocols/quic_steer.py): a private folder for the workers' hand-over
    sockets (0700: no other user can hand datagrams in), the key that masks the tags, and
    the shared table of IDs the tags cannot name (``Owners``)."""

    def __init__(self, folder: str) -> None:
        from .protocols.quic_steer import Owners
        self.folder, self.key = folder, os.urandom(16)
        self.owners = Owners(self.key)  # before the first fork: every worker's pages

    @classmethod
    def make(cls) -> "_Steering | None":
        import tempfile
        try:
            return cls(tempfile.mkdtemp(prefix="orisha-quic-"))
        except OSError as e:  # no writable temporary folder (TMPDIR, /tmp): connections
            print(f"orisha: HTTP/3 connections will not outlive a reload: no private "  # as before
                  f"folder for the hand-over sockets ({e})", file=sys.stderr)
            return None

    def steer(self, gen: int, index: int):
        from .protocols.quic_steer import Steer
        return Steer(self.folder, self.key, gen, index, self.owners)

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


def _die_with(parent: int) -> None:
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
                 steering: "_Steering | None" = None,
                 keep_out: Callable[[], None] = lambda: None,
                 reaped: Callable[[int, int], None] = lambda pid, status: None) -> None:
        # ``plain``: the plain port beside the TLS port (``--http-port``), one more worker per
        # listener, whose app ``plain_app(site, limits, publish=, log=)`` makes (the redirect
        # to https and the ACME HTTP-01 answers, orisha/core/upgrade.py).
        self.first_plain = len(socks)
        self.socks = list(socks) + list(plain)
        # HTTP/3: one UDP socket per TLS worker (worker i reads udp[i]; the plain port's
        # workers have none).
        self.udp = udp
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
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED)
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
            _die_with(self.pid)
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
        from .loops.base import Datagrams
        from .protocols.h3 import Endpoint
        steer = self.steering.steer(self.current.number, index) if self.steering else None
        return (Datagrams(self.udp[index], Endpoint(app, self.current.quic), steer),)

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
            if w is None:  # not a worker: the ACME helper (orisha/acme.py)
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


class Supervisor:
    """Keeps a pool of workers right: signals, reloads, renewals, stops, probes.

    Strategy: ``serve`` is one loop that waits in ``select`` for the wake-up pipe (the
    signals), the admin port and the ACME helper, at most until the pool's next deadline,
    then takes one non-blocking step of each concern: the admin probe (``status``), a stop,
    the pool's reaping and restarts, a reload (``_reload``: SIGHUP, the build again), a
    renewal (``_renew``: certificate files changed, or ACME wants one), ACME's own step.
    A reload or renewal that would exceed ``MAX_DRAINING`` generations waits (deferred);
    one whose new generation cannot be made keeps the one in service and says why.
    """

    def __init__(self, site, socks: list[socket.socket], loop_cls, limits: Limits, *,
                 load: Callable[[], object] | None = None, log=None,
                 admin: socket.socket | None = None, name: str = "",
                 protocols: Callable[[], object] | None = None,
                 plain: list[socket.socket] = (), plain_app: Callable[..., App] | None = None,
                 watch: "FileWatch | None" = None, acme=None,
                 udp: list[socket.socket] | None = None, quic: Callable[[], object] | None = None,
                 alt_svc: bytes = b"") -> None:
        self.load, self.admin, self.name = load, admin, name
        # ``protocols`` makes a generation's TLS/HTTP/2 front (orisha/protocols/), here in the
        # supervisor so every worker shares one TLS context (one set of session-ticket keys)
        # and a reload reads the certificate anew; ``quic`` likewise its QUIC configuration.
        self.make_protocols, self.make_quic = protocols, quic
        # ``watch``: the certificate files, polled about once a second; a change starts a
        # new generation as SIGHUP does, without reloading the build (``_renew``).
        # ``acme``: the certificate manager (orisha/acme.py), stepped every turn.
        self.watch, self.acme = watch, acme
        udp = udp or []
        self.steering = _Steering.make() if udp else None
        stats = SharedStats((len(socks) + len(plain)) * (MAX_DRAINING + 1),  # several sites:
                            len(getattr(site, "names_of", ())))  # a table (core/hosts.py)
        first = Generation(0, site, protocols() if protocols else None, quic() if quic else None)
        self.pool = Pool(socks, plain, udp, loop_cls, limits, stats, first, log=log,
                         plain_app=plain_app, alt_svc=alt_svc, steering=self.steering,
                         keep_out=self._keep_out,
                         reaped=acme.reaped if acme else (lambda pid, status: None))
        self.stopping = self.reload_pending = self.serving = False
        self.renew_pending = ""  # why a renewal waits for a draining generation to finish
        self.reloads = 0
        self.exit_status = 0  # 1 after ``fail`` (a first ACME issuance that failed)
        self.pid = os.getpid()
        self.got: list[int] = []
        self.wake_r, self.wake_w = os.pipe()  # signals wake select through this pipe
        os.set_blocking(self.wake_w, False)

    # What orisha/acme.py and orisha/server.py read of the generation in service.
    gen = property(lambda self: self.pool.current.number)
    site = property(lambda self: self.pool.current.site)
    quic = property(lambda self: self.pool.current.quic)
    socks = property(lambda self: self.pool.socks)

    def _keep_out(self) -> None:
        """In a forked worker: let go of what is the supervisor's own."""
        os.close(self.wake_r)
        os.close(self.wake_w)
        if self.admin is not None:
            self.admin.close()
        if self.acme:
            self.acme.forked()  # the worker holds no end of the ACME helper's pipe

    def forked_helper(self) -> None:
        """In a helper forked from the supervisor (the ACME client): its signal handling
        back to the defaults, what is the supervisor's own closed (the admin port, the
        listeners, the wake-up pipe), and a SIGTERM when the supervisor dies."""
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        for s in [self.admin] + self.socks:
            if s is not None:
                s.close()
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)
        _die_with(self.pid)

    def start(self) -> None:
        for sig in _HANDLED:
            signal.signal(sig, lambda signo, _f: self.got.append(signo))
        signal.set_wakeup_fd(self.wake_w)
        self.pool.spawn_generation(self.pool.current)

    def serve(self) -> int:
        """Run until stopped and every worker has exited; returns the exit status (0)."""
        waits = [self.wake_r] + ([self.admin] if self.admin else [])
        while not (self.stopping and not self.pool.live):
            acme_fd = self.acme.fileno() if self.acme else None
            ready, _, _ = select.select(waits + ([acme_fd] if acme_fd is not None else []),
                                        [], [], self._timeout())
            if self.wake_r in ready:
                os.read(self.wake_r, 512)
            if self.admin in ready:
                answer(self.admin, self.status)
            signals, self.got[:] = self.got[:], []
            if any(s in STOP_SIGNALS for s in signals):
                self._stop()
            self.pool.reap()
            if RELOAD_SIGNAL in signals or self.reload_pending:
                self._reload()
            self.pool.restart_due()
            self.pool.escalate()
            if self.renew_pending and not self.stopping:
                self._renew(self.renew_pending)
            if self.watch and not self.stopping and self.watch.changed():
                self._renew("the certificate files changed")
            if self.acme and not self.stopping:
                self.acme.step(self, acme_fd in ready)
        self._settle_signals()
        if self.steering:
            self.steering.remove()
        return self.exit_status

    @staticmethod
    def _settle_signals() -> None:
        """Stopped: from here to the process's end, stop and reload signals are ignored.

        The exit that follows finalizes the interpreter, and CPython's ``_PySignal_Fini``
        first puts every signal with a Python handler back to its default action, then
        tears down the modules (the loaded site among them). A second SIGTERM in that
        window (an impatient ``docker stop``, a test's teardown) would turn a clean stop
        into death by SIGTERM; ignored signals stay ignored through finalization.
        """
        signal.set_wakeup_fd(-1)
        for sig in (*STOP_SIGNALS, RELOAD_SIGNAL):
            signal.signal(sig, signal.SIG_IGN)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # no worker is left to reap

    def _timeout(self) -> float:
        """Seconds until the next thing to do (a restart, a SIGKILL), at most 1."""
        deadlines = self.pool.deadlines()
        if self.acme:
            deadlines.append(self.acme.deadline())
        return max(0.0, min([1.0] + [t - time.monotonic() for t in deadlines]))

    # -- reloads and renewals --------------------------------------------------------
    def _reload(self) -> None:
        """SIGHUP: load the build again, start a generation on it, retire the current one."""
        if self.stopping or (self.load is None and self.make_protocols is None):
            self.reload_pending = False
            return
        draining = len(self.pool.draining())
        if draining >= MAX_DRAINING:
            if not self.reload_pending:
                print(f"orisha: reload deferred: {draining} generations are still finishing "
                      "their responses; it runs when one has", file=sys.stderr)
            self.reload_pending = True
            return
        self.reload_pending = False
        gc.unfreeze()  # let the previous sites (cycles through their modules) be collected
        gc.collect()
        try:
            gen = self.pool.current.anew(self.load, self.make_protocols, self.make_quic)
        except ServeError as e:
            gc.freeze()
            print(f"orisha: reload failed, still serving the previous build: {e}", file=sys.stderr)
            return
        self.reloads += 1
        self._replace(gen)
        print(f"orisha: reloaded {self.name}: {gen.site.summary}", file=sys.stderr)

    def _renew(self, why: str) -> bool:
        """New certificates or challenges (the files changed, ACME): a new generation on
        the same build with protocols made anew; if they cannot be made, the current
        generation keeps serving and one line says why. True if a generation started."""
        if self.make_protocols is None:
            return False
        if len(self.pool.draining()) >= MAX_DRAINING:  # no counter slots for one more
            self.renew_pending = why  # retried each turn; ``settled`` is False until then
            return True
        self.renew_pending = ""
        try:
            gen = self.pool.current.anew(None, self.make_protocols, self.make_quic)
        except ServeError as e:
            print(f"orisha: {why}, but the new certificate is not used, still serving the "
                  f"previous one: {e}", file=sys.stderr)
            return False
        self._replace(gen)
        print(f"orisha: {why}: new generation {gen.number}", file=sys.stderr)
        return True

    def _replace(self, gen: Generation) -> None:
        """Fork ``gen``'s workers, then tell the generation before it to finish and stop."""
        for pid in self.pool.spawn_generation(gen):
            self.pool.tell_to_stop(pid)

    def settled(self) -> bool:
        """Only the current generation is left, and every one of its workers is in its loop:
        what it was forked with (a challenge, a certificate) is what every connection meets."""
        return not self.renew_pending and not self.pool.draining() and self.pool.all_started()

    # -- stopping --------------------------------------------------------------------
    def fail(self, message: str) -> None:
        """A fatal error after start (a first ACME issuance that failed): one line, stop, exit 1."""
        print(f"orisha: error: {message}", file=sys.stderr)
        self.exit_status = 1
        self._stop()

    def _stop(self) -> None:
        """SIGTERM/SIGINT: every worker stops accepting, finishes what it has, exits.

        The supervisor's copies of the listeners close now, not when the last worker has
        drained: once each worker has closed its own (as it stops accepting), the port
        refuses new connections at once instead of queueing them for nobody until the
        grace is over and then resetting them.
        """
        if not self.stopping:
            self.stopping = True
            self.pool.stop()
            if self.acme:  # an ACME attempt in progress stops too (its helper process)
                self.acme.stop()

    # -- probes ----------------------------------------------------------------------
    def status(self) -> Status:
        """What the admin port reports (orisha/admin.py): ready or why not, and counters."""
        if not self.serving:  # once every first worker has entered its loop
            self.serving = all(self.pool.stats.started(w.slot) for w in self.pool.of_current())
        if self.stopping:
            why = "stopping"
        elif not self.serving:
            why = "starting"
        elif len(self.pool.of_current()) < self.pool.size:
            why = "no worker"  # one died and waits for its restart
        else:
            # A generation that a reload has just forked may not have entered its loop yet:
            # still ready, connections wait on the listeners for the few ms that takes.
            why = ""
        site = self.site
        sites = tuple(zip(site.names_of, (x.summary for x in site.sites))) \
            if hasattr(site, "names_of") else ()  # several sites (core/hosts.py)
        extra = self.acme.counters() if self.acme else ()
        return Status(not why, why, self.pool.totals(), self.pool.restarts, self.reloads,
                      len(self.pool.draining()), sites=sites, extra=extra)
