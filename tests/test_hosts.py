"""``--host``: by default both loopback families, several addresses on one port number.

Servers run ``orisha serve`` as a user types it (no ``--host``, or several), over real
loopback sockets of both families: HTTPS/1.1 over TCP, HTTP/3 over UDP with aioquic's
client, and headless Chromium on a named host (``localhost``, which it resolves to ::1
first, and a name mapped to ``localhost`` with ``--host-resolver-rules``), told that the
origin speaks QUIC, with DevTools reporting every response on h3.
"""

from __future__ import annotations

import re
import socket
import ssl
import subprocess

import pytest

from conftest import RUN_DIR, TEST_LIMITS, demo_file, orisha, orisha_cmd
from httpraw import Conn
from test_h3 import h3_get
from tlsutil import client_context, pki  # noqa: F401  (pki: a fixture)

URL = re.compile(r"(https?)://(\[[0-9a-f:]+\]|[\d.]+):(\d+)/")


class Served:
    """`orisha serve BUILD ARGS` exactly as given (no --host added, unlike conftest's)."""

    def __init__(self, build: str, *args: str) -> None:
        self.proc = subprocess.Popen([*orisha_cmd(args), "serve", build, "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd=RUN_DIR)
        self.line = self.proc.stdout.readline()
        self.urls = URL.findall(self.line.split(" (loop ")[0])
        if not self.urls:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {self.line!r} {self.proc.stderr.read()}")
        self.port = int(self.urls[0][2])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def workers(self) -> list[str]:
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            return f.read().split()


def https_get(host: str, port: int, pki, path: str = "/") -> tuple[int, bytes]:
    """One HTTPS/1.1 GET to ``host`` (either family): (status, body)."""
    c = Conn.__new__(Conn)
    raw = socket.create_connection((host, port), timeout=10)
    c.sock, c.buf = client_context(pki, ("http/1.1",)).wrap_socket(raw, server_hostname="localhost"), b""
    try:
        r = c.request(path, headers={"Host": "localhost"})
        return r.status, r.body
    finally:
        c.close()


def _tls(pki) -> list[str]:
    return ["--tls-cert", pki.chain, "--tls-key", pki.key]


@pytest.mark.parametrize("loop", ["epoll", "io-uring"])
def test_the_default_host_serves_both_loopback_families_on_tcp_and_udp(builds, pki, loop):
    """No --host: TLS, the plain port and HTTP/3 on 127.0.0.1 and ::1 alike, one port number,
    the start-up line naming what TCP and UDP listen on; a worker per address."""
    s = Served(builds["notfound"], "--loop", loop, "--workers", "1", "--http-port", "0",
               *TEST_LIMITS, *_tls(pki))
    try:
        p = s.port
        assert s.urls == [("https", "127.0.0.1", str(p)), ("https", "[::1]", str(p))], s.line
        assert f"HTTP/3 on udp 127.0.0.1:{p} and [::1]:{p}" in s.line
        assert f"(loop {loop}, 1 worker per address, " in s.line
        plain = re.search(r"\(and http://127\.0\.0\.1:(\d+)/ and http://\[::1\]:(\d+)/: redirects", s.line)
        assert plain and plain.group(1) == plain.group(2), s.line
        index = demo_file("index.html")
        for host in ("127.0.0.1", "::1"):
            assert https_get(host, p, pki) == (200, index), host
            r = Conn(int(plain.group(1)), host=host).request("/docs/", headers={"Host": "localhost"})
            assert r.status == 308 and r.headers["location"] == f"https://localhost:{p}/docs/"
            got = h3_get(p, pki.ca, [("/", "GET", ())], host=host)
            assert (got[0][0], got[0][2]) == (200, index), host
        assert len(s.workers()) == 4  # (TLS + plain port) × (127.0.0.1, ::1)
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("hosts", [["--host", "::1", "--host", "127.0.0.1"],
                                   ["--host", "::1,127.0.0.1"],
                                   ["--host", "[::1], 127.0.0.1"]],
                         ids=["repeated", "commas", "brackets"])
def test_several_hosts_repeated_or_with_commas(builds, hosts):
    """--workers counts them all, spread over the addresses: 4 on two is 2 per address."""
    s = Served(builds["notfound"], "--workers", "4", *hosts)
    try:
        assert [u[1] for u in s.urls] == ["[::1]", "127.0.0.1"], s.line
        assert {u[2] for u in s.urls} == {str(s.port)} and "2 workers per address" in s.line
        for host in ("127.0.0.1", "::1"):
            assert Conn(s.port, host=host).request("/").body == demo_file("index.html")
        assert len(s.workers()) == 4
    finally:
        assert s.stop() == 0


def test_the_default_hosts_share_the_workers_asked_for(builds):
    """Both loopback families by default, and --workers 2 is two processes, not two each:
    one core's worth per process, as with one address."""
    s = Served(builds["notfound"], "--workers", "2")
    try:
        assert "1 worker per address" in s.line, s.line
        assert len(s.workers()) == 2
    finally:
        assert s.stop() == 0


def test_both_wildcards_bind_side_by_side_tcp_and_udp(builds, pki):
    """``--host 0.0.0.0 --host ::`` (nginx's `listen 443; listen [::]:443`): beside the IPv4
    wildcard the IPv6 one takes IPv6 only, so both bind, over TCP and UDP."""
    s = Served(builds["notfound"], "--workers", "1", "--host", "0.0.0.0", "--host", "::",
               *_tls(pki))
    try:
        assert [u[1] for u in s.urls] == ["0.0.0.0", "[::]"], s.line
        assert f"HTTP/3 on udp 0.0.0.0:{s.port} and [::]:{s.port}" in s.line
        for host in ("127.0.0.1", "::1"):
            assert https_get(host, s.port, pki)[0] == 200
            assert h3_get(s.port, pki.ca, [("/", "GET", ())], host=host)[0][0] == 200
    finally:
        assert s.stop() == 0


def test_one_ipv6_wildcard_stays_dual_stack(builds, pki):
    """``--host ::`` alone, as before: one socket per worker takes both families."""
    s = Served(builds["notfound"], "--workers", "1", "--host", "::", *_tls(pki))
    try:
        assert [u[1] for u in s.urls] == ["[::]"] and "1 worker, " in s.line, s.line
        for host in ("127.0.0.1", "::1"):
            assert https_get(host, s.port, pki)[0] == 200
            assert h3_get(s.port, pki.ca, [("/", "GET", ())], host=host)[0][0] == 200
        assert len(s.workers()) == 1
    finally:
        assert s.stop() == 0


def test_a_taken_second_address_is_a_one_line_error(builds):
    """A port free on 127.0.0.1 but held on ::1: the error names ::1, nothing stays bound."""
    held = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        held.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        held.bind(("::1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = orisha("serve", builds["notfound"], "--port", str(port), "--workers", "1", timeout=30)
        assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith(
            f"orisha: error: ::1:{port}: port {port} is already in use"), r.stderr
        free = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        free.bind(("127.0.0.1", port))  # the IPv4 listeners were closed
        free.close()
    finally:
        held.close()


@pytest.mark.parametrize("host,message", [
    ("", r"--host: an empty address in '127\.0\.0\.1', ''$"),
    ("::1,,", r"--host: an empty address in '127\.0\.0\.1', '::1,,'$"),
    ("192.0.2.1", r"192\.0\.2\.1:\d+: Cannot assign requested address$"),  # TEST-NET-1
    ("no-such-host.invalid", r"no-such-host\.invalid: cannot resolve")])
def test_bad_hosts_are_one_line_errors(builds, host, message):
    r = orisha("serve", builds["notfound"], "--port", "0", "--host", "127.0.0.1", "--host", host,
               timeout=30)
    assert r.returncode == 1 and re.match("orisha: error: " + message, r.stderr.strip()), r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("hosts", [[], ["--host", "::"]], ids=["default", "ipv6-wildcard"])
def test_chromium_loads_pages_over_h3_from_a_named_host(builds, pki, tmp_path, hosts):
    """Headless Chromium on ``localhost`` (::1 first) and on ``www.orisha.test`` (mapped to
    localhost, a name with both families' addresses): every page and asset of the origin
    loads, and DevTools reports each response on h3."""
    from browser import chromium, load_pages
    from tlsutil import trusting_chromium
    assert chromium() is not None, "no Chromium (apt-get install chromium; ./dev test does)"
    s = Served(builds["notfound"], "--workers", "1", *hosts, *TEST_LIMITS, *_tls(pki))
    try:
        names = ("localhost", "www.orisha.test")
        wrapper = trusting_chromium(pki.cert, tmp_path)  # its SPKI: the names need not match
        with open(wrapper) as f:
            script = f.read()
        quic = ",".join(f"{n}:{s.port}" for n in names)
        with open(wrapper, "w") as f:
            f.write(script.replace('"$@"', f"--origin-to-force-quic-on={quic} "
                                           f"'--host-resolver-rules=MAP www.orisha.test localhost' "
                                           '"$@"'))
        for name in names:
            origin = f"https://{name}:{s.port}"
            pages = ["/", "/docs/", "/docs/guide/getting-started"]
            seen = {}
            for r in load_pages([origin + p for p in pages], timeout=30, executable=wrapper):
                assert r.ok, (name, r.problems)
                seen.update({u: p for u, p in r.protocols.items() if u.startswith(origin)})
            assert len(seen) > len(pages), seen  # the pages and their assets
            assert set(seen.values()) == {"h3"}, seen
    finally:
        assert s.stop() == 0
