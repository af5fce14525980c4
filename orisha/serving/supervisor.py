"""Workers and their supervisor: spawn, reap, reload, stop, answer the admin port.

Strategy: the supervisor forks one worker per listener (a *generation*) and
then only waits — for signals (through a wake-up pipe), for admin requests,
and for the next deadline (a restart that is due, a worker past its grace).
One module per concern: here ``Supervisor`` (the loop: signals, reloads,
renewals, stops, the admin port's status); pool.py ``Generation`` (what a
generation's workers are forked with), ``Pool`` (the processes: fork, reap,
restart, SIGKILL) and ``Steering`` (HTTP/3's hand-over between workers);
stats.py ``SharedStats`` (the counters); watch.py ``FileWatch`` (certificate
files); acme.py ``Manager`` (ACME). The
workers run a loop body over the core and know nothing of this module beyond a
stop flag and two shared slots.

Certificates are run-time data handed over the same way: ``_renew`` starts a new
generation with protocols made anew (no build reload) when the watched certificate
files change (``FileWatch``) or the ACME manager (acme.py, stepped every turn,
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
import os
import select
import signal
import socket
import sys
import time
from typing import Callable

from ..core.connection import App
from ..core.policy import Limits
from ..errors import ServeError
from .admin import Status, answer
from .pool import HANDLED, RELOAD_SIGNAL, STOP_SIGNALS, Generation, Pool, Steering, die_with
from .stats import SharedStats
from .watch import FileWatch

MAX_DRAINING = 4  # older generations that may finish their responses at once


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
        # ``acme``: the certificate manager (orisha/serving/acme.py), stepped every turn.
        self.watch, self.acme = watch, acme
        udp = udp or []
        self.steering = Steering.make() if udp else None
        stats = SharedStats((len(socks) + len(plain)) * (MAX_DRAINING + 1),  # several sites:
                            len(getattr(site, "names_of", ())))  # a table (core/hosts.py)
        first = Generation(0, site, protocols() if protocols else None, quic() if quic else None)
        self.pool = Pool(socks, plain, udp, loop_cls, limits, stats, first, log=log,
                         plain_app=plain_app, alt_svc=alt_svc, steering=self.steering,
                         keep_out=self._keep_out, endpoint=getattr(quic, "endpoint", None),
                         reaped=acme.reaped if acme else (lambda pid, status: None))
        self.stopping = self.reload_pending = self.serving = False
        self.renew_pending = ""  # why a renewal waits for a draining generation to finish
        self.reloads = 0
        self.exit_status = 0  # 1 after ``fail`` (a first ACME issuance that failed)
        self.pid = os.getpid()
        self.got: list[int] = []
        self.wake_r, self.wake_w = os.pipe()  # signals wake select through this pipe
        os.set_blocking(self.wake_w, False)

    # What orisha/serving/acme.py and orisha/serving/server.py read of the generation in service.
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
        die_with(self.pid)

    def start(self) -> None:
        for sig in HANDLED:
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
        """What the admin port reports (orisha/serving/admin.py): ready or why not, and counters."""
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
