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
import ssl
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


# -- several sites -------------------------------------------------------------------------

SITE_FILES = {
    "a": {"index.html": "<h1>site A</h1>\n", "404.html": "A 404\n", "new.html": "A new\n",
          "_redirects": "/old /new 301\n", "_headers": "/*\n  X-Site: a\n"},
    "b": {"index.html": "<h1>site B</h1>\n", "404.html": "B 404\n", "bnew.html": "B new\n",
          "_redirects": "/bold /bnew 302\n", "_headers": "/*\n  X-Site: b\n"},
}
A_NAMES, B_NAMES = "a.test", "b.test,*.b.test"


def _leaf(folder: str, name: str, sans: list[str]) -> tuple[str, str]:
    from tlsutil import _openssl
    ext = os.path.join(folder, f"{name}.ext")
    with open(ext, "w") as f:
        f.write("subjectAltName=" + ",".join(f"DNS:{n}" for n in sans) + "\n"
                "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={sans[0]}", cwd=folder)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "3", "-extfile", ext, cwd=folder)
    return os.path.join(folder, f"{name}.pem"), os.path.join(folder, f"{name}.key")


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Builds of sites a and b, and a CA with a certificate for each (b: b.test, *.b.test)."""
    from conftest import orisha
    from tlsutil import make_pki
    base = tmp_path_factory.mktemp("sites")
    out = {}
    for name, files in SITE_FILES.items():
        src = base / f"src-{name}"
        src.mkdir()
        for rel, text in files.items():
            (src / rel).write_text(text)
        out[name] = str(base / f"out-{name}")
        r = orisha("build", str(src), "-o", out[name], "--not-found", "404.html")
        assert r.returncode == 0, r.stderr
    pki = make_pki(str(base / "pki"))
    out["ca"] = pki.ca
    out["cert_a"], out["key_a"] = _leaf(pki.dir, "a", ["a.test"])
    out["cert_b"], out["key_b"] = _leaf(pki.dir, "b", ["b.test", "*.b.test"])
    return out


def _site_args(two) -> list[str]:
    return ["--site", f"{A_NAMES}={two['a']}", "--site", f"{B_NAMES}={two['b']}"]


def _tls_args(two) -> list[str]:
    return ["--tls-cert", two["cert_a"], "--tls-key", two["key_a"],
            "--tls-cert", two["cert_b"], "--tls-key", two["key_b"]]


def _start(loop: str, *args: str, env: dict | None = None) -> Server:
    """A server of both sites (no positional build: Server.cmd's "" is dropped)."""
    cmd = [c for c in Server.cmd("", "--loop", loop, "--workers", "2", *TEST_LIMITS, *args) if c]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env)
    line = proc.stdout.readline()
    m = re.search(r"https?://[\d.]+:(\d+)/", line)
    if not m:
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r} {proc.stderr.read()}")
    s = Server.__new__(Server)
    s.proc, s.line, s.port = proc, line, int(m.group(1))
    return s


def _status_body(raw: bytes) -> tuple[int, dict, bytes]:
    from httpraw import split_responses
    (status, fields, body), = split_responses(raw)
    return status, fields, body


SITE_LOOPS = LOOPS + ["epoll-pure"]  # the compiled core and the .py core


@pytest.fixture(scope="module", params=SITE_LOOPS)
def plain(request, two):
    s = _start(request.param, *_site_args(two))
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module", params=SITE_LOOPS)
def tls(request, two):
    s = _start(request.param, *_site_args(two), *_tls_args(two))
    yield s
    assert s.stop() == 0


# Host → (site, as the Host field may be written)
HOSTS = [("a.test", "a"), ("b.test", "b"), ("www.b.test", "b"), ("B.Test.:8080", "b"),
         ("a.test:80", "a"), ("unknown.example", "a"), ("b.test.evil", "a")]


def test_host_chooses_the_site(plain):
    for host, site in HOSTS:
        status, fields, body = _status_body(_get(plain.port, "/", host))
        assert (status, fields.get("x-site"), body) == (200, site, SITE_FILES[site]["index.html"]
                                                        .encode()), host


def test_each_site_keeps_its_rules_and_404(plain):
    status, fields, _ = _status_body(_get(plain.port, "/old", "a.test"))
    assert (status, fields.get("location")) == (301, "/new")
    status, fields, body = _status_body(_get(plain.port, "/old", "b.test"))
    assert (status, body) == (404, b"B 404\n")  # a's rule is not b's
    status, fields, _ = _status_body(_get(plain.port, "/bold", "x.b.test"))
    assert (status, fields.get("location")) == (302, "/bnew")
    status, _, body = _status_body(_get(plain.port, "/bold", "a.test"))
    assert (status, body) == (404, b"A 404\n")
    status, _, body = _status_body(_get(plain.port, "/new", "b.test"))
    assert (status, body) == (404, b"B 404\n")


