"""Facing the internet alone: HTTP→HTTPS, HSTS, watched certificate files, ACME.

Every server is ``orisha serve`` on real loopback sockets; clients are curl and
Python's ssl. The ACME tests run Pebble (Let's Encrypt's test CA, Debian's
``pebble``) started here with a config of their own: it validates on the ports
our server listens on, resolves every test name to 127.0.0.1 through
``pebble-challtestsrv`` (its ``-dnsserver``), and serves its directory with a
certificate from this module's own test CA (the Debian package ships none), which
``--acme-ca`` trusts. Pebble's ``certificateValidityPeriod`` makes short-lived
certificates for the renewal tests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.request

import pytest
from conftest import LOOPS, TEST_LIMITS, Server, demo_file
from tlsutil import client_context, make_pki, pki, tls_connect  # noqa: F401


def curl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["curl", "-sS", "--max-time", "20", *args], capture_output=True,
                          timeout=40)


class Served:
    """`orisha serve` with TLS and, maybe, the plain port; both ports from its start-up line."""

    def __init__(self, build: str, *args: str, loop: str = "epoll", env=None) -> None:
        # build "": no positional build (``--site HOST=OUT`` names them)
        self.proc = subprocess.Popen(
            [c for c in Server.cmd(build, "--loop", loop, "--workers", "2", *TEST_LIMITS, *args)
             if c],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.line = self.proc.stdout.readline()
        self.err: list[str] = []
        threading.Thread(target=self._read_err, daemon=True).start()
        m = re.search(r"https://[\d.]+:(\d+)/", self.line)
        if not m:
            self.proc.kill()
            self.proc.wait()
            time.sleep(0.2)
            raise RuntimeError(f"server did not start: {self.line!r} {''.join(self.err)}")
        self.port = int(m.group(1))
        h = re.search(r"and http://[\d.]+:(\d+)/", self.line)
        self.http_port = int(h.group(1)) if h else None
        a = re.search(r"admin http://[\d.]+:(\d+)/", self.line)
        self.admin_port = int(a.group(1)) if a else None

    def _read_err(self) -> None:
        for line in self.proc.stderr:
            self.err.append(time.strftime("%H:%M:%S ") + line)

    def wait_for(self, text: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.err:
                if text in line:
                    return line
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} in the log: {''.join(self.err)}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    from conftest import DEMO, orisha
    out = str(tmp_path_factory.mktemp("acme") / "out")
    r = orisha("build", DEMO, "-o", out, "--not-found", "404.html")
    assert r.returncode == 0, r.stderr
    return out


def _get(port: int, ctx, path: str = "/", host: str = "localhost") -> tuple[bytes, dict]:
    c = tls_connect(port, ctx)
    c.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    data = b""
    while chunk := c.recv(65536):
        data += chunk
    cert = c.getpeercert()
    c.close()
    return data, cert


# -- item 3: HTTP→HTTPS and HSTS ---------------------------------------------------------

@pytest.mark.parametrize("loop", LOOPS)
def test_the_plain_port_redirects_to_https_and_hsts_is_on_tls_answers(build, pki, loop):
    s = Served(build, "--tls-cert", pki.chain, "--tls-key", pki.key, "--http-port", "0",
               "--hsts", "31536000", loop=loop)
    try:
        plain, tls = s.http_port, s.port
        r = curl("-si", f"http://127.0.0.1:{plain}/docs/a%20b?x=1&y=%2F",
                 "-H", "Host: Example.ORG:80")
        head = r.stdout.split(b"\r\n\r\n")[0]
        assert head.startswith(b"HTTP/1.1 308 Permanent Redirect\r\n"), r.stdout
        assert f"\r\nLocation: https://example.org:{tls}/docs/a%20b?x=1&y=%2F\r\n".encode() in head
        assert b"Strict-Transport-Security" not in head  # never on cleartext (RFC 6797 §7.2)
        for method in ("HEAD", "POST"):  # every method: a 308 keeps it (RFC 9110 §15.4.9)
            r = curl("-si", "-X", method, f"http://127.0.0.1:{plain}/x", "-H", "Host: [::1]")
            assert r.stdout.startswith(b"HTTP/1.1 308 "), r.stdout
            assert f"\r\nLocation: https://[::1]:{tls}/x\r\n".encode() in r.stdout
        r = curl("-si", f"http://127.0.0.1:{plain}/", "-H", "Host: a/b")  # nowhere to send it
        assert r.stdout.startswith(b"HTTP/1.1 400 "), r.stdout
        # curl follows the redirect to the TLS port and gets the page, with HSTS.
        r = curl("-sL", "-D", "-", "--cacert", pki.ca, f"http://localhost:{plain}/css/site.css")
        assert r.returncode == 0, r.stderr
        assert r.stdout.endswith(demo_file("css/site.css")), r.stdout[:300]
        last = r.stdout.split(b"HTTP/")[-1]
        assert last.startswith(b"2 200") or last.startswith(b"1.1 200"), last[:100]
        assert b"strict-transport-security: max-age=31536000\r\n" in last.lower()
        for args in (["--http1.1"], ["--http2"]):  # HTTP/2's blocks carry it too
            r = curl("-sI", *args, "--cacert", pki.ca, f"https://localhost:{tls}/")
            assert b"strict-transport-security: max-age=31536000" in r.stdout.lower(), r.stdout
        r = curl("-sI", "--cacert", pki.ca, "-H", 'If-None-Match: "x"', f"https://localhost:{tls}/nope")
        assert b"strict-transport-security" in r.stdout.lower(), r.stdout
    finally:
        assert s.stop() == 0


def test_http_port_and_hsts_need_tls(build):
    from conftest import orisha
    for opt in (["--http-port", "0"], ["--hsts", "60"]):
        r = orisha("serve", build, "--port", "0", *opt, timeout=30)
        assert r.returncode == 1
        assert r.stderr.strip().splitlines()[-1] == (
            "orisha: error: --http-port and --hsts go with TLS (--tls-cert/--tls-key or --domain)")


def test_to_https_names_no_port_for_443():
    from orisha.core.policy import Limits
    from orisha.core.upgrade import to_https
    plan = to_https(b"GET /a?b HTTP/1.1\r\nHost: example.org:8080", Limits(), 443, {})
    assert plan.status == 308 and b"\r\nLocation: https://example.org/a?b\r\n" in plan.head
    plan = to_https(b"GET /.well-known/acme-challenge/tok-1 HTTP/1.1\r\nHost: e.org", Limits(),
                    443, {b"tok-1": b"tok-1.thumb"})
    assert plan.status == 200 and plan.body == b"tok-1.thumb"


# -- item 2: certificate files watched -------------------------------------------------

def _replace(src: str, dst: str) -> None:
    """As certbot and a Kubernetes Secret do: the new file is renamed over the old."""
    tmp = dst + ".new"
    shutil.copy(src, tmp)
    os.replace(tmp, dst)


def test_changed_certificate_files_are_served_without_sighup(build, pki, tmp_path):
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    shutil.copy(pki.chain, cert)
    shutil.copy(pki.key, key)
    s = Served(build, "--tls-cert", cert, "--tls-key", key)
    try:
        ctx = client_context(pki, ("http/1.1",))
        before = _get(s.port, ctx)[1]["serialNumber"]
        # A download in progress across the change: it finishes whole on the old generation.
        slow = tls_connect(s.port, ctx)
        slow.sendall(b"GET /files/big.txt HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        got = slow.recv(4096)
        _replace(pki.key2, key)  # the key first: for a moment the pair does not match
        _replace(pki.cert2, cert)
        deadline, after = time.monotonic() + 15, before
        while time.monotonic() < deadline and after == before:
            data, peer = _get(s.port, ctx)  # every request succeeds throughout
            assert data.startswith(b"HTTP/1.1 200 OK"), data[:100]
            after = peer["serialNumber"]
        assert after != before, "the new certificate was never served"
        while chunk := slow.recv(65536):
            got += chunk
        assert got.endswith(demo_file("files/big.txt")) and b" 200 OK" in got[:20]
        # A bad new pair: the current one keeps serving, one line says why.
        with open(cert + ".new", "w") as f:
            f.write("not a certificate\n")
        os.replace(cert + ".new", cert)
        line = s.wait_for("the certificate files changed, but the new certificate is not used")
        assert cert in line and "not a PEM certificate" in line
        assert _get(s.port, ctx)[1]["serialNumber"] == after
    finally:
        assert s.stop() == 0


# -- item 1: ACME, against Pebble -------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DOMAINS = ["example.org", "www.example.org"]
EMAIL = "admin@example.org"


class Pebble:
    """Pebble and pebble-challtestsrv (its DNS: every name is 127.0.0.1), stopped by ``stop``."""

    def __init__(self, folder: str, pki, validity: int | None = None, **extra) -> None:
        self.folder, self.pki = folder, pki
        # Where Pebble validates: the ports the test's server listens on (``acme_serve``).
        self.http_port, self.tls_port = _free_port(), _free_port()
        http_port, tls_port, ports = self.http_port, self.tls_port, None
        self.dir_port, self.mgmt_port, dns = ports or (_free_port(), _free_port(), _free_port())
        config = {"listenAddress": f"127.0.0.1:{self.dir_port}",
                  "managementListenAddress": f"127.0.0.1:{self.mgmt_port}",
                  "certificate": pki.chain, "privateKey": pki.key, "httpPort": http_port,
                  "tlsPort": tls_port, "ocspResponderURL": "",
                  "externalAccountBindingRequired": False, **extra}
        if validity:
            config["certificateValidityPeriod"] = validity
        self.config = os.path.join(folder, f"pebble-{self.dir_port}.json")
        with open(self.config, "w") as f:
            json.dump({"pebble": config}, f)
        self.dns = subprocess.Popen(
            ["pebble-challtestsrv", "-defaultIPv4", "127.0.0.1", "-defaultIPv6", "",
             "-dns01", f"127.0.0.1:{dns}", "-http01", "", "-https01", "", "-tlsalpn01", "",
             "-management", f"127.0.0.1:{_free_port()}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.dns_port = dns
        self.proc = None
        self.start()

    def start(self) -> None:
        env = {**os.environ, "PEBBLE_VA_NOSLEEP": "1", "PEBBLE_AUTHZREUSE": "0",
               "PEBBLE_WFE_NONCEREJECT": "0"}
        self.log = open(self.config + ".log", "ab")
        self.proc = subprocess.Popen(["pebble", "-config", self.config, "-dnsserver",
                                      f"127.0.0.1:{self.dns_port}"], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        ctx = ssl.create_default_context(cafile=self.pki.ca)
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(self.directory, context=ctx, timeout=2).read()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(open(self.config + ".log").read())
                time.sleep(0.1)

    @property
    def directory(self) -> str:
        return f"https://localhost:{self.dir_port}/dir"

    def root(self, path: str) -> str:
        """Pebble's root (it makes a new one per run), from its management port, as a file."""
        ctx = ssl.create_default_context(cafile=self.pki.ca)
        pem = urllib.request.urlopen(f"https://localhost:{self.mgmt_port}/roots/0", context=ctx,
                                     timeout=5).read()
        with open(path, "wb") as f:
            f.write(pem)
        return path

    def halt(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.log.close()

    def stop(self) -> None:
        self.halt()
        self.dns.terminate()
        self.dns.wait(10)


class Gate:
    """A TCP forwarder in front of Pebble's directory port that can be shut and reopened:
    the CA going away and coming back, the same CA (its root, its accounts) when it does.
    Pebble builds its URLs from the Host it is asked by, so every request passes here."""

    def __init__(self, target: int) -> None:
        self.target, self.port, self.conns = target, _free_port(), []
        self.lock = threading.Lock()
        self.listener = None
        self.open()

    def open(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def shut(self) -> None:
        self.listener.close()
        with self.lock:
            for c in self.conns:
                c.close()
            self.conns.clear()

    def _accept(self, listener) -> None:
        while True:
            try:
                a = listener.accept()[0]
                b = socket.create_connection(("127.0.0.1", self.target))
            except OSError:  # shut
                return
            with self.lock:
                self.conns += [a, b]
            for x, y in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(x, y), daemon=True).start()

    @staticmethod
    def _pump(x, y) -> None:
        try:
            while data := x.recv(65536):
                y.sendall(data)
            y.shutdown(socket.SHUT_WR)
        except OSError:  # closed by ``shut`` or by the peer
            pass


@pytest.fixture
def pebble(tmp_path, pki):
    made: list[Pebble] = []

    def make(**kw) -> Pebble:
        made.append(Pebble(str(tmp_path), pki, **kw))
        return made[-1]
    yield make
    for p in made:
        p.stop()


def acme_serve(build, ca, state, *extra, loop="epoll", domains=DOMAINS, http=True, email=EMAIL,
               port=None):
    """An ACME server on the ports Pebble validates (``port``: elsewhere, so that Pebble finds
    nothing on its TLS port)."""
    args = ["--port", str(port or ca.tls_port)]
    args += [a for d in domains for a in ("--domain", d)]
    args += ["--acme-email", email, "--acme-directory", ca.directory, "--acme-ca", ca.pki.ca,
             "--state", str(state)]
    if http:
        args += ["--http-port", str(ca.http_port)]
    s = Served(build, *args, *extra, loop=loop)
    return s


def _tls_args(s):
    return [a for d in DOMAINS for a in ("--resolve", f"{d}:{s.port}:127.0.0.1")]


def issued(s: Served, ca: Pebble, root: str) -> str:
    """Wait until the new certificate is what every worker presents (the previous
    generation, with the placeholder certificate, has exited); Pebble's root as a file."""
    s.wait_for("ACME: certificate for example.org, www.example.org issued")
    s.wait_for("ACME: every worker serves the new certificate")
    return ca.root(root)


def _cert_serial(port: int, root: str, name: str = "example.org") -> tuple[int, list]:
    ctx = ssl.create_default_context(cafile=root)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=name) as c:
            cert = c.getpeercert()
    return int(cert["serialNumber"], 16), [v for k, v in cert["subjectAltName"]]


