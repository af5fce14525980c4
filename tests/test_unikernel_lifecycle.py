"""The booted image's life cycle: a graceful stop, a hard kill, the one QEMU command line.

SIGTERM to ``orisha boot`` drains like the hosted loops: the guest stops
accepting, every byte of a download in flight still arrives, and the command
exits 0. kill -9 of ``orisha boot`` leaves no QEMU behind (checked in /proc).
QEMU's port forward takes bursts of connections (its accept queue is widened
from libslirp's 1). ``unikernel/run.sh`` runs the command line ``orisha boot`` runs.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import DEMO, ROOT, orisha
from unikernel_target import Booted

from orisha.targets.unikernel.boot import guest_megabytes, qemu_command, resolve_accel

pytestmark = pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                                reason="apt-get install qemu-system-x86")

BIG = "/files/big.txt"
WAIT = 60  # seconds any single wait in these tests may take before it counts as a hang


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("uk") / "demo")
    r = orisha("build", DEMO, "-o", out, "--target", "unikernel")
    assert r.returncode == 0, r.stderr
    return out


def big() -> bytes:
    with open(os.path.join(DEMO, "files", "big.txt"), "rb") as f:
        return f.read()


def start_download(port: int) -> tuple[socket.socket, bytes]:
    """A GET of the big file from a client with a small receive buffer; returns the
    socket and what was read up to the end of the head."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)  # before connect: a small window
    s.settimeout(WAIT)
    s.connect(("127.0.0.1", port))
    s.sendall(f"GET {BIG} HTTP/1.1\r\nHost: x\r\nAccept-Encoding: identity\r\n\r\n".encode())
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    return s, got


def read_slowly(s: socket.socket, got: bytes) -> bytes:
    """Read to EOF in small pieces with pauses, so the bytes still to come sit in
    QEMU's user networking and the host's socket buffers while the guest stops."""
    while True:
        chunk = s.recv(8192)
        if not chunk:
            return got
        got += chunk
        time.sleep(0.005)


def wait_for_log(vm: Booted, text: str) -> None:
    end = time.monotonic() + WAIT
    while not any(text in line for line in vm.log):
        assert vm.proc.poll() is None, "\n".join(vm.log)
        assert time.monotonic() < end, f"no {text!r} in the serial log:\n" + "\n".join(vm.log)
        time.sleep(0.02)


def no_answer(port: int) -> bool:
    """A new connection is refused, reset, or closed without a byte of answer."""
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    except ConnectionRefusedError:
        return True
    with s:
        try:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            return s.recv(4096) == b""
        except (ConnectionResetError, BrokenPipeError):
            return True


def test_sigterm_drains_a_slow_download_and_refuses_new_connections(image):
    vm = Booted(image, ["--grace", "120"])  # the stop is bounded by the download, not the grace
    try:
        s, got = start_download(vm.port)
        with s:
            got += s.recv(65536)  # the body has started
            vm.proc.send_signal(signal.SIGTERM)
            wait_for_log(vm, "orisha: stopping")
            assert vm.proc.poll() is None  # still draining: the download is not over
            assert no_answer(vm.port)
            got = read_slowly(s, got)
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and body == big(), (head, len(body))
        assert vm.proc.wait(WAIT) == 0, "\n".join(vm.log)
        assert any("orisha: drained" in line for line in vm.log)
    finally:
        vm.stop(signal.SIGKILL)


def test_a_second_signal_stops_without_waiting_for_the_download(image):
    vm = Booted(image, ["--grace", "600"])
    try:
        s, _ = start_download(vm.port)
        with s:  # and never read: the drain could last the whole grace
            vm.proc.send_signal(signal.SIGTERM)
            wait_for_log(vm, "orisha: stopping")
            vm.proc.send_signal(signal.SIGINT)
            assert vm.proc.wait(WAIT) == 0, "\n".join(vm.log)
    finally:
        vm.stop(signal.SIGKILL)


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of the processes whose parent is ``pid``, from /proc."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if int(fields[1]) == pid:
            out.append((int(name), fields[19]))
    return out


def running(pid: int, start: str) -> bool:
    """Whether process ``pid`` started at ``start`` still runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # gone
        return False
    return fields[19] == start and fields[0] != "Z"


def test_kill_9_of_orisha_boot_leaves_no_qemu(image):
    vm = Booted(image, [])
    try:
        qemu = [(pid, start) for pid, start in children(vm.proc.pid)
                if "qemu" in open(f"/proc/{pid}/comm").read()]
        assert len(qemu) == 1, children(vm.proc.pid)
        vm.proc.kill()
        vm.proc.wait(WAIT)
        end = time.monotonic() + WAIT
        while running(*qemu[0]):
            assert time.monotonic() < end, f"QEMU {qemu[0][0]} outlived orisha boot"
            time.sleep(0.05)
    finally:
        vm.stop(signal.SIGKILL)


@pytest.mark.skipif(shutil.which("ss") is None, reason="apt-get install iproute2")
def test_the_port_forward_accepts_bursts(image):
    """libslirp listens with a backlog of 1: 20 connections at once overflowed it and the
    kernel dropped handshakes (clients waited seconds for SYN-ACK retransmissions)."""
    vm = Booted(image, [])
    try:
        rows = subprocess.run(["ss", "-Hltn", f"sport = :{vm.port}"], capture_output=True, text=True,
                              check=True).stdout.split()
        assert int(rows[2]) >= 128, rows  # a listener's Send-Q column is its backlog
        conns = [socket.create_connection(("127.0.0.1", vm.port), timeout=WAIT) for _ in range(20)]
        for c in conns:
            c.sendall(b"GET /css/site.css HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        for c in conns:
            with c:
                assert c.recv(12) == b"HTTP/1.1 200"
        assert not any("backlog of 1" in line for line in vm.log)
    finally:
        vm.stop()


def test_run_sh_runs_the_command_orisha_boot_runs(image):
    img = os.path.join(image, "orisha.img")
    printed = subprocess.run([sys.executable, "-m", "orisha.targets.unikernel.boot", "--print-command",
                              img, "8080", "--append", "orisha.exit=ready"],
                             capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert shlex.split(printed) == qemu_command(img, "127.0.0.1", 8080, resolve_accel("auto"),
                                                guest_megabytes(img), "orisha.exit=ready")
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    free = port.getsockname()[1]
    port.close()
    r = subprocess.run([os.path.join(ROOT, "unikernel", "run.sh"), img, str(free)],
                       env=dict(os.environ, APPEND="orisha.exit=ready", PYTHON=sys.executable),
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=WAIT)
    assert r.returncode == 1, r.stderr  # the guest's exit(0) through isa-debug-exit
    assert "orisha: serving http on port 80" in r.stdout