def test_absolute_target_chooses_the_site(plain):
    """RFC 9112 §3.2.2: an absolute-form target's authority, not Host, names the site."""
    status, fields, _ = _status_body(_get(plain.port, "http://b.test/", "a.test"))
    assert (status, fields.get("x-site")) == (200, "b")


def test_h2c_authority_chooses_the_site(plain):
    from h2util import H2Client
    with socket.create_connection(("127.0.0.1", plain.port), timeout=10) as sock:
        c = H2Client(sock)
        for host, site in HOSTS:
            (r,) = c.fetch([("GET", "/", {})], authority=host, scheme="http")
            assert (r.status, r.h("x-site"), r.body) == (
                200, site, SITE_FILES[site]["index.html"].encode()), host
        (r,) = c.fetch([("GET", "/zz", {})], authority="b.test", scheme="http")
        assert (r.status, r.body) == (404, b"B 404\n")


def _tls_client(two, server_name: str | None, alpn: list[str]) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=two["ca"])
    ctx.check_hostname = False  # the SAN is checked by hand: which certificate SNI chose
    ctx.set_alpn_protocols(alpn)
    return ctx


def _tls(two, port: int, server_name: str | None, alpn=("http/1.1",)):
    ctx = _tls_client(two, server_name, list(alpn))
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    return ctx.wrap_socket(raw, server_hostname=server_name)


def _sans(sock) -> set[str]:
    return {v for k, v in sock.getpeercert()["subjectAltName"] if k == "DNS"}


@pytest.mark.parametrize("sni, sans", [("a.test", {"a.test"}), ("b.test", {"b.test", "*.b.test"}),
                                       ("www.b.test", {"b.test", "*.b.test"}),
                                       ("A.TEST", {"a.test"}), ("unknown.example", {"a.test"}),
                                       (None, {"a.test"})])
def test_sni_chooses_the_certificate(two, tls, sni, sans):
    with _tls(two, tls.port, sni) as s:
        assert _sans(s) == sans


def _tls_get(two, port: int, sni: str | None, host: str, path: str = "/"):
    with _tls(two, port, sni) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        return _status_body(read_to_close(s, resets=(ssl.SSLError,)))


def test_tls_host_of_another_site_is_misdirected(two, tls):
    status, fields, body = _tls_get(two, tls.port, "b.test", "www.b.test")
    assert (status, fields.get("x-site"), body) == (200, "b", b"<h1>site B</h1>\n")
    status, _, body = _tls_get(two, tls.port, "b.test", "a.test")
    assert status == 421 and b"site A" not in body
    status, _, body = _tls_get(two, tls.port, "a.test", "b.test:443")
    assert status == 421 and b"site B" not in body
    # a name no site holds answers from the SNI's site; without SNI, Host chooses
    status, fields, _ = _tls_get(two, tls.port, "b.test", "unknown.example")
    assert (status, fields.get("x-site")) == (200, "b")
    status, fields, _ = _tls_get(two, tls.port, None, "b.test")
    assert (status, fields.get("x-site")) == (200, "b")
    status, _, body = _tls_get(two, tls.port, "a.test", "a.test", "/bold")
    assert (status, body) == (404, b"A 404\n")


def test_h2_over_tls_does_not_coalesce_sites(two, tls):
    """RFC 9113 §9.1.1: a connection made for b (its certificate, its SNI) never answers a's
    content, whatever :authority the client reuses it for."""
    from h2util import H2Client
    with _tls(two, tls.port, "b.test", alpn=("h2",)) as s:
        assert s.selected_alpn_protocol() == "h2" and "b.test" in _sans(s)
        c = H2Client(s)
        rs = c.fetch([("GET", "/", {})], authority="x.b.test")
        assert (rs[0].status, rs[0].h("x-site")) == (200, "b")
        (r,) = c.fetch([("GET", "/", {})], authority="a.test")
        assert r.status == 421 and b"site A" not in r.body
        (r,) = c.fetch([("GET", "/bold", {})], authority="b.test")
        assert (r.status, r.h("location")) == (302, "/bnew")
    with _tls(two, tls.port, "a.test", alpn=("h2",)) as s:
        c = H2Client(s)
        (r,) = c.fetch([("GET", "/", {})], authority="a.test")
        assert (r.status, r.h("x-site")) == (200, "a")
        (r,) = c.fetch([("GET", "/", {})], authority="b.test")
        assert r.status == 421