def test_issuance_by_http01_alone_names_every_domain_and_curl_trusts_it(build, pebble, tmp_path):
    ca = pebble()
    state = tmp_path / "state"  # nothing answers where Pebble would try TLS-ALPN-01:
    s = acme_serve(build, ca, state, port=_free_port())
    try:
        root = issued(s, ca, str(tmp_path / "root.pem"))
        for d in DOMAINS:
            r = curl("--cacert", root, *_tls_args(s), f"https://{d}:{s.port}/css/site.css")
            assert r.returncode == 0 and r.stdout == demo_file("css/site.css"), r.stderr
        serial, names = _cert_serial(s.port, root)
        assert sorted(names) == DOMAINS
        files = sorted(os.listdir(state))
        assert "cert.json" in files and all(os.stat(state / f).st_mode & 0o077 == 0 for f in files)
    finally:
        assert s.stop() == 0


def test_issuance_by_tls_alpn01_alone_then_a_restart_reuses_it(build, pebble, tmp_path):
    ca = pebble()
    state = tmp_path / "state"  # no plain port: nothing answers where Pebble tries HTTP-01
    s = acme_serve(build, ca, state, http=False)
    try:
        assert s.http_port is None
        root = issued(s, ca, str(tmp_path / "root.pem"))
        serial, names = _cert_serial(s.port, root, "www.example.org")
        assert sorted(names) == DOMAINS
        # The challenge certificate was presented to acme-tls/1 hellos only: an ordinary
        # client meets the issued certificate (or, before it, the placeholder).
        r = curl("--cacert", root, *_tls_args(s), f"https://www.example.org:{s.port}/")
        assert r.returncode == 0 and r.stdout == demo_file("index.html"), r.stderr
    finally:
        assert s.stop() == 0
    s = acme_serve(build, ca, state, http=False)
    try:
        s.wait_for("ACME: using the stored certificate for example.org, www.example.org")
        assert _cert_serial(s.port, root)[0] == serial
        time.sleep(1.5)  # no order follows
        assert not any("ACME: requesting" in line for line in s.err), "".join(s.err)
    finally:
        assert s.stop() == 0


