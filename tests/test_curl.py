"""End to end with a real client: curl against each loop body."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from conftest import demo_file

pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is installed by .ci/run")


def curl(port, path, *args):
    r = subprocess.run(["curl", "-sS", "-D", "-", "-o", "/dev/stdout", *args,
                        f"http://127.0.0.1:{port}{path}"], capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr
    head, _, body = r.stdout.partition(b"\r\n\r\n")
    headers = {}
    lines = head.decode("latin-1").split("\r\n")
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("coding", ["gzip", "br", "zstd"])
def test_curl_decodes_each_encoding(port, coding):
    status, h, body = curl(port, "/files/big.txt", "-H", f"Accept-Encoding: {coding}", "--compressed")
    assert status == 200 and h["content-encoding"] == coding
    assert body == demo_file("files/big.txt")


def test_curl_compressed(port):
    status, h, body = curl(port, "/css/site.css", "--compressed")
    assert h.get("content-encoding") in ("gzip", "br", "zstd") and body == demo_file("css/site.css")


def test_curl_plain_gets_identity(port):
    status, h, body = curl(port, "/css/site.css")
    assert "content-encoding" not in h and body == demo_file("css/site.css")


def test_curl_head(port):
    r = subprocess.run(["curl", "-sS", "-I", f"http://127.0.0.1:{port}/data/planets.json"],
                       capture_output=True, timeout=30)
    assert r.stdout.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Content-Length: %d\r\n" % len(demo_file("data/planets.json")) in r.stdout


def test_curl_range_and_resume(port, tmp_path):
    status, h, body = curl(port, "/files/big.txt", "-r", "1000-1999")
    assert status == 206 and body == demo_file("files/big.txt")[1000:2000]
    part = tmp_path / "big.txt"
    part.write_bytes(demo_file("files/big.txt")[:500000])
    subprocess.run(["curl", "-sS", "-C", "-", "-o", str(part), f"http://127.0.0.1:{port}/files/big.txt"],
                   check=True, timeout=30)
    assert part.read_bytes() == demo_file("files/big.txt")


def test_curl_conditional(port):
    _, h, _ = curl(port, "/img/logo.svg")
    status, h2, body = curl(port, "/img/logo.svg", "-H", f"If-None-Match: {h['etag']}")
    assert status == 304 and body == b""
    status, _, _ = curl(port, "/img/logo.svg", "-H", f"If-Modified-Since: {h['last-modified']}")
    assert status == 304


def test_curl_follows_directory_redirect(port):
    r = subprocess.run(["curl", "-sS", "-L", "-w", "%{http_code} %{num_redirects} %{url_effective}",
                        "-o", "/dev/null", f"http://127.0.0.1:{port}/docs?x=1"],
                       capture_output=True, text=True, timeout=30)
    assert r.stdout == f"200 1 http://127.0.0.1:{port}/docs/?x=1"


def test_curl_keepalive_reuses_one_connection(port):
    url = f"http://127.0.0.1:{port}"
    r = subprocess.run(["curl", "-sS", "-v", "-o", "/dev/null", "-o", "/dev/null", "-o", "/dev/null",
                        f"{url}/", f"{url}/css/site.css", f"{url}/img/logo.svg"],
                       capture_output=True, text=True, timeout=30)
    assert r.stderr.count("Connected to") == 1, r.stderr