def test_one_reload_reloads_every_site(two, tmp_path):
    """SIGHUP: a site whose build no longer loads keeps serving its previous build, with a
    line naming it; the other moves on to its new build."""
    import shutil
    import signal
    from conftest import orisha
    a, b = tmp_path / "a", tmp_path / "b"
    os.symlink(two["a"], a)
    shutil.copytree(two["b"], b)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        admin = probe.getsockname()[1]
    s = _start("epoll", "--site", f"{A_NAMES}={a}", "--site", f"{B_NAMES}={b}",
               "--admin-port", str(admin))
    try:
        before = _site_info(admin)
        assert before == {"a.test": ("a.test", "3 files, 28 bytes"),
                          "b.test": ("b.test,*.b.test", "3 files, 28 bytes")}, before
        src = tmp_path / "src-a2"
        src.mkdir()
        (src / "index.html").write_text("<h1>site A, again</h1>\n")
        r = orisha("build", str(src), "-o", str(tmp_path / "out-a2"))
        assert r.returncode == 0, r.stderr
        os.unlink(a)
        os.symlink(tmp_path / "out-a2", a)
        os.unlink(b / "site.blob")  # its documents are gone: the build cannot load
        s.proc.send_signal(signal.SIGHUP)
        lines, deadline = [], time.monotonic() + 30
        while not any("reloaded" in x for x in lines) and time.monotonic() < deadline:
            lines.append(s.proc.stderr.readline())
        failed = [x for x in lines if "failed" in x]
        assert len(failed) == 1 and "site b.test failed, it keeps its previous build" in failed[0] \
            and "cannot load the build" in failed[0], lines
        assert any("reloaded" in x for x in lines), lines
        assert _status_body(_get(s.port, "/", "a.test"))[2] == b"<h1>site A, again</h1>\n"
        assert _status_body(_get(s.port, "/", "b.test"))[2] == b"<h1>site B</h1>\n"
        # the metrics say which build each site serves now
        assert _site_info(admin) == {**before, "a.test": ("a.test", "1 files, 23 bytes")}
    finally:
        assert s.stop() == 0


def _site_info(admin: int) -> dict[str, tuple[str, str]]:
    """orisha_site_info's labels from the admin port: site → (hosts, build)."""
    status, _, body = _status_body(_get(admin, "/metrics"))
    assert status == 200
    return {m[0]: m[1:] for m in re.findall(
        r'orisha_site_info\{site="([^"]*)",hosts="([^"]*)",build="([^"]*)"\} 1', body.decode())}


def _site_counts(admin: int) -> dict[tuple[str, str], int]:
    """The admin port's request counters by (metric, labels but the worker's), summed over
    the workers: {("requests_total", 'site="a.test"'): 3, ("errors_total",
    'status="421",site="b.test"'): 1, …}."""
    status, _, body = _status_body(_get(admin, "/metrics"))
    assert status == 200
    out: dict[tuple[str, str], int] = {}
    for name, labels, value in re.findall(r'^orisha_(requests_total|response_body_bytes_total|'
                                          r'errors_total)\{worker="\d+",?([^}]*)\} (\d+)$',
                                          body.decode(), re.M):
        out[name, labels] = out.get((name, labels), 0) + int(value)
    return out