def test_renewal_under_load_fails_no_request_with_the_ca_away_at_first(build, pebble, tmp_path):
    """An 18 s certificate renews at two thirds of its life while requests run; the CA is
    unreachable at that time: still serving, retried, renewed once it is back."""
    ca = pebble(validity=18)
    gate = Gate(ca.dir_port)
    ca.dir_port = gate.port  # the server talks to Pebble through the gate
    s = acme_serve(build, ca, tmp_path / "state", "--admin-port", "0")
    failures, serials, stop, roots = [], [], threading.Event(), []

    def load() -> None:
        for _ in range(3000):  # bounded: ~30 s of sequential requests at most
            if stop.is_set():
                return
            ctx = ssl.create_default_context()
            for root in roots:  # a restarted Pebble issues from a new root
                ctx.load_verify_locations(root)
            try:
                with socket.create_connection(("127.0.0.1", s.port), timeout=10) as raw:
                    with ctx.wrap_socket(raw, server_hostname="example.org") as c:
                        c.sendall(b"GET /css/site.css HTTP/1.1\r\nHost: example.org\r\n"
                                  b"Connection: close\r\n\r\n")
                        data = b""
                        while chunk := c.recv(65536):
                            data += chunk
                        serial = c.getpeercert()["serialNumber"]
                if not (data.startswith(b"HTTP/1.1 200 OK")
                        and data.endswith(demo_file("css/site.css"))):
                    failures.append(data[:100])
                elif not serials or serials[-1] != serial:
                    serials.append(serial)
            except OSError as e:  # refused, reset, a failed handshake: a failed request
                failures.append((time.strftime("%H:%M:%S"), repr(e)[:60]))
            time.sleep(0.01)

    try:
        s.wait_for("ACME: certificate for example.org, www.example.org issued")
        roots.append(ca.root(str(tmp_path / "root.pem")))
        gate.shut()  # the CA goes away before the renewal
        t = threading.Thread(target=load)
        t.start()
        try:
            deadline = time.monotonic() + 40
            assert "cannot reach the CA" in s.wait_for("ACME: renewal failed", timeout=30)
            gate.open()
            while sum("issued" in line for line in s.err) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert sum("issued" in line for line in s.err) == 2, "".join(s.err)
            time.sleep(1)  # requests on the new certificate
        finally:
            stop.set()
            t.join()
        assert failures == [], "".join(s.err) + repr(failures)
        assert len(serials) == 2, serials  # the old certificate, then the new one
        metrics = urllib.request.urlopen(
            f"http://127.0.0.1:{s.admin_port}/metrics", timeout=5).read().decode()
        assert re.search(r"^orisha_acme_issued_total 2$", metrics, re.M), metrics
        assert re.search(r"^orisha_acme_failures_total [1-9]\d*$", metrics, re.M), metrics
    finally:
        assert s.stop() == 0


