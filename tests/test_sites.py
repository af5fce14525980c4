"""Several sites in one server, and one server per port (issue 21).

Every test runs real servers over loopback: ``orisha serve`` on each hosted loop
and the container image. A port belongs to one server: a second server on a held
port exits with a one-line error naming the port and its holder, and the first
answers every request meanwhile. Several servers started at once all come up
(io_uring: the liburing import cache race).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest

from conftest import LOOPS, ROOT, Server, TEST_LIMITS
from httpraw import read_to_close


def _get(port: int, path: str = "/", host: str = "t") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        return read_to_close(s)


# -- a port belongs to one server ----------------------------------------------------------

@pytest.mark.parametrize("loop", LOOPS)
def test_second_server_on_a_held_port_exits(builds, loop):
    first = Server(builds["notfound"], "--loop", loop, "--workers", "2", *TEST_LIMITS)
    try:
        cmd = Server.cmd(builds["spa"], "--loop", loop, "--workers", "2")
        cmd[cmd.index("--port") + 1] = str(first.port)
        second = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, cwd=ROOT)
        try:
            # the first server answers every request while the second tries to start
            answers = []
            while second.poll() is None and len(answers) < 200:
                answers.append(_get(first.port, "/nowhere"))
            out, err = second.communicate(timeout=60)
        finally:
            if second.poll() is None:
                second.kill()
                second.wait()
        assert second.returncode == 1, (out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and f"port {first.port} is already in use by pid " \
            f"{first.proc.pid}" in lines[0], err
        assert "serving" not in out
        answers += [_get(first.port, "/nowhere") for _ in range(12)]
        # the notfound build answers its own 404 page; the SPA build would answer 200
        assert all(a.startswith(b"HTTP/1.1 404 ") for a in answers), answers[:3]
    finally:
        assert first.stop() == 0


def test_second_container_server_on_a_held_port_exits():
    from conftest import DEMO, MODES
    from container_target import docker, start
    c = start(DEMO, MODES["notfound"], TEST_LIMITS)
    try:
        # the same image's executable, in the same network namespace, on the same port
        r = docker("exec", "-e", "ADMIN_PORT=0", c.container, "/orisha", "--port", "8080",
                   "--workers", "2", check=False, timeout=60)
        assert r.returncode == 1, r
        lines = r.stderr.strip().splitlines()
        # staticx's pid 1 runs the unpacked executable: the holder is that process
        assert len(lines) == 1 and re.search(r"port 8080 is already in use by pid \d+: "
                                             r"\S*orisha", lines[0]), r.stderr
        assert all(_get(c.port, "/nowhere").startswith(b"HTTP/1.1 404 ") for _ in range(12))
    finally:
        c.stop()


def test_a_reload_keeps_sharing_the_port(builds):
    """The listeners are claimed once: a reload's generation serves on them, no clash."""
    import signal
    s = Server(builds["notfound"], "--loop", "epoll", "--workers", "2", *TEST_LIMITS)
    try:
        s.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        line = ""
        while "reloaded" not in line and time.monotonic() < deadline:
            line = s.proc.stderr.readline()
        assert "reloaded" in line, line
        assert all(_get(s.port, "/nowhere").startswith(b"HTTP/1.1 404 ") for _ in range(12))
    finally:
        assert s.stop() == 0


# -- start-up does not race another server -------------------------------------------------

ROUNDS, AT_ONCE = 4, 4


def test_servers_started_at_once_all_come_up(builds):
    """io_uring: ``import liburing`` rewrites a cache file on every import (dynamic_import);
    several servers importing it at the same instant must all come up."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    for _ in range(ROUNDS):
        procs = [subprocess.Popen(Server.cmd(builds["notfound"], "--loop", "io-uring",
                                             "--workers", "1"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd=ROOT, env=env) for _ in range(AT_ONCE)]
        servers = []
        try:
            for p in procs:
                servers.append(Server("", proc=p))  # raises with the server's stderr
            for s in servers:
                assert _get(s.port).startswith(b"HTTP/1.1 200 ")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