def test_metrics_name_the_site(two):
    """Each request is counted on the site that answered it: by Host (over a connection
    without SNI), by its SNI's site (HTTP/1.1 and h2); a 421 on the site the connection's
    certificate is for. No series without a site: every request had one."""
    from h2util import H2Client
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        admin = probe.getsockname()[1]
    s = _start("epoll", *_site_args(two), *_tls_args(two), "--admin-port", str(admin))
    try:
        assert _tls_get(two, s.port, "a.test", "a.test")[0] == 200
        assert _tls_get(two, s.port, "a.test", "a.test", "/nowhere")[0] == 404
        assert _tls_get(two, s.port, None, "unknown.example")[0] == 200  # the first site
        assert _tls_get(two, s.port, None, "www.b.test", "/bold")[0] == 302
        assert _tls_get(two, s.port, "b.test", "a.test")[0] == 421
        with _tls(two, s.port, "www.b.test", alpn=("h2",)) as t:
            (r,) = H2Client(t).fetch([("GET", "/", {})], authority="b.test")
            assert r.status == 200
        a, b = SITE_FILES["a"], SITE_FILES["b"]
        want = {("requests_total", 'site="a.test"'): 3, ("requests_total", 'site="b.test"'): 3,
                ("response_body_bytes_total", 'site="a.test"'):
                    2 * len(a["index.html"]) + len(a["404.html"]),
                ("response_body_bytes_total", 'site="b.test"'):
                    len(b["index.html"]) + len("421 Misdirected Request\n"),
                ("errors_total", 'status="404",site="a.test"'): 1,
                ("errors_total", 'status="421",site="b.test"'): 1}
        deadline, got = time.monotonic() + 20, {}
        while time.monotonic() < deadline:  # the workers publish about once a second
            got = {k: n for k, n in _site_counts(admin).items() if n}
            if got == want:
                break
            time.sleep(0.2)
        assert got == want
        assert _site_counts(admin)["errors_total", 'status="400",site="b.test"'] == 0  # zeros too
    finally:
        assert s.stop() == 0


def test_h2_sends_each_sites_built_blocks_and_its_103(two, builds):
    """h2c, one connection for both sites: the second site's page with preloads (the demo's
    /docs/) gets its 103 Early Hints, and each site's 200 HEADERS block is its build's own
    (``Variant.h2``'s fields, the ones its heads share indexed in the connection's table —
    hpack_blocks.vocabulary — then the date field), not one encoded at run time."""
    from hpack import Decoder, Encoder
    from h2util import DATA, HEADERS, PREFACE, frame, read_frames, settings
    from orisha.serving.server import load_site
    s = _start("epoll", "--site", f"{A_NAMES}={two['a']}", "--site",
               f"{B_NAMES}={builds['notfound']}")
    try:
        enc, asks = Encoder(), [(1, "www.b.test", "/docs/"), (3, "a.test", "/")]
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
            sock.sendall(PREFACE + settings() + b"".join(
                frame(HEADERS, 0x5, sid, enc.encode([(":method", "GET"), (":path", path),
                                                     (":scheme", "http"), (":authority", host)]))
                for sid, host, path in asks))
            data, ended = b"", set()
            while ended != {1, 3}:
                chunk = sock.recv(1 << 16)
                assert chunk, data
                data += chunk
                ended = {sid for t, flags, sid, _ in read_frames(data)
                         if t in (HEADERS, DATA) and flags & 0x1}
    finally:
        assert s.stop() == 0
    heads = {sid: [p for t, _, i, p in read_frames(data) if t == HEADERS and i == sid]
             for sid in (1, 3)}
    assert [len(h) for h in heads.values()] == [2, 1]  # the 103 and the 200; the 200 alone
    hints = dict(Decoder().decode(heads[1][0]))
    assert hints == {":status": "103", "link": "</css/site.css>; rel=preload; as=style"}, hints
    from orisha.protocols.hpack_blocks import _indexing, representations
    table = Decoder()  # the client's dynamic table, across the connection's blocks in order
    decoded = {i: table.decode(p) for t, _, i, p in read_frames(data) if t == HEADERS}
    for (sid, blocks), out in zip(heads.items(), (builds["notfound"], two["a"])):
        route = load_site(out).routes[b"/docs/" if sid == 1 else b"/"]
        built = next(v.h2 for v in route.variants if v.coding == b"identity")
        assert decoded[sid][:-1] == Decoder().decode(built), sid  # the build's fields, Date
        assert [k for k, _ in decoded[sid][-1:]] == ["date"], sid
        if sid == 1:  # the connection's first: the build's bytes, a shared field's indexed
            assert all(r in blocks[-1] or not r[0] & 0x80 and _indexing(r) in blocks[-1]
                       for r in representations(built))


def test_access_log_names_the_site(two, tmp_path):
    from h2util import H2Client
    log = tmp_path / "access.log"
    s = _start("epoll", *_site_args(two), "--access-log", str(log))
    try:
        _get(s.port, "/", "www.b.test:8080")
        _get(s.port, "/nowhere", "a.test")
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
            (r,) = H2Client(sock).fetch([("GET", "/bold", {})], authority="b.test", scheme="http")
            assert r.status == 302
    finally:
        assert s.stop() == 0
    lines = log.read_text().splitlines()
    assert sorted(x.split('"')[0].split()[0] + " " + x.split('"')[1] for x in lines) == [
        "a.test GET /nowhere HTTP/1.1", "b.test GET / HTTP/1.1", "b.test GET /bold HTTP/2.0"], lines