def _fails(build, ca_dir: str, ca_file: str, state, *extra, email=EMAIL, domains=DOMAINS):
    from conftest import orisha
    args = [a for d in domains for a in ("--domain", d)]
    r = orisha("serve", build, "--port", str(_free_port()), "--workers", "1", *args, "--acme-email",
               email, "--acme-directory", ca_dir, "--acme-ca", ca_file, "--state", str(state),
               *extra, timeout=60)
    assert r.returncode == 1, r.stderr
    return r.stderr.strip().splitlines()[-1]


def test_a_failing_first_issuance_is_one_line_and_leaves_nothing_half_written(build, pebble,
                                                                             pki, tmp_path):
    state = tmp_path / "state"
    line = _fails(build, "https://localhost:9/dir", pki.ca, state, email="me")
    assert line == "orisha: error: --acme-email me: not an e-mail address"
    assert not state.exists()
    line = _fails(build, f"https://localhost:{_free_port()}/dir", pki.ca, state)
    assert line.startswith("orisha: error: cannot get a certificate for example.org, "
                           "www.example.org: the directory: cannot reach the CA at "), line
    assert "Connection refused" in line
    assert not state.exists()  # nothing written before the CA has said yes
    ca = pebble()
    line = _fails(build, ca.directory.replace("/dir", "/nope"), pki.ca, state)
    assert line.startswith("orisha: error: cannot get a certificate for example.org, "
                           "www.example.org: the directory: "), line
    assert not state.exists()
    line = _fails(build, ca.directory, pki.ca, state, "--http-port", str(ca.http_port),
                  domains=["example.org", "127.0.0.1"])  # an address as a DNS name: refused
    # The CA's problem document: its type and detail, naming the refused domain.
    assert "(urn:ietf:params:acme:error:malformed)" in line and "IP address" in line, line
    assert "127.0.0.1" in line.split("the order for")[1], line
    files = os.listdir(state)  # the account the CA accepted, whole; no certificate
    assert len(files) == 1 and files[0].startswith("account-"), files
    with open(state / files[0]) as f:
        assert json.load(f)["uri"].startswith("https://localhost:")
    line = _fails(build, ca.directory, pki.ca, tmp_path / "other", "--tls-cert", pki.chain,
                  "--tls-key", pki.key)
    assert line == "orisha: error: --domain (certificates from ACME) or --tls-cert, not both"


