"""A test certificate authority made with the openssl CLI, and TLS clients for the tests.

``make_pki(folder)`` writes a CA (``ca.pem``), a leaf for localhost and
127.0.0.1 signed by it (``cert.pem`` + ``key.pem``), the leaf followed by the CA
(``chain.pem``), and a second leaf (``cert2.pem``/``key2.pem``, another serial)
for reload tests. Keys are P-256: quick to make, and what browsers expect.
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
from typing import NamedTuple


class Pki(NamedTuple):
    dir: str
    ca: str
    cert: str
    key: str
    chain: str
    cert2: str
    key2: str


def _openssl(*args: str, cwd: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(folder: str) -> Pki:
    os.makedirs(folder, exist_ok=True)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "3",
             "-subj", "/CN=Orisha Test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=folder)
    with open(os.path.join(folder, "leaf.ext"), "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n")
    for name, key in (("cert", "key"), ("cert2", "key2")):
        _openssl("req", *ec, "-keyout", f"{key}.pem", "-out", f"{name}.csr",
                 "-subj", "/CN=localhost", cwd=folder)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "3", "-extfile", "leaf.ext",
                 cwd=folder)
    p = lambda n: os.path.join(folder, n)  # noqa: E731
    with open(p("chain.pem"), "wb") as out:
        for n in ("cert.pem", "ca.pem"):
            with open(p(n), "rb") as f:
                out.write(f.read())
    return Pki(folder, p("ca.pem"), p("cert.pem"), p("key.pem"), p("chain.pem"), p("cert2.pem"),
               p("key2.pem"))


def trusting_chromium(cert: str, folder) -> str:
    """A Chromium launcher (a script in ``folder``) that trusts ``cert``'s public key, as a
    browser trusts a real certificate; for tests/browser.py ``load_pages(executable=...)``."""
    from browser import chromium
    spki = subprocess.run(
        f"openssl x509 -in {cert} -pubkey -noout | openssl pkey -pubin -outform der"
        " | openssl dgst -sha256 -binary | base64", shell=True, capture_output=True,
        text=True, check=True).stdout.strip()
    wrapper = os.path.join(str(folder), "chromium")
    with open(wrapper, "w") as f:
        f.write(f"#!/bin/sh\nexec {chromium()} --ignore-certificate-errors-spki-list={spki} \"$@\"\n")
    os.chmod(wrapper, 0o755)
    return wrapper


def client_context(pki: Pki, alpn=("h2", "http/1.1"), version: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=pki.ca)
    if alpn:
        ctx.set_alpn_protocols(list(alpn))
    if version == "1.2":
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    elif version == "1.3":
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


def tls_connect(port: int, ctx: ssl.SSLContext, timeout: float = 10, session=None) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    return ctx.wrap_socket(raw, server_hostname="localhost", session=session)


def serve(build: str, *args: str, env: dict | None = None):
    """`orisha serve` in a subprocess (conftest's ``Server``), its port read from an
    ``https://`` or ``http://`` start-up line."""
    import re

    from conftest import RUN_DIR, Server, check_installed
    s = Server.__new__(Server)
    s.proc = subprocess.Popen(Server.cmd(build, *args), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=RUN_DIR)
    s.line = s.proc.stdout.readline()
    m = re.search(r"https?://([\d.]+):(\d+)/", s.line)
    if not m:
        s.proc.kill()
        raise RuntimeError(f"server did not start: {s.line!r} {s.proc.stderr.read()}")
    s.port = int(m.group(2))
    check_installed(s.proc, env)
    return s


# -- fixtures shared by test_tls.py, test_h2.py and test_h2_attacks.py ----------------------
import pytest  # noqa: E402

# The loops, and the pure-Python bodies of those that also have a compiled one (conftest.PURE).
HOSTED = ["epoll", "io-uring", "kqueue", "asyncio", "epoll-pure", "io-uring-pure"]
_servers: dict = {}
_pki: list = []


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    # Each test module that imports this fixture gets its own instance of it (pytest scopes
    # imported fixtures per module): one CA for the session, shared with the server cache.
    if not _pki:
        _pki.append(make_pki(str(tmp_path_factory.mktemp("pki"))))
    return _pki[0]


@pytest.fixture(scope="session", params=HOSTED)
def hosted(request):
    return request.param


def tls_server(builds, loop: str, pki, *extra: str):
    """A TLS server per (loop, extra options), kept for the session; ``pki=None``: cleartext."""
    from conftest import TEST_LIMITS
    key = (loop, pki is None, extra)
    if key not in _servers:
        tls = ["--tls-cert", pki.chain, "--tls-key", pki.key] if pki else []
        pure = loop.endswith("-pure")
        env = {**os.environ, "ORISHA_PURE": "1"} if pure else None
        _servers[key] = serve(builds["notfound"], "--loop", loop.removesuffix("-pure"), "--workers",
                              "2", *tls, *TEST_LIMITS, *extra, env=env)
    return _servers[key]


@pytest.fixture(scope="session")
def tls_port(builds, hosted, pki):
    return tls_server(builds, hosted, pki).port


@pytest.fixture(scope="session")
def h2c_port(builds, hosted):
    return tls_server(builds, hosted, None).port


@pytest.fixture(scope="session", autouse=True)
def _stop_servers():
    yield
    for s in _servers.values():
        s.stop()
    _servers.clear()