def test_container_serves_several_sites(two):
    """The image's own build (the demo site, the image the conformance suite runs) for
    a.test, a mounted build folder for b.test and *.b.test."""
    from conftest import DEMO, MODES, demo_file
    from container_target import Container, build
    from h2util import H2Client
    _, tag = build(DEMO, MODES["notfound"])
    c = Container(tag, ["--site", A_NAMES, "--site", f"{B_NAMES}=/sites/b", "--workers", "2",
                        *TEST_LIMITS], run_args=["-v", f"{two['b']}:/sites/b:ro"])
    try:
        assert "2 sites: a.test" in c.line, c.line
        for host, site in HOSTS:
            status, fields, body = _status_body(_get(c.port, "/", host))
            want = demo_file("index.html") if site == "a" else b"<h1>site B</h1>\n"
            assert (status, body) == (200, want), host
        assert _status_body(_get(c.port, "/zz", "b.test"))[2] == b"B 404\n"
        assert _status_body(_get(c.port, "/zz", "a.test"))[2] == demo_file("404.html")
        assert _status_body(_get(c.port, "/bold", "www.b.test"))[0] == 302
        assert _status_body(_get(c.port, "/bold", "a.test"))[0] == 404
        with socket.create_connection(("127.0.0.1", c.port), timeout=10) as sock:
            (r,) = H2Client(sock).fetch([("GET", "/", {})], authority="b.test", scheme="http")
            assert (r.status, r.h("x-site"), r.body) == (200, "b", b"<h1>site B</h1>\n")
    finally:
        c.stop()


def test_one_certificate_for_one_site_of_two_is_misdirected_elsewhere(two):
    """One certificate (a.test's) with two sites: a client that sent SNI b.test does not
    get b's content over a's certificate either."""
    s = _start("epoll", *_site_args(two), "--tls-cert", two["cert_a"], "--tls-key", two["key_a"])
    try:
        assert _tls_get(two, s.port, "a.test", "b.test")[0] == 421
        assert _tls_get(two, s.port, "b.test", "a.test")[0] == 421
        assert _tls_get(two, s.port, "b.test", "b.test")[1].get("x-site") == "b"
    finally:
        assert s.stop() == 0


# -- several sites with certificates from ACME (Pebble: tests/test_acme.py) ------------------

from tlsutil import pki  # noqa: E402,F401  (the fixture test_acme's Pebble is made with)
from test_acme import pebble  # noqa: E402,F401

ACME_SITES = {"a": ["a.test"], "b": ["b.test", "www.b.test"]}


def acme_sites(two, ca, state, loop: str, http: bool, *extra: str, env: dict | None = None):
    """Both sites, their certificates from Pebble; HTTP-01 with ``http``, else TLS-ALPN-01."""
    from test_acme import EMAIL, Served
    args = [a for k, names in ACME_SITES.items() for a in ("--site", f"{','.join(names)}={two[k]}")]
    args += ["--port", str(ca.tls_port), "--acme-email", EMAIL, "--acme-directory", ca.directory,
             "--acme-ca", ca.pki.ca, "--state", str(state), *extra]
    if http:
        args += ["--http-port", str(ca.http_port)]
    return Served("", *args, loop=loop, env=env)


def sites_issued(s, ca, root: str) -> str:
    """Each site's certificate issued and served by every worker; Pebble's root as a file."""
    for names in ACME_SITES.values():
        s.wait_for(f"ACME: certificate for {', '.join(names)} issued")
    deadline = time.monotonic() + 30
    while sum("every worker serves the new certificate" in x for x in s.err) < 2:
        assert time.monotonic() < deadline and s.proc.poll() is None, "".join(s.err)
        time.sleep(0.05)
    return ca.root(root)