@pytest.mark.parametrize("loop", [name for name in LOOPS if name != "epoll"])  # epoll: above
def test_issuance_on_every_hosted_loop(build, pebble, tmp_path, loop):
    ca = pebble()
    s = acme_serve(build, ca, tmp_path / "state", loop=loop)
    try:
        root = issued(s, ca, str(tmp_path / "root.pem"))
        r = curl("--cacert", root, *_tls_args(s), f"https://www.example.org:{s.port}/")
        assert r.returncode == 0 and r.stdout == demo_file("index.html"), r.stderr
        r = curl("-si", f"http://127.0.0.1:{s.http_port}/x?y", "-H", "Host: example.org")
        assert f"\r\nLocation: https://example.org:{s.port}/x?y\r\n".encode() in r.stdout
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("overlay", ["tls-cert-manager", "tls-acme"])
def test_the_kubernetes_overlays_name_what_the_executable_reads(overlay):
    """deploy/kubernetes/overlays/<overlay>: the env the container's entry point reads, the ports it
    then serves, the Secret mounted as a folder (watched: never subPath) or the state volume."""
    yaml = pytest.importorskip("yaml")
    from conftest import ROOT
    from orisha.targets.container import runtime
    folder = os.path.join(ROOT, "deploy", "kubernetes", "overlays", overlay)
    with open(os.path.join(folder, "kustomization.yaml")) as f:
        kust = yaml.safe_load(f)
    for r in kust["resources"][1:] + [p["path"] for p in kust["patches"] if "path" in p]:
        assert os.path.isfile(os.path.join(folder, r)), r
    with open(os.path.join(folder, "deployment-patch.yaml")) as f:
        pod = yaml.safe_load(f)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    saved = dict(os.environ)
    try:
        os.environ.update(env)
        args = runtime.parser().parse_args([])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    ports = {p["name"]: p["containerPort"] for p in c["ports"] if "name" in p}  # not $patch
    assert (args.port, args.http_port) == (ports["https"], ports["http"])
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert all("subPath" not in m for m in mounts.values())
    if overlay == "tls-cert-manager":
        (cert,), (key,) = args.tls_cert, args.tls_key  # --tls-cert repeats (SNI): one pair here
        assert os.path.dirname(cert) == mounts["tls"]["mountPath"] == os.path.dirname(key)
    else:
        assert pod.get("securityContext", {}).get("fsGroup") == 65534
        assert args.state == mounts["state"]["mountPath"] and args.acme_email
        assert env["DOMAINS"].split(",") == ["example.org", "www.example.org"]


