"""The container serves HTTP/3 and obtains its certificate by ACME: what the frozen
executable bundles (aioquic, pylsqpack, acme, josepy, requests, certifi, cryptography).

The image is the suite's demo image (tests/container_target.py builds it once per session,
the same one tests/test_container.py uses). HTTP/3: the container publishes 8080/tcp and
8080/udp on 127.0.0.1 (the README's ``-p …/tcp -p …/udp``) and aioquic's client
(tests/test_h3.py's ``h3_get``) gets the demo's pages byte-identical to HTTP/1.1. ACME: Pebble
and pebble-challtestsrv (tests/test_acme.py's ``Pebble``) on the host's loopback, the
container in the host's network namespace (``--network host``: the only way for it to reach
the CA on 127.0.0.1 and for Pebble to reach its challenge ports; it listens on 127.0.0.1
only), the state on a volume (``-v DIR:/state``), and a second container on the same volume
serving the stored certificate without a new order.
"""

from __future__ import annotations

import os
import shutil
import ssl
import time

import pytest
from conftest import DEMO, MODES, demo_file
from container_target import Container, build, init_pid, namespace_processes
from test_acme import DOMAINS, EMAIL, _cert_serial, pebble  # noqa: F401  (a fixture)
from test_h3 import h3_get, http11
from tlsutil import client_context, pki  # noqa: F401  (pki: a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]
PAGES = ["/", "/css/site.css", "/img/pixel.png"]


@pytest.fixture(scope="module")
def demo():
    """(build folder, image tag) of the demo site: tests/test_container.py's image."""
    return build(DEMO, MODES["notfound"])


def _readable(tmp_path, *files: str) -> str:
    """A folder holding copies of ``files`` that the image's user (65534) can read."""
    folder = tmp_path / "mounted"
    folder.mkdir(exist_ok=True)
    for f in files:
        shutil.copyfile(f, folder / os.path.basename(f))
        os.chmod(folder / os.path.basename(f), 0o644)
    return str(folder)


def _tls_container(tag: str, pki, tmp_path, *args: str, env=()) -> Container:
    certs = _readable(tmp_path, pki.cert, pki.key)
    return Container(tag, ["--workers", "2", "--tls-cert", "/certs/cert.pem",
                           "--tls-key", "/certs/key.pem", *args],
                     run_args=["-v", f"{certs}:/certs:ro", *[a for e in env for a in ("-e", e)]],
                     publish=("8080/tcp", "8080/udp"), tls=client_context(pki, ("http/1.1",)))


def test_h3_from_the_container_is_byte_identical_to_http11(demo, pki, tmp_path):
    _, tag = demo
    c = _tls_container(tag, pki, tmp_path)
    try:
        got = h3_get(c.ports["8080/udp"], pki.ca, [(p, "GET", ()) for p in PAGES])
        for path, (status, headers, body, _) in zip(PAGES, got):
            s11, h11, b11 = http11(c.port, pki, "GET", path, {})
            assert status == s11 == 200 and body == b11 == demo_file(path.lstrip("/") or
                                                                     "index.html"), path
            assert headers["etag"] == h11["etag"] and headers["content-type"] == h11["content-type"]
        # the TCP answers offer h3 on the port the container binds (published as the same
        # number on the host, as the README's -p pair does)
        assert h11["alt-svc"] == 'h3=":8080"; ma=86400'
        # and the hosted server's engine answered: compiled_h3 (ngtcp2 linked into it),
        # mapped in the image's workers
        assert any("compiled_h3" in _maps(p) for p, *_ in namespace_processes(init_pid(c.container)))
    finally:
        c.stop()


def _maps(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f.read()
    except OSError:  # ended meanwhile
        return ""


def test_no_http3_in_the_container_turns_it_off(demo, pki, tmp_path):
    _, tag = demo
    c = _tls_container(tag, pki, tmp_path, env=["HTTP3=0"])
    try:
        status, headers, body = http11(c.port, pki, "GET", "/", {})
        assert status == 200 and "alt-svc" not in headers
        with pytest.raises((ConnectionError, TimeoutError, OSError)):
            _quick_h3(c.ports["8080/udp"], pki.ca)
    finally:
        c.stop()


def _quick_h3(port: int, ca: str) -> None:
    """An h3 connection attempt that gives up after 3 s (nothing answers: --no-http3)."""
    import asyncio

    from aioquic.asyncio.client import connect
    from aioquic.h3.connection import H3_ALPN
    from aioquic.quic.configuration import QuicConfiguration

    async def run():
        config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN,
                                   server_name="localhost", idle_timeout=3)
        config.load_verify_locations(ca)
        async with connect("127.0.0.1", port, configuration=config, wait_connected=True):
            pass
    asyncio.run(asyncio.wait_for(run(), 3))


