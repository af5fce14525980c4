"""h2spec against every target that speaks HTTP/2, and TLS output that leaves at once (issue 19).

h2spec (github.com/summerwind/h2spec 2.6.0; the static binary beside every checkout,
../shared/tools/h2spec, see its README there) runs its 146 cases (RFC 7540/9113 and
HPACK) once per target: each hosted loop body, compiled and pure, over TLS (ALPN h2,
``-t -k``) and as h2c with prior knowledge; and the container, both ways. The booted
image's own HTTP/2 (unikernel/src/h2.c) is run in tests/test_unikernel_h2.py, on the
image that test already boots. Its JUnit report (``-j``) is read: every case must pass,
none skipped; a failure names the case ids (``http2/5.1/5``) and h2spec's words.

One case cannot pass on a cleartext port that also serves HTTP/1.1: ``http2/3.5/2``
sends ``INVALID CONNECTION PREFACE\\r\\n\\r\\n`` as its first bytes. That is no HTTP/2
preface (a client that sends the preface's first line, ``PRI * HTTP/2.0``, is treated
as an HTTP/2 client, orisha/protocols/front.py), but an HTTP/1.1 request with an invalid
request line, which gets the 400 the conformance suite asks for (``GET / http/1.1`` is
the same case); h2spec, reading it as frames, reports "unexpected EOF". Over TLS (ALPN
h2: nothing but HTTP/2) it passes. On h2c it is therefore expected to fail, and why is
checked too: the server's answer to those bytes is that HTTP/1.1 400.

TLS: OpenSSL writes while it reads (the no_renegotiation alert to a TLS 1.2 client's
renegotiation, TLS 1.3 tickets, KeyUpdate); orisha/protocols/tls.py sends it at once.
``openssl s_client -tls1_2`` is told ``R`` (renegotiate): the alert must come, and the
client give up and exit, long before the server's idle timeout would have flushed it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import xml.etree.ElementTree as ET

import pytest
from conftest import DEMO, MODES, ROOT, TEST_LIMITS, _server
from tlsutil import _stop_servers, h2c_port, hosted, pki, tls_port, tls_server  # noqa: F401

H2SPEC = os.path.join(ROOT, "..", "shared", "tools", "h2spec")
CASES = 146
# The per-frame wait: every case that passes answers in milliseconds; a case that fails
# waits this long once. Generous for a loaded machine, short enough for a quick run.
TIMEOUT = 3
H2C_HTTP1 = {"http2/3.5/2"}  # see the module docstring


def h2spec(port: int, tls: bool, report: str) -> dict[str, str]:
    """Run h2spec against 127.0.0.1:``port``; {case id: failure text or ""} from its report."""
    args = [H2SPEC, "-h", "127.0.0.1", "-p", str(port), "-o", str(TIMEOUT), "-j", report]
    r = subprocess.run(args + (["-t", "-k"] if tls else []), capture_output=True, text=True,
                       timeout=CASES * TIMEOUT + 60)
    assert os.path.exists(report), f"h2spec wrote no report (exit {r.returncode}): {r.stderr}"
    results: dict[str, str] = {}
    for suite in ET.parse(report).getroot().iter("testsuite"):
        for i, case in enumerate(suite.iter("testcase"), 1):
            cid = f"{suite.get('package')}/{i}"
            bad = [e for e in case if e.tag in ("failure", "error", "skipped")]
            results[cid] = "; ".join(f"{e.tag}: {(e.get('message') or e.text or '').strip()}"
                                     for e in bad)
    return results


def check(results: dict[str, str], allowed: set[str] = frozenset()) -> None:
    failed = {cid: why for cid, why in results.items() if why}
    unexpected = {cid: why for cid, why in failed.items() if cid not in allowed}
    assert len(results) == CASES, f"{len(results)} cases in the report, not {CASES}"
    assert not unexpected, (f"{CASES - len(failed)} passed, {len(failed)} failed: "
                            + ", ".join(sorted(unexpected)) + "\n"
                            + "\n".join(f"{c}: {w[:300]}" for c, w in sorted(unexpected.items())))
    assert set(failed) == set(allowed), f"now passing: {sorted(set(allowed) - set(failed))}"


def answer_to_invalid_preface(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"INVALID CONNECTION PREFACE\r\n\r\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


# -- the hosted loops ---------------------------------------------------------------------

def test_h2spec_over_tls(tls_port, tmp_path):
    check(h2spec(tls_port, True, str(tmp_path / "report.xml")))


def test_h2spec_h2c(h2c_port, tmp_path):
    check(h2spec(h2c_port, False, str(tmp_path / "report.xml")), H2C_HTTP1)
    assert answer_to_invalid_preface(h2c_port).startswith(b"HTTP/1.1 400 Bad Request\r\n")


# -- the container -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def container_tls(pki, builds):
    from container_target import Container, build
    _server(builds, "container", "notfound")  # the session's plain container: its image built
    _, tag = build(DEMO, MODES["notfound"])
    os.chmod(pki.dir, 0o755)  # the container runs as uid 65534
    os.chmod(pki.key, 0o644)
    c = Container(tag, TEST_LIMITS, run_args=["-v", f"{pki.dir}:/certs:ro",
                                              "-e", "TLS_CERT=/certs/chain.pem",
                                              "-e", "TLS_KEY=/certs/key.pem"])
    try:
        yield c
    finally:
        c.stop()


@pytest.mark.slow
def test_h2spec_the_container(container_tls, builds, tmp_path):
    assert "https://" in container_tls.line
    check(h2spec(container_tls.port, True, str(tmp_path / "tls.xml")))
    plain = _server(builds, "container", "notfound").port
    check(h2spec(plain, False, str(tmp_path / "h2c.xml")), H2C_HTTP1)


# -- TLS: what OpenSSL writes during a read goes out at once ----------------------------------

def renegotiate(port: int, ca: str, wait: float) -> tuple[float, str]:
    """``openssl s_client -tls1_2``, then ``R``: (seconds until it exits, its output). It
    exits when the renegotiation fails, i.e. once the server's alert reached it."""
    p = subprocess.Popen(["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-tls1_2",
                          "-CAfile", ca, "-servername", "localhost"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out = b""
        while b"Verify return code" not in out:  # the handshake is done and printed
            line = p.stdout.readline()
            assert line, out.decode(errors="replace")
            out += line
        started = time.monotonic()
        p.stdin.write(b"R\n")  # s_client's command: renegotiate
        p.stdin.flush()
        try:
            rest, _ = p.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            rest = b"(still waiting)"
        return time.monotonic() - started, (out + rest).decode(errors="replace")
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate()


@pytest.fixture(scope="session")
def long_idle_tls(builds, pki, hosted):
    """A TLS server whose idle timeout (30 s) is far from the wait below: before the fix the
    alert left only with the close_notify, at the idle timeout."""
    return tls_server(builds, hosted, pki, "--idle-timeout", "30")


def test_a_tls12_renegotiation_is_refused_at_once(long_idle_tls, pki):
    took, out = renegotiate(long_idle_tls.port, pki.ca, wait=15)
    assert "RENEGOTIATING" in out and "no renegotiation" in out, out[-800:]
    assert took < 15, out[-800:]  # (a bound far from both: ~0.01 s now, 30 s before)