def test_the_client_hello_names_its_server_and_alpn_before_openssl_sees_it():
    """What ``tls.Tls.choose`` reads from the raw first record (RFC 8737 needs the ALPN list,
    which the stdlib's SNI callback cannot see): a real OpenSSL ClientHello, whole and cut."""
    from orisha.protocols.tls import ACME_ALPN, client_hello

    def hello(alpn, name="Example.ORG") -> bytes:
        ctx = ssl.create_default_context()
        if alpn:
            ctx.set_alpn_protocols(alpn)
        out = ssl.MemoryBIO()
        c = ctx.wrap_bio(ssl.MemoryBIO(), out, server_hostname=name)
        with pytest.raises(ssl.SSLWantReadError):
            c.do_handshake()
        return out.read()

    data = hello([ACME_ALPN])
    assert client_hello(data) == ("example.org", [b"acme-tls/1"])
    assert client_hello(hello(["h2", "http/1.1"])) == ("example.org", [b"h2", b"http/1.1"])
    assert client_hello(hello(None)) == ("example.org", [])
    for n in range(len(data)):  # a cut record never raises: None, or what it holds so far
        r = client_hello(data[:n])
        assert r is None or isinstance(r, tuple)
    assert client_hello(b"GET / HTTP/1.1\r\n\r\n") is None