def _acme_container(tag: str, ca, mounted: str, state) -> Container:
    """The container on the ports Pebble validates, its settings from the image's
    environment variables (DOMAINS, ACME_EMAIL, STATE), the state on a volume."""
    env = {"DOMAINS": ",".join(DOMAINS), "ACME_EMAIL": EMAIL, "STATE": "/state",
           "HTTP_PORT": str(ca.http_port)}
    probe = ssl.create_default_context()
    probe.check_hostname, probe.verify_mode = False, ssl.CERT_NONE  # up: placeholder or issued
    return Container(tag, ["--workers", "2", "--acme-directory", ca.directory,
                           "--acme-ca", "/ca/ca.pem"],
                     run_args=["-v", f"{state}:/state", "-v", f"{mounted}:/ca:ro",
                               *[a for k, v in env.items() for a in ("-e", f"{k}={v}")]],
                     port=ca.tls_port, tls=probe)


def _wait_log(c: Container, text: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while True:
        out, err = c.logs()
        if text in err:
            return err
        assert time.monotonic() < deadline, f"no {text!r} in the container's log:\n{out}{err}"
        time.sleep(0.2)


def test_acme_in_the_container_with_a_state_volume_and_a_restart_reusing_it(demo, pki,
                                                                             pebble, tmp_path):
    _, tag = demo
    ca = pebble()
    mounted = _readable(tmp_path, pki.ca)
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o777)  # written by the image's user, as the pod's fsGroup makes it
    root = str(tmp_path / "root.pem")
    c = _acme_container(tag, ca, mounted, state)
    try:
        _wait_log(c, "ACME: certificate for example.org, www.example.org issued")
        _wait_log(c, "ACME: every worker serves the new certificate")
        ca.root(root)
        serial, names = _cert_serial(c.port, root, "www.example.org")
        assert sorted(names) == DOMAINS
        ctx = ssl.create_default_context(cafile=root)
        ctx.set_alpn_protocols(["http/1.1"])
        import socket
        with socket.create_connection(("127.0.0.1", c.port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname="example.org") as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: example.org\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(demo_file("index.html"))
        files = sorted(os.listdir(state))
        assert "cert.json" in files and all(os.stat(state / f).st_mode & 0o077 == 0 for f in files)
        assert {os.stat(state / f).st_uid for f in files} == {65534}
    finally:
        c.stop()
    c = _acme_container(tag, ca, mounted, state)
    try:
        err = _wait_log(c, "ACME: using the stored certificate for example.org, www.example.org")
        assert _cert_serial(c.port, root)[0] == serial
        time.sleep(1.5)  # no order follows
        assert "ACME: requesting" not in c.logs()[1], err
    finally:
        c.stop()


@pytest.mark.parametrize("overlay", ["tls-cert-manager", "tls-acme"])
def test_the_tls_overlays_publish_the_udp_port_alt_svc_names(overlay):
    """Alt-Svc names the port the pod binds (h3=":PORT"): the pod's UDP port and the
    Service's are that number, beside the TCP port a client first reaches (HTTP/3 with a
    mounted certificate, or ACME's)."""
    import yaml
    from conftest import ROOT
    from orisha.targets.container import runtime
    folder = os.path.join(ROOT, "deploy", "kubernetes", "overlays", overlay)
    with open(os.path.join(folder, "deployment-patch.yaml")) as f:
        (c,) = yaml.safe_load(f)["spec"]["template"]["spec"]["containers"]
    with open(os.path.join(folder, "kustomization.yaml")) as f:
        patches = [yaml.safe_load(p["patch"]) for p in yaml.safe_load(f)["patches"] if "patch" in p]
    (svc,) = [op["value"] for ops in patches for op in ops if op["path"] == "/spec/ports"]
    saved = dict(os.environ)
    try:
        os.environ.update({e["name"]: e["value"] for e in c["env"]})
        args = runtime.parser().parse_args([])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert args.http3 and (args.tls_cert or args.acme_email)
    udp = [p for p in c["ports"] if p.get("protocol") == "UDP"]
    assert [p["containerPort"] for p in udp] == [args.port]
    (h3,) = [p for p in svc if p.get("protocol") == "UDP"]
    assert h3["targetPort"] == udp[0]["name"] and h3["port"] == args.port