# epoll without the plain port: TLS-ALPN-01, whose challenge context (chosen from the raw
# ClientHello) must survive the SNI callback; asyncio with it: HTTP-01.
@pytest.mark.parametrize("loop, http", [("epoll", False), ("asyncio", True)])
def test_acme_gets_each_site_its_certificate(two, pebble, tmp_path, loop, http):
    ca = pebble()
    state = tmp_path / "state"
    s = acme_sites(two, ca, state, loop, http)
    try:
        root = sites_issued(s, ca, str(tmp_path / "root.pem"))
        ctx = ssl.create_default_context(cafile=root)
        ctx.set_alpn_protocols(["http/1.1"])
        for site, names in ACME_SITES.items():
            for name in names:  # SNI chooses the site's own certificate, verified by name
                with socket.create_connection(("127.0.0.1", s.port), timeout=10) as raw, \
                        ctx.wrap_socket(raw, server_hostname=name) as c:
                    assert _sans(c) == set(names), name
                    c.sendall(f"GET / HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n"
                              .encode())
                    status, fields, body = _status_body(read_to_close(c, resets=(ssl.SSLError,)))
                assert (status, fields.get("x-site"), body) == (
                    200, site, SITE_FILES[site]["index.html"].encode()), name
        # curl, trusting Pebble's root: each site's content under its own certificate
        from test_acme import curl
        for name, site in (("a.test", "a"), ("www.b.test", "b")):
            r = curl("--cacert", root, "--resolve", f"{name}:{s.port}:127.0.0.1",
                     f"https://{name}:{s.port}/")
            assert (r.returncode, r.stdout) == (0, SITE_FILES[site]["index.html"].encode()), r.stderr
        # another site's Host over a site's ACME certificate: 421, never its content
        for sni, host in (("a.test", "b.test"), ("www.b.test", "a.test")):
            with socket.create_connection(("127.0.0.1", s.port), timeout=10) as raw, \
                    ctx.wrap_socket(raw, server_hostname=sni) as c:
                c.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
                status, _, body = _status_body(read_to_close(c, resets=(ssl.SSLError,)))
            assert status == 421 and b"site" not in body, (sni, host)
        # one account, one certificate folder per site
        assert sorted(os.listdir(state / "sites")) == ["a.test", "b.test"]
        assert len([f for f in os.listdir(state) if f.startswith("account-")]) == 1
        assert s.http_port == (ca.http_port if http else None)
    finally:
        assert s.stop() == 0


def test_acme_for_sites_refuses_a_wildcard_and_a_second_list_of_names(two):
    from conftest import orisha
    base = ["serve", "--port", "0", "--acme-email", "me@example.org", "--site", f"a.test={two['a']}"]
    for extra, want in (
            (["--site", f"b.test,*.b.test={two['b']}"],
             "orisha: error: --site b.test,*.b.test: *.b.test cannot get an ACME certificate "
             "(a wildcard needs DNS-01, RFC 8555 §8.4; HTTP-01 and TLS-ALPN-01 validate one "
             "name each): list the site's host names"),
            (["--site", f"b.test={two['b']}", "--domain", "a.test"],
             "orisha: error: --domain with --site: the sites' host names are the domains (drop "
             "--domain; --acme-email gets each site its certificate)"),
            (["--domain", "a.test"],  # one site: the same rule
             "orisha: error: --domain with --site: the sites' host names are the domains (drop "
             "--domain; --acme-email gets each site its certificate)")):
        r = orisha(*base, *extra, timeout=30)
        assert r.returncode == 1 and r.stderr.strip().splitlines() == [want], r.stderr
    r = orisha("serve", "--port", "0", "--acme-email", "me@example.org", "--site",
               f"*.a.test={two['a']}", timeout=30)  # one site: its names are the domains
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "orisha: error: --site *.a.test: *.a.test cannot get an ACME certificate (a wildcard "
        "needs DNS-01, RFC 8555 §8.4; HTTP-01 and TLS-ALPN-01 validate one name each): list "
        "the site's host names"], r.stderr


def test_acme_for_one_site_names_its_hosts(two, pebble, tmp_path):
    """One ``--site`` with ``--acme-email``: its names are the one certificate's domains."""
    from test_acme import EMAIL, Served, curl
    ca = pebble()
    s = Served("", "--site", f"a.test,www.a.test={two['a']}", "--port", str(ca.tls_port),
               "--http-port", str(ca.http_port), "--acme-email", EMAIL, "--acme-directory",
               ca.directory, "--acme-ca", ca.pki.ca, "--state", str(tmp_path / "state"))
    try:
        s.wait_for("ACME: certificate for a.test, www.a.test issued")
        s.wait_for("ACME: every worker serves the new certificate")
        root = ca.root(str(tmp_path / "root.pem"))
        r = curl("--cacert", root, "--resolve", f"www.a.test:{s.port}:127.0.0.1",
                 f"https://www.a.test:{s.port}/")
        assert (r.returncode, r.stdout) == (0, SITE_FILES["a"]["index.html"].encode()), r.stderr
        assert os.path.isfile(tmp_path / "state" / "cert.json")  # as --domain keeps it
    finally:
        assert s.stop() == 0
