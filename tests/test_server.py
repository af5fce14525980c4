"""The server process: start-up, workers and their supervisor, signals, the Python API."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import DEMO, ROOT, LOOPS, Server, demo_file, orisha
from httpraw import Conn


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def wait_for(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(params=LOOPS)
def server(request, builds):
    s = Server(builds["notfound"], "--loop", request.param, "--workers", "2")
    s.loop = request.param
    yield s
    s.stop()


def test_startup_line(server):
    assert server.line.startswith("orisha: serving http://127.0.0.1:")
    assert "2 workers" in server.line and "14 files" in server.line
    assert f"(loop {server.loop}, 2 workers, pid {server.proc.pid}" in server.line


def test_one_worker_per_core_by_default(builds):
    s = Server(builds["notfound"])
    try:
        assert f"{os.cpu_count()} worker" in s.line
        assert len(children(s.proc.pid)) == os.cpu_count()
    finally:
        assert s.stop() == 0


def test_port_in_use_is_one_line(builds):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = orisha("serve", builds["notfound"], "--port", str(port), timeout=30)
    assert r.returncode == 1 and r.stderr.strip() == (
        f"orisha: error: 127.0.0.1:{port}: port {port} is already in use by pid {os.getpid()}: "
        + open(f"/proc/{os.getpid()}/cmdline").read().replace("\0", " ").strip()[:200])


def test_the_holder_named_is_the_one_on_that_address(builds):
    """Another listener on the same port number elsewhere (127.0.0.2, this test's own, whose
    pid is the lower) is not the one named: the holder of 127.0.0.1's port is (a child
    process). Before, any listener on the port number counted, and the lowest pid won."""
    with socket.socket() as elsewhere:
        elsewhere.bind(("127.0.0.2", 0))
        elsewhere.listen()
        port = elsewhere.getsockname()[1]
        code = ("import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', %d)); s.listen(); "
                "print('ok', flush=True); sys.stdin.read()" % port)
        child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline() == "ok\n"
            r = orisha("serve", builds["notfound"], "--port", str(port), timeout=30)
        finally:
            child.stdin.close()
            child.wait(30)
    assert r.returncode == 1 and r.stderr.startswith(
        f"orisha: error: 127.0.0.1:{port}: port {port} is already in use by pid {child.pid}: "), \
        r.stderr


def test_not_a_build_is_one_line(tmp_path):
    r = orisha("serve", str(tmp_path / "missing"), timeout=30)
    assert r.returncode == 1 and r.stderr.startswith("orisha: error: ") and len(r.stderr.splitlines()) == 1
    assert "Traceback" not in r.stderr


def test_serve_a_site_directory_builds_first(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    env.pop("ORISHA_CACHE")
    p = subprocess.Popen([sys.executable, "-m", "orisha.cli", "serve", DEMO, "--port", "0", "--workers", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        assert p.stdout.readline().startswith("built ")
        assert os.listdir(tmp_path / "orisha" / "builds")  # the default cache folder was used
        line = p.stdout.readline()
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        assert Conn(port).request("/css/site.css").body == demo_file("css/site.css")
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(20) == 0


def test_killed_worker_is_restarted_and_others_keep_serving(server):
    workers = children(server.proc.pid)
    assert len(workers) == 2
    failures = []
    served = [0]
    stop = threading.Event()

    def load():
        while not stop.is_set():
            try:
                # As patient as a browser: a connection queued on the killed worker's listener
                # waits for the replacement's fork and start, which a loaded host (the whole
                # suite beside two busy loops) stretched past a 5 s timeout.
                c = Conn(server.port, timeout=60)
                assert c.request("/data/planets.json").status == 200
                c.close()
                served[0] += 1
            except (OSError, AssertionError) as e:
                failures.append(repr(e))

    t = threading.Thread(target=load)
    t.start()
    time.sleep(0.5)
    os.kill(workers[0], signal.SIGKILL)
    assert wait_for(lambda: len(children(server.proc.pid)) == 2 and workers[0] not in children(server.proc.pid))
    time.sleep(1.5)
    stop.set()
    t.join()
    assert served[0] > 20
    # connections queued on the dead worker's listener wait for its replacement (the parent
    # keeps the listener open); an in-flight connection of the killed worker may be reset
    assert len(failures) <= 1, failures
    assert server.proc.poll() is None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_graceful_stop_finishes_in_flight_responses(builds, sig):
    s = Server(builds["notfound"], "--workers", "1")
    c = Conn.__new__(Conn)
    c.sock = socket.socket()
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    c.sock.connect(("127.0.0.1", s.port))
    c.sock.settimeout(10)
    c.buf = b""
    c.send(b"GET /files/big.txt HTTP/1.1\r\nHost: x\r\n\r\n" * 10)  # 12 MB in flight
    first = c.sock.recv(1000)  # the responses have started; most is still in the server
    idle = Conn(s.port)
    assert idle.request("/").status == 200
    s.proc.send_signal(sig)
    time.sleep(0.5)
    assert s.proc.poll() is None  # still finishing
    assert idle.closed(3)  # idle keep-alive connections are closed at once
    c.buf = first
    for _ in range(10):
        r = c.read()
        assert r.status == 200 and r.body == demo_file("files/big.txt")
    assert c.closed(5)
    assert s.proc.wait(10) == 0
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", s.port), timeout=1)


def test_slow_reader_memory_is_bounded_and_others_are_served(builds):
    s = Server(builds["notfound"], "--workers", "1")
    try:
        worker = children(s.proc.pid)[0]
        before = rss_kib(worker)
        hogs = []
        for _ in range(20):
            h = socket.create_connection(("127.0.0.1", s.port))
            h.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            h.sendall(b"GET /files/big.txt HTTP/1.1\r\nHost: x\r\n\r\n" * 200)  # 240 MB asked, never read
            hogs.append(h)
        time.sleep(1)
        for _ in range(50):
            assert Conn(s.port).request("/css/site.css").body == demo_file("css/site.css")
        growth = rss_kib(worker) - before
        # 20 readers holding 4,800 responses of 1.2 MB: only references to shared pages are held
        assert growth < 30 * 1024, f"worker grew {growth} KiB"
        for h in hogs:
            h.close()
    finally:
        s.stop()


def test_admin_host(builds):
    # Linux routes all of 127/8 to loopback: a second address stands in for a pod's own.
    with socket.socket() as probe:
        probe.bind(("127.0.0.2", 0))
        admin = probe.getsockname()[1]
    s = Server(builds["notfound"], "--workers", "1", "--admin-port", str(admin),
               "--admin-host", "127.0.0.2")
    try:
        assert f"admin http://127.0.0.2:{admin}/metrics" in s.line
        assert Conn(admin, host="127.0.0.2").request("/healthz").status == 200
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", admin), timeout=5)
        r = orisha("health", f"http://127.0.0.2:{admin}/healthz", timeout=60)
        assert r.returncode == 0, r.stderr
    finally:
        assert s.stop() == 0


def test_python_api(tmp_path):
    code = ("import orisha; site = orisha.static('site', root=%r, fallback='200.html'); "
            "orisha.serve(site, port=0, workers=1)" % DEMO)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=ROOT)
    try:
        p.stdout.readline()
        port = int(p.stdout.readline().split("http://127.0.0.1:")[1].split("/")[0])
        r = Conn(port).request("/some/spa/route")
        assert r.status == 200 and r.body == demo_file("200.html")
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(20) == 0


def test_an_admin_port_that_clashes_is_a_one_line_error(builds):
    """The admin listener never shares its port (no SO_REUSEPORT): the serving port itself,
    or a port another Orisha's workers hold, is refused at start instead of splitting the
    connections between two servers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    r = orisha("serve", builds["notfound"], "--port", str(port), "--admin-port", str(port), timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip() == (f"orisha: error: --admin-port {port} is the serving port too; "
                                "give it another port")
    s = Server(builds["notfound"], "--workers", "1")
    try:
        r = orisha("serve", builds["notfound"], "--port", "0", "--admin-port", str(s.port), timeout=60)
        assert r.returncode == 1
        assert r.stderr.strip().startswith(
            f"orisha: error: 127.0.0.1:{s.port}: port {s.port} is already in use by pid {s.proc.pid}: ")
    finally:
        assert s.stop() == 0