def chromium_trusting(root: str, folder, names) -> str:
    """A Chromium launcher that trusts ``root`` as a certificate authority, the way a user's
    machine trusts one — in an NSS database of its own HOME (Chromium on Linux reads locally
    added trust anchors from ~/.pki/nssdb), not by ignoring certificate errors as
    ``tlsutil.trusting_chromium`` does — with ``names`` resolved to 127.0.0.1."""
    import shlex
    from browser import chromium
    home = os.path.join(str(folder), "chromium-home")
    db = os.path.join(home, ".pki", "nssdb")
    os.makedirs(db)
    for args in (["-N", "--empty-password"], ["-A", "-t", "C,,", "-n", "Pebble root", "-i", root]):
        subprocess.run(["certutil", "-d", f"sql:{db}", *args], check=True, capture_output=True,
                       timeout=30)
    rules = ", ".join(f"MAP {n} 127.0.0.1" for n in names)
    wrapper = os.path.join(str(folder), "chromium-trusting")
    with open(wrapper, "w") as f:
        f.write(f"#!/bin/sh\nHOME={shlex.quote(home)} exec {shlex.quote(chromium())} "
                f"{shlex.quote('--host-resolver-rules=' + rules)} \"$@\"\n")
    os.chmod(wrapper, 0o755)
    return wrapper


def test_chromium_trusting_pebbles_root_loads_the_demo_site(build, pebble, tmp_path):
    """Headless Chromium with Pebble's root (from its management port) as a trusted CA:
    the demo site over https from a certificate Pebble issued, no certificate error, every
    response 200 (the access log's lines)."""
    from browser import chromium, load_pages
    assert chromium() is not None, "no Chromium (apt-get install chromium; ./dev test does)"
    ca = pebble()
    log = tmp_path / "access.log"
    s = acme_serve(build, ca, tmp_path / "state", "--access-log", str(log))
    try:
        root = issued(s, ca, str(tmp_path / "root.pem"))
        wrapper = chromium_trusting(root, tmp_path, DOMAINS)
        pages = [f"https://{d}:{s.port}/" for d in DOMAINS] + [f"https://example.org:{s.port}/docs/"]
        for res in load_pages(pages, timeout=30, executable=wrapper):
            assert res.ok, res.problems
        def logged() -> list[str]:  # access-log lines leave the workers once a second
            return [x for x in log.read_text().splitlines() if "favicon" not in x]
        deadline = time.monotonic() + 10  # that second, on a loaded host (a sleep of 1.5 s
        while len(logged()) <= len(pages) and time.monotonic() < deadline:  # missed some)
            time.sleep(0.1)
        lines = logged()
        assert len(lines) > len(pages)  # the pages and what they load
        assert all(re.search(r'" 200 \d+$', x) for x in lines), lines
    finally:
        assert s.stop() == 0


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone; or reaped between open and read
        return False                                 # (ESRCH: the loaded proof32)


def _holder_of(port: int, remote: int, pids: list[int]) -> int:
    """Which of ``pids`` holds the loopback TCP connection from local port ``port`` to
    ``remote``. Both ports: an earlier connection of the suite's from the same ephemeral
    port may linger in TIME_WAIT (inode 0, and listed first: a proof's run took it)."""
    with open("/proc/net/tcp") as f:
        inode = next(row.split()[9] for row in f.read().splitlines()[1:]
                     if int(row.split()[1].rsplit(":", 1)[1], 16) == port
                     and int(row.split()[2].rsplit(":", 1)[1], 16) == remote)
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return pid
            except OSError:
                continue
    raise AssertionError(f"no process of {pids} holds port {port}")


def test_a_stopped_server_stops_its_acme_attempt_at_once(build, pki, tmp_path):
    """A CA that accepts and never answers holds the helper in its first request; SIGTERM
    stops the attempt at once — while a worker still finishes — and no process of the
    server outlives it."""
    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    threading.Thread(target=lambda: [held.append(silent.accept()[0]) for _ in range(4)],
                     daemon=True).start()
    s = Served(build, "--port", str(_free_port()), "--domain", "example.org", "--acme-email",
               EMAIL, "--acme-directory", f"https://127.0.0.1:{silent.getsockname()[1]}/dir",
               "--acme-ca", pki.ca, "--state", str(tmp_path / "state"))
    try:
        s.wait_for("ACME: requesting a certificate for example.org")
        deadline = time.monotonic() + 10
        while not held and time.monotonic() < deadline:  # the helper has connected
            time.sleep(0.05)
        kids = _children(s.proc.pid)
        assert held and len(kids) == 3, (kids, "".join(s.err))  # 2 workers and the helper
        helper = _holder_of(held[0].getpeername()[1], silent.getsockname()[1], kids)
        # A worker that cannot finish its stop at once (stopped) holds the server in its
        # graceful stop; the attempt must not wait for that, nor for the server's exit.
        worker = next(p for p in kids if p != helper)
        os.kill(worker, signal.SIGSTOP)
        try:
            s.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10  # a bound for a loaded machine; at once here
            while _alive(helper) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not _alive(helper) and _alive(s.proc.pid), "".join(s.err)
        finally:
            os.kill(worker, signal.SIGCONT)  # its SIGTERM, pending, stops it now
    finally:
        assert s.stop() == 0
        silent.close()
        for c in held:
            c.close()
    assert not [p for p in kids if _alive(p)], "".join(s.err)
    assert not any("Traceback" in line for line in s.err), "".join(s.err)


