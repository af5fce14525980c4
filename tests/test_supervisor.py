"""The supervisor under faults: reload storms, stop signals, its own death, health probes.

Real processes and sockets throughout. A *slow download* is a client with a
4 KiB receive window reading pipelined copies of the 1.2 MB file at about
1 MB/s: its responses are in flight (mostly still in the worker, not in socket
buffers) for seconds, across whatever the test does to the server.
No timing thresholds: only generous waits.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest
from conftest import DEMO, LOOPS, PURE, ROOT, Server, demo_file, orisha, orisha_cmd
from httpraw import Closed, Conn

from orisha.serving.admin import HEALTH_PATH, METRICS_PATH, READY_PATH
from orisha.serving.supervisor import MAX_DRAINING

BIG = "/files/big.txt"
# A stop grace far above any download here: nothing is cut short, however slow the machine.
SLOW_LIMITS = ["--grace", "120"]


def wait_for(pred, timeout: float = 30.0, step: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


class SlowDownload(Conn):
    """``copies`` pipelined GETs of BIG read slowly in a thread; ``.check()`` asserts every byte."""

    def __init__(self, port: int, copies: int = 4, keep_open: bool = False) -> None:
        self.copies, self.keep_open = copies, keep_open
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect
        self.sock.connect(("127.0.0.1", port))
        self.sock.settimeout(60)
        self.buf = b""
        self.bodies: list[bytes] = []
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.send(f"GET {BIG} HTTP/1.1\r\nHost: t\r\n\r\n".encode() * copies)
        self.thread = threading.Thread(target=self._read_all, daemon=True)
        self.thread.start()

    def _fill(self) -> None:
        data = self.sock.recv(16384)
        if not data:
            raise Closed()
        self.started.set()
        self.buf += data
        time.sleep(0.003)  # about 1 MB/s (the kernel hands over ~4 KiB per recv)

    def _read_all(self) -> None:
        try:
            for _ in range(self.copies):
                r = self.read()
                self.bodies.append(r.body if r.status == 200 else b"status %d" % r.status)
        except BaseException as e:  # reported by check()
            self.error = e
        finally:
            self.started.set()
            # Like curl, close when done: a client that keeps an idle connection open
            # holds a retiring worker until the server's lingering close gives up.
            if not self.keep_open:
                self.sock.close()

    def check(self, timeout: float = 300) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "download still running"
        assert self.error is None, repr(self.error)
        big = demo_file(BIG[1:])
        assert len(self.bodies) == self.copies and all(b == big for b in self.bodies)


def live_processes(text: str) -> list[int]:
    """Pids (not zombies) whose command line contains ``text``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone meanwhile
            continue
        if text in cmd and state != "Z":
            found.append(int(name))
    return found


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def port_free(port: int) -> bool:
    """True when nothing listens on ``port``: a plain bind (SO_REUSEADDR, no SO_REUSEPORT,
    which would share a live listener's port) succeeds."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str) -> tuple[int, bytes]:
    c = Conn(port, timeout=10)
    try:
        r = c.request(path)
        return r.status, r.body
    finally:
        c.sock.close()


def planets(port: int) -> bytes:
    try:
        return get(port, "/data/planets.json")[1]
    except OSError:
        return b""


@pytest.fixture(scope="session")
def own_build_template(tmp_path_factory):
    """The two builds ``own_build`` copies: made once, not twice per test (27 tests; a
    build of the demo costs ~0.7 s of CPU and a copy a few ms; a build's files name no
    folder, site.py maps its blob beside ``__file__``)."""
    base = tmp_path_factory.mktemp("own-build")
    site = base / "site"
    shutil.copytree(DEMO, site)
    out = str(base / "out")
    assert orisha("build", str(site), "-o", out).returncode == 0
    (site / "data" / "planets.json").write_text('["after the storm"]\n')
    new = str(base / "new")
    assert orisha("build", str(site), "-o", new).returncode == 0
    return out, new


@pytest.fixture
def own_build(tmp_path, own_build_template):
    """A private build of the demo site (its path marks the server's processes), plus a
    second build with new content to swap in."""
    copies = tuple(str(tmp_path / name) for name in ("out", "new"))
    for template, copy in zip(own_build_template, copies):
        shutil.copytree(template, copy)  # copy2: the .pyc stays newer than its site.py
    return copies


def finish(s: Server, build: str) -> str:
    """Stop the server (exit 0), check no process of it is left; return its stderr.
    Whatever the outcome, nothing of it outlives the test."""
    try:
        assert s.stop(timeout=120) == 0
        err = s.proc.stderr.read()
        assert "Traceback" not in err, err
        assert wait_for(lambda: not live_processes(build), 30), live_processes(build)
        return err
    finally:
        for pid in live_processes(build):
            os.kill(pid, signal.SIGKILL)


class HeldDownload(SlowDownload):
    """A slow download that stops reading after its first bytes until ``.go`` is set: its
    generation stays draining for as long as the test needs, however slow the machine."""

    def __init__(self, port: int, **kw) -> None:
        self.go = threading.Event()
        super().__init__(port, **kw)

    def _fill(self) -> None:
        super()._fill()
        self.go.wait(300)


def holder(port: int, d: SlowDownload) -> int | None:
    """The pid of the worker holding the server's end of ``d``'s connection."""
    peer = d.sock.getsockname()[1]
    out = subprocess.run(["ss", "-tnpH", "state", "established",
                          f"( sport = :{port} and dport = :{peer} )"],
                         capture_output=True, text=True).stdout
    m = re.search(r"pid=(\d+)", out)
    return int(m.group(1)) if m else None


def metric(admin: int, name: str) -> int:
    text = get(admin, METRICS_PATH)[1].decode()
    return int(re.search(rf"^orisha_{name} (\d+)$", text, re.M).group(1))


@pytest.mark.parametrize("loop", LOOPS)
def test_reload_storm_while_generations_drain(own_build, loop):
    out, new = own_build
    admin = free_port()
    # Held downloads take nothing for as long as the test's waits: the send timeout is above them.
    s = Server(out, "--loop", loop, "--workers", "2", "--admin-port", str(admin),
               "--send-timeout", "600", *SLOW_LIMITS)
    downloads: list[SlowDownload] = []
    try:
        # MAX_DRAINING generations, each holding a download, then a storm. A retired
        # generation accepts until its worker's next tick (~1 s, longer on a loaded host),
        # and SIGHUPs that reach the supervisor while it reloads count as one: so each
        # reload is awaited (the admin port's counter), and a download that a retired
        # generation took is kept (it is checked too) and another one started.
        before: set[int] = set()  # the workers of every generation before the current one

        def held_by_the_current_generation() -> bool:
            d = HeldDownload(s.port, copies=10)  # 12 MB: more than socket buffers hold
            downloads.append(d)
            assert d.started.wait(60)
            return holder(s.port, d) not in before

        for k in range(MAX_DRAINING):
            assert wait_for(held_by_the_current_generation, 120, 0.2)
            before |= set(children(s.proc.pid))
            s.proc.send_signal(signal.SIGHUP)
            assert wait_for(lambda: metric(admin, "reloads_total") == k + 1, 120)
            assert s.proc.poll() is None
        assert metric(admin, "draining_generations") == MAX_DRAINING
        os.rename(out, out + ".old")  # the new content, swapped in whole
        os.rename(new, out)
        for k in range(40):
            s.proc.send_signal(signal.SIGHUP)
            if k == 20:
                downloads.append(SlowDownload(s.port))
            time.sleep(0.005)
        assert metric(admin, "reloads_total") == MAX_DRAINING  # every generation still holds one
        for d in downloads:
            if isinstance(d, HeldDownload):
                d.go.set()
        # The last reload wins, once a draining generation has finished.
        assert wait_for(lambda: planets(s.port) == b'["after the storm"]\n', 240)
        assert s.proc.poll() is None
        for d in downloads:
            d.check()
    finally:
        for d in downloads:
            if isinstance(d, HeldDownload):
                d.go.set()
        err = finish(s, os.path.dirname(out))
    assert "reload deferred" in err, err


@pytest.mark.parametrize("loop", LOOPS)
def test_any_signal_sequence_ends_in_a_clean_stop(own_build, loop):
    out, _ = own_build
    s = Server(out, "--loop", loop, "--workers", "2", *SLOW_LIMITS)
    d = SlowDownload(s.port)
    assert d.started.wait(30)
    for sig in [signal.SIGHUP] * 10 + [signal.SIGTERM] + [signal.SIGHUP] * 5 + [
            signal.SIGINT, signal.SIGTERM, signal.SIGHUP]:
        s.proc.send_signal(sig)
        time.sleep(0.003)  # about 1 MB/s (the kernel hands over ~4 KiB per recv)
    assert s.proc.poll() is None  # still finishing the download
    d.check()
    finish(s, os.path.dirname(out))


@pytest.mark.parametrize("loop", LOOPS)
def test_a_client_that_keeps_its_connection_open_does_not_hold_the_stop(own_build, loop):
    # After its last response the connection lingers (the core's LINGER, seconds) for the
    # client's EOF; a body that stops ticking while it drains would hold it for the grace.
    out, _ = own_build
    s = Server(out, "--loop", loop, "--workers", "2", "--grace", "600")
    d = SlowDownload(s.port, keep_open=True)
    try:
        assert d.started.wait(30)
        s.proc.send_signal(signal.SIGTERM)
        d.check()
        assert s.proc.wait(120) == 0  # far below the grace: let go after the linger
    finally:
        d.sock.close()
        finish(s, os.path.dirname(out))


@pytest.mark.parametrize("loop", LOOPS)
def test_killed_supervisor_leaves_no_worker_and_frees_the_port(own_build, loop):
    out, _ = own_build
    s = Server(out, "--loop", loop, "--workers", "2", *SLOW_LIMITS)
    d = SlowDownload(s.port)
    assert d.started.wait(30)
    workers = children(s.proc.pid)
    assert len(workers) == 2
    s.proc.kill()  # SIGKILL: nothing of the supervisor runs
    s.proc.wait(10)
    try:
        # Every worker stops accepting at once (their listeners close)…
        assert wait_for(lambda: port_free(s.port), 15), f"port {s.port} still held"
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", s.port), timeout=2)
        # …finishes what it had in flight, and exits.
        d.check()
        assert wait_for(lambda: not live_processes(os.path.dirname(out)), 30)
    finally:
        for pid in live_processes(os.path.dirname(out)):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("loop", LOOPS)
def test_health_probes_on_the_admin_port(own_build, loop):
    out, _ = own_build
    admin = free_port()
    s = Server(out, "--loop", loop, "--workers", "2", "--admin-port", str(admin), *SLOW_LIMITS)
    url = f"http://127.0.0.1:{admin}"
    try:
        assert get(admin, HEALTH_PATH) == (200, b"ok\n")
        assert wait_for(lambda: get(admin, READY_PATH) == (200, b"ready\n"))
        assert "orisha_ready 1" in get(admin, METRICS_PATH)[1].decode()
        r = orisha("health", url + READY_PATH, timeout=60)
        assert r.returncode == 0, r.stderr
        r = orisha("health", url + "/nope", timeout=60)
        assert r.returncode == 1 and r.stderr.strip().endswith("404 Not Found"), r.stderr
        assert len(r.stderr.splitlines()) == 1, r.stderr
        s.proc.send_signal(signal.SIGHUP)  # a reload is no reason to take the replica out
        answers = set()
        for _ in range(30):
            answers.add(get(admin, READY_PATH))
            time.sleep(0.02)
        assert answers == {(200, b"ready\n")}

        d = SlowDownload(s.port)  # keeps the server stopping for a while
        assert d.started.wait(30)
        s.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: get(admin, READY_PATH) == (503, b"stopping\n"))
        assert get(admin, HEALTH_PATH) == (200, b"ok\n")  # alive, just not ready
        r = orisha("health", url + READY_PATH, timeout=60)
        assert r.returncode == 1 and "503 Service Unavailable" in r.stderr, r.stderr
        assert len(r.stderr.splitlines()) == 1, r.stderr
        d.check()
    finally:
        finish(s, os.path.dirname(out))
    r = orisha("health", url + HEALTH_PATH, timeout=60)  # gone: refused
    assert r.returncode == 1 and r.stderr.startswith("orisha: unhealthy: "), r.stderr


class Hammer:
    """Threads making fresh connections without pause, one GET each, until ``stop()``;
    ``outcomes``: a status, or how the connection failed."""

    def __init__(self, port: int, threads: int = 3) -> None:
        self.port = port
        self.outcomes: list = []
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def _one(self):
        try:
            c = Conn(self.port, timeout=60)
        except ConnectionRefusedError:
            return "refused"
        except ConnectionResetError:  # still in the handshake when the port closed
            return "reset"
        try:
            return c.request("/data/planets.json").status
        except Closed:
            return "closed unanswered"
        except (ConnectionResetError, BrokenPipeError):
            return "reset"
        except socket.timeout:
            return "timeout"
        finally:
            c.sock.close()

    def _run(self) -> None:
        while not self.done.is_set():
            try:
                self.outcomes.append(self._one())
            except Exception as e:  # anything else is an outcome the test reports
                self.outcomes.append(repr(e))

    def more(self, n: int) -> bool:
        """Wait until ``n`` more connections have been made."""
        goal = len(self.outcomes) + n
        return wait_for(lambda: len(self.outcomes) >= goal, 60)

    def stop(self) -> list:
        self.done.set()
        for t in self.threads:
            t.join(120)
        assert not any(t.is_alive() for t in self.threads)
        return self.outcomes


def metric(admin: int, name: str) -> int:
    """The sum over workers of ``orisha_<name>`` on the admin port."""
    text = get(admin, METRICS_PATH)[1].decode()
    return sum(int(line.split()[-1]) for line in text.splitlines()
               if line.startswith(f"orisha_{name}{{") or line.startswith(f"orisha_{name} "))


@pytest.mark.parametrize("loop", LOOPS + PURE)
def test_a_request_after_the_responses_in_flight_at_a_reload_is_answered(own_build, loop):
    """Over a real socket, across a real SIGHUP: a keep-alive connection with ten large
    responses in flight when its worker retires (told to stop before the supervisor says
    ``reloaded``; the client has read nothing, so they are still the worker's to write)
    sends one more request. Every response arrives whole, the ten as they began
    (keep-alive) and the last with ``Connection: close``; then the connection closes.
    (Before, the retiring worker closed after the responses in flight: the request sent
    after them, on a connection no response had said would close, was read while
    lingering and never answered.)"""
    out, _ = own_build
    s = Server(out, "--loop", loop, "--workers", "1", *SLOW_LIMITS)
    try:
        c = Conn.__new__(Conn)
        c.sock = socket.socket()
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect
        c.sock.connect(("127.0.0.1", s.port))
        c.sock.settimeout(30)
        c.send(f"GET {BIG} HTTP/1.1\r\nHost: t\r\n\r\n".encode() * 10)  # 12 MB
        c.buf = c.sock.recv(1000)  # they have begun
        s.proc.send_signal(signal.SIGHUP)
        while "orisha: reloaded" not in s.proc.stderr.readline():  # the old worker was told
            pass
        c.send(b"GET /css/site.css HTTP/1.1\r\nHost: t\r\n\r\n")
        for _ in range(10):
            r = c.read()
            assert r.status == 200 and r.body == demo_file(BIG[1:]) and r.h("connection") is None
        last = c.read()
        assert last.status == 200 and last.body == demo_file("css/site.css")
        # with Connection: close once the worker has seen its stop (the asyncio body looks
        # once a second, and its transport may read the request before: then keep-alive,
        # and the connection closes LINGER after it)
        assert last.h("connection") == "close" or loop == "asyncio", last.fields
        with pytest.raises(Closed):
            c._fill()
    finally:
        finish(s, os.path.dirname(out))


@pytest.mark.parametrize("loop", LOOPS + PURE)
def test_connections_made_at_a_reload_or_a_stop_are_answered_or_refused(own_build, loop):
    """Fresh connections without pause across reloads, then across the stop. A worker
    that sees its stop flag in the same turn as a connection on its listener must not
    accept it and then drop it unanswered (orisha/loops/base.py, the graceful stop).

    At a reload every connection is answered: the listener stays open in the supervisor
    and the new generation. At the stop each is answered or refused (ECONNREFUSED, or a
    reset for one still queued when the port closed, which a client cannot tell from a
    reset after an accept) — so the workers' own count of accepted connections must
    equal the answered ones: none was accepted and then dropped."""
    out, _ = own_build
    admin = free_port()
    env = {**os.environ, "ORISHA_PURE": "1"} if loop in PURE else None
    s = Server(out, "--loop", loop.removesuffix("-pure"), "--workers", "2",
               "--admin-port", str(admin), *SLOW_LIMITS, env=env)
    try:
        hammer = Hammer(s.port)
        for k in range(1, 6):
            assert hammer.more(20)
            s.proc.send_signal(signal.SIGHUP)
            assert wait_for(lambda: metric(admin, "reloads_total") == k)
        assert hammer.more(20)
        at_reloads = hammer.stop()
        assert set(at_reloads) == {200}, sorted(set(map(str, at_reloads)))

        d = SlowDownload(s.port, copies=20)  # keeps the supervisor (and its admin port) up
        assert d.started.wait(30)
        hammer = Hammer(s.port)
        assert hammer.more(20)
        s.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: hammer.outcomes.count("refused") >= 3, 60)  # the port closed
        at_stop = hammer.stop()
        assert set(at_stop) <= {200, "refused", "reset"}, sorted(set(map(str, at_stop)))
        answered = at_reloads.count(200) + at_stop.count(200) + 1  # and the slow download
        accepted = []  # counters leave a worker once a second and when it exits

        def settled() -> bool:
            accepted.append(metric(admin, "connections_total"))
            return accepted[-1] == answered
        assert wait_for(settled, 10), f"{accepted[-1]} connections accepted, {answered} answered"
        d.sock.shutdown(socket.SHUT_RDWR)  # it has served its purpose: the stop ends sooner
        d.thread.join(60)
    finally:
        finish(s, os.path.dirname(out))


def test_health_command_exit_codes():
    replies = {b"/ok": b"HTTP/1.1 204 No Content\r\n\r\n",
               b"/bad": b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n",
               b"/junk": b"SSH-2.0-OpenSSH\r\n"}
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # accepts (the kernel does) but never answers

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                path = c.recv(4096).split(b" ")[1]
                c.sendall(replies[path])

    threading.Thread(target=serve, daemon=True).start()
    port = srv.getsockname()[1]
    try:
        cases = [(f"http://127.0.0.1:{port}/ok", 0, "204 No Content"),
                 (f"http://127.0.0.1:{port}/bad", 1, "500 Internal Server Error"),
                 (f"http://127.0.0.1:{port}/junk", 1, "not an HTTP answer"),
                 (f"http://127.0.0.1:{free_port()}/", 1, "refused"),
                 (f"http://127.0.0.1:{silent.getsockname()[1]}/", 1, "no answer within 0.5 s"),
                 ("https://127.0.0.1/", 1, "not an http://"),
                 ("nonsense", 1, "not an http://")]
        for url, code, words in cases:
            r = subprocess.run([*orisha_cmd(), "health", "--timeout", "0.5", url],
                               capture_output=True, text=True, cwd=ROOT, timeout=60)
            said = r.stdout + r.stderr
            assert r.returncode == code and words in said and len(said.splitlines()) == 1, (url, r)
    finally:
        srv.close()
        silent.close()
