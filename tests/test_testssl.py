"""testssl.sh (Debian's `testssl`), the tool an operator points at a new HTTPS server, run
against Orisha's TLS port: protocols, cipher categories, server preferences, forward secrecy,
the server defaults, HTTP headers and every vulnerability check it has. Nothing may be rated
MEDIUM or worse except what belongs to the test's own certificate and one finding that
does not apply to a static site."""

from __future__ import annotations

import json
import subprocess

import pytest

from tlsutil import _stop_servers, pki, tls_server  # noqa: F401  (fixtures: servers stopped at the end when run alone)

pytestmark = pytest.mark.slow  # a peer tool: ~1 min

# The suite's certificate lives three days and its CA publishes neither CRL nor OCSP:
# findings about it, not about the server.
CERTIFICATE = {"cert_expirationStatus", "cert_notAfter", "cert_revocation"}
# BREACH (CVE-2013-3587) needs a secret and attacker-chosen input in one compressed body; a
# built site's bodies are fixed at build time and reflect nothing of the request. testssl.sh
# flags any compressed answer ("potentially VULNERABLE").
NOT_APPLICABLE = {"BREACH"}


def test_testssl_finds_nothing_wrong_with_the_tls_policy(builds, pki, tmp_path):
    """The compiled layer, what a server runs where it was built (the pure one takes the same
    policy from tls.py; test_tls.py checks both)."""
    s = tls_server(builds, "epoll", pki, "--hsts", "31536000")
    out = tmp_path / "testssl.json"
    r = subprocess.run(["testssl", "--quiet", "--color", "0", "--warnings", "off",
                        "--add-ca", pki.ca, "--jsonfile", str(out),
                        "-p", "-s", "-f", "-S", "-P", "-h", "-U", f"127.0.0.1:{s.port}"],
                       capture_output=True, text=True, timeout=400)
    findings = json.loads(out.read_text())
    assert len(findings) > 50, r.stdout[-2000:] + r.stderr[-1000:]  # it ran its checks
    by = {f["id"]: f for f in findings}
    bad = [(f["id"], f["severity"], f["finding"]) for f in findings
           if f["severity"] in ("MEDIUM", "HIGH", "CRITICAL")
           and f["id"] not in CERTIFICATE | NOT_APPLICABLE]
    assert not bad, bad
    assert by["cert_chain_of_trust"]["severity"] == "OK", by["cert_chain_of_trust"]
    for old in ("SSLv2", "SSLv3", "TLS1", "TLS1_1"):
        assert by[old]["finding"].startswith("not offered"), by[old]
    assert by["TLS1_3"]["finding"].startswith("offered"), by["TLS1_3"]
    assert by["HSTS_time"]["severity"] == "OK", by.get("HSTS_time") or by.get("HSTS")
    assert by["cipher_order"]["severity"] == "OK", by["cipher_order"]  # the server's order