def _lowest_free_fd(pid: int) -> int:
    used = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
    return next(n for n in range(len(used) + 1) if n not in used)


def _stored(state, before: float, after: float):
    """A state folder whose certificate for example.org began ``before`` seconds ago and
    ends in ``after`` (self-signed: what matters is when its renewal is due)."""
    import datetime
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "example.org")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(seconds=before))
            .not_valid_after(now + datetime.timedelta(seconds=after))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("example.org")]), False)
            .sign(key, hashes.SHA256()))
    state.mkdir()
    (state / "cert-1.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (state / "key-1.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    (state / "cert.json").write_text(json.dumps(
        {"domains": ["example.org"], "key": "key-1.pem", "cert": "cert-1.pem"}))
    return state


def _still_served_on_the_stored_certificate(s):
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # the stored certificate
    assert _get(s.port, ctx)[0].startswith(b"HTTP/1.1 200 OK")


def test_a_helper_that_cannot_be_made_is_one_line_and_a_retry(build, pki, tmp_path):
    """The supervisor out of file descriptors when a renewal is due (its socketpair fails
    with EMFILE, as a fork can with EAGAIN): one line, a retry, the site still served."""
    import resource
    state = _stored(tmp_path / "state", before=6, after=12)  # renewal due in ~6 s
    s = Served(build, "--port", str(_free_port()), "--domain", "example.org", "--acme-email",
               EMAIL, "--acme-directory", f"https://127.0.0.1:{_free_port()}/dir",
               "--acme-ca", pki.ca, "--state", str(state), "--no-http3")
    try:
        s.wait_for("ACME: using the stored certificate for example.org")
        soft, hard = resource.prlimit(s.proc.pid, resource.RLIMIT_NOFILE)
        limit = _lowest_free_fd(s.proc.pid)  # no new descriptor from here on
        resource.prlimit(s.proc.pid, resource.RLIMIT_NOFILE, (limit, hard))
        line = s.wait_for("ACME: cannot start the helper", timeout=20)
        assert "Too many open files" in line and "retrying in 5 s" in line, line
        assert s.proc.poll() is None, "".join(s.err)
        resource.prlimit(s.proc.pid, resource.RLIMIT_NOFILE, (soft, hard))
        _still_served_on_the_stored_certificate(s)
    finally:
        assert s.stop() == 0
    assert not any("Traceback" in line for line in s.err), "".join(s.err)


def test_challenges_that_cannot_be_served_fail_the_renewal_without_asking_the_ca(build, pebble,
                                                                                  tmp_path):
    """At renewal the served key file has become unreadable: no generation can present the
    challenges, so the attempt fails (backoff, the current workers serving on) and the CA is
    never told to validate challenges that nothing answers."""
    ca = pebble()
    state = _stored(tmp_path / "state", before=4, after=5)  # renewal due in ~2 s
    s = acme_serve(build, ca, state, domains=["example.org"], port=_free_port())
    try:
        s.wait_for("ACME: using the stored certificate for example.org")
        (state / "key-1.pem").write_text("not a key\n")
        line = s.wait_for("ACME: renewal failed", timeout=30)
        assert "could not put the challenges in place" in line, "".join(s.err)
        assert "next attempt in" in line
        with open(ca.config + ".log") as f:
            log = f.read()
        assert "validat" not in log.lower(), log[-2000:]  # Pebble logs every validation
        _still_served_on_the_stored_certificate(s)
    finally:
        assert s.stop() == 0
    assert not any("Traceback" in line for line in s.err), "".join(s.err)
