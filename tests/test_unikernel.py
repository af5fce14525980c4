"""The unikernel target end to end: build an image, boot it under QEMU, serve, stop.

The conformance suite runs against the booted image too (loop id
``unikernel``); this file covers what is particular to it: the boot command's
life cycle, the image's size, the real site from the image in every encoding,
and failures that must read as one line with the serial log shown.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import brotli
import pytest
import zstandard
from conftest import DEMO, ROOT, orisha
from httpraw import Conn
from test_early_400 import CLIENT_HELLO
from unikernel_target import Booted

from orisha.server import load_site

REAL = "/usr/share/doc/postgresql-doc-15/html"
DECODE = {b"identity": lambda b: b, b"gzip": gzip.decompress, b"br": brotli.decompress,
          b"zstd": lambda b: zstandard.ZstdDecompressor().decompressobj().decompress(b)}

pytestmark = pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                                reason="apt-get install qemu-system-x86")


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("uk") / "demo")
    r = orisha("build", DEMO, "-o", out, "--loop", "unikernel", "--not-found", "404.html")
    assert r.returncode == 0, r.stderr
    return out


def test_boot_serve_and_stop(image):
    started = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "orisha.cli", "boot", image, "--port", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=ROOT)
    try:
        line = p.stdout.readline()
        m = re.fullmatch(r"orisha: serving http://127\.0\.0\.1:(\d+)/ \(loop unikernel, 1 worker, "
                         r"pid (\d+)\): 14 files, .*\n", line)
        assert m, (line, p.stderr.read() if p.poll() is not None else "")
        assert int(m.group(2)) == p.pid
        assert time.monotonic() - started < 30
        c = Conn(int(m.group(1)))
        r = c.request("/")
        assert r.status == 200 and r.body == open(os.path.join(DEMO, "index.html"), "rb").read()
        c.close()
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=20)
        assert p.returncode == 0, err
        assert "orisha: serving http on port 80" in err  # the serial log streams to stderr
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_image_size_excluding_site_bytes(image):
    m = json.load(open(os.path.join(image, "manifest.json")))
    assert m["generator"] == "orisha" and m["loop"] == "unikernel" and m["image"] == "orisha.img"
    size = os.path.getsize(os.path.join(image, "orisha.img"))
    assert m["image_bytes"] == size
    assert m["kernel_bytes"] == size - m["site_image_bytes"]
    print(f"\nimage {size:,} bytes = kernel {m['kernel_bytes']:,} + site image {m['site_image_bytes']:,}")
    assert m["kernel_bytes"] < 256 * 1024


def test_serve_on_an_image_boots_it(image):
    p = subprocess.Popen([sys.executable, "-m", "orisha.cli", "serve", image, "--port", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = p.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/ \(loop unikernel,", line)
        assert m, line
        assert Conn(int(m.group(1))).request("/css/site.css").status == 200
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=20)
        assert p.returncode == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _corrupt_copy(image: str, tmp_path) -> str:
    bad = str(tmp_path / "bad")
    shutil.copytree(image, bad)
    kernel = open(os.path.join(bad, "orisha.img"), "rb").read()
    site = open(os.path.join(bad, "site.img"), "rb").read()
    at = kernel.find(site[:64])
    assert at > 0
    with open(os.path.join(bad, "orisha.img"), "r+b") as f:
        f.seek(at)
        f.write(b"XXXX")  # the site image's magic
    return bad


def test_failed_boot_shows_the_serial_log_and_one_line(image, tmp_path):
    bad = _corrupt_copy(image, tmp_path)
    r = orisha("boot", bad, "--port", "0", timeout=60)
    assert r.returncode == 1 and r.stdout == ""
    assert "PANIC at src/core.c" in r.stderr and "bad magic" in r.stderr  # the serial log
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("orisha: error: the kernel stopped during boot: PANIC at src/core.c") and "bad magic" in last
    assert "Traceback" not in r.stderr


def test_not_an_image_is_a_one_line_error(image, tmp_path):
    bad = str(tmp_path / "junk")
    shutil.copytree(image, bad)
    open(os.path.join(bad, "orisha.img"), "wb").write(b"not an elf")
    r = orisha("boot", bad, "--port", "0", timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"orisha: error: {os.path.join(bad, 'orisha.img')}: not a 32-bit ELF kernel image (rebuild it)"]
    r = orisha("boot", DEMO, "--port", "0")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(not os.path.isdir(REAL), reason="apt-get install postgresql-doc-15 (.ci/run does)")
def test_real_site_from_the_image_byte_identical_in_every_encoding(tmp_path):
    from test_real_site import check_every_file
    out = str(tmp_path / "pg")
    r = orisha("build", REAL, "-o", out, "--loop", "unikernel")
    assert r.returncode == 0, r.stderr
    site = load_site(out)  # the same build's Python module: the expected responses
    image_mib = os.path.getsize(os.path.join(out, "orisha.img")) / (1 << 20)
    # the memory goal: the whole real site with at most its image size + 16 MiB of RAM
    s = Booted(out, ["--memory", str(int(image_mib + 16))])
    try:
        check_every_file(s.port, site)
    finally:
        assert s.stop() == 0


# -- the C core against its specification, the Python core -----------------------

def test_the_c_sources_retype_no_policy(tmp_path):
    """Methods, fields, codings, token characters and limits reach C only through the
    generated policy.h (orisha/targets/unikernel/policy_header.py)."""
    from orisha.core.negotiate import CODING_TOKENS
    from orisha.core.policy import KNOWN_METHODS, LIMITS
    from orisha.core.request import LIST_FIELDS, SINGLE_FIELDS
    from orisha.targets.unikernel import policy_header
    src_dir = os.path.join(ROOT, "unikernel", "src")
    src = "".join(open(os.path.join(src_dir, n)).read() for n in sorted(os.listdir(src_dir))
                  if n.endswith((".c", ".h")))
    for word in (*KNOWN_METHODS, *SINGLE_FIELDS, *LIST_FIELDS, *CODING_TOKENS):
        assert f'"{word.decode()}"' not in src, word
    for limit in LIMITS:
        assert f'"{limit.attr}"' not in src, limit.attr
    assert "!#$%&'*+-.^_`|~" not in src
    header = open(policy_header.write(str(tmp_path))).read()
    assert "DO NOT EDIT" in header and '"if-none-match"' in header and "X(head_timeout, 10000ull, 1000)" in header



def _heads(site, n: int, seed: int = 9112) -> list[bytes]:
    """Request streams mixing every feature and malformation the cores interpret."""
    import random
    from orisha.core.dates import format_http_date
    rnd = random.Random(seed)
    css = site.routes[b"/css/site.css"]
    big = site.routes[b"/files/big.txt"]
    tags = [v.etag.decode() for e in (css, big) for v in e.variants]
    lm = css.last_modified
    dates = [format_http_date(lm).decode(), format_http_date(lm - 1).decode(),
             time.strftime("%A, %d-%b-%y %H:%M:%S GMT", time.gmtime(lm)),
             time.strftime("%a %b %e %H:%M:%S %Y", time.gmtime(lm)),
             "Thu, 01 Jan 1970 00:00:00 GMT", "yesterday", "Sun, 06 Nov 99999 08:49:37 GMT",
             "Sunday, 06-Nov-94 08:49:61 GMT", "Sun Nov  6 08:49:37 -1994",
             "Sun, 06 Nov +994 08:49:37 GMT", "Sun, 06 Nov 1_94 08:49:37 GMT",
             "Sun Nov  6 08:49:37 " + "9" * 40, "Sun Nov 06 08:49:37 " + "9" * 5000]
    methods = ["GET"] * 6 + ["HEAD"] * 2 + ["POST", "OPTIONS", "get", "BREW", "G(T", "CONNECT",
                                            "G\x00T", ""]
    targets = ["/", "/css/site.css", "/files/big.txt", "/img/pixel.png", "/docs", "/docs?a=1&b",
               "/docs/", "/docs/guide/getting-started", "/%2e%2e/css/site.css", "//css//site.css",
               "/files/caf%C3%A9%20men%C3%BC.txt", "/a/../docs/./", "/docs/..", "/%zz", "/a%00",
               "/%41%", "http://x.org/css/site.css?q", "HTTPS://h", "http://h?x", "*", "x.org:80",
               "/nope", "/css/site.css#f?x", "/files/empty.txt", "/index", "/docs/guide/"]
    versions = ["HTTP/1.1"] * 8 + ["HTTP/1.0", "HTTP/1.7", "HTTP/2.0", "HTTP/1", "http/1.1"]
    fields = [
        lambda: "Accept-Encoding: " + rnd.choice([
            "gzip", "br", "zstd", "gzip, br, zstd", "identity;q=0", "*;q=0", "*", "x-gzip",
            "gzip;q=0.5, br;q=1.0000000000000001", "br;q=1.5", "gzip;q=-0", "zstd;q=1e-400",
            "gzip;q=bogus", "gzip;q=0;q=1", "", " , br", "GZIP;Q=0.001", "*;q=0, identity",
            "br;q=1_0", "gzip;q=.5", "identity;q=0, deflate", "zstd;q=1e0", "gzip;level=9",
            # RFC 9110 §12.4.2 qvalues: at most three decimals, nothing above 1, no spaces
            "gzip;q=0.001", "br;q=1.000", "zstd;q=1.0001", "gzip;q=0.5000", "br;q=1.",
            "gzip;q=.5, br", "zstd;q= 0.5", "gzip;Q=0.5", "br;q =0.5", "gzip;q=0.5 , br;q=0",
            "zstd;q=nan", "gzip;q=inf", "*;q=0.000, br;q=0.001", "identity;q=0.", "gzip;q",
            "br;q=0.0001", "gzip; q=1.0\t", "zstd;q=+0.5"]),
        lambda: "If-None-Match: " + rnd.choice(tags + ["*", f"W/{rnd.choice(tags)}", '"nope"',
                                                         f'"x", {rnd.choice(tags)}', ""]),
        lambda: "If-Modified-Since: " + rnd.choice(dates),
        lambda: "Range: " + rnd.choice(["bytes=0-99", "bytes=-5", "bytes=5-", "bytes=1-0",
                                         "bytes=99999999999999999999-1", "bytes=0-1,5-6",
                                         "bytes = 3 - 4", "bytes=-0", "bytes=99999999-", "items=0-1",
                                         "bytes=00000000000000000000000000001-2", "bytes=3 -4",
                                         "bytes= 3-4", "bytes=+3-4", "bytes=3_0-40", "bytes=" + "9" * 5000 + "-",
                                         "bytes=0-" + "9" * 40, "bytes=-" + "9" * 40, "bytes=-\xd9\xa3",
                                         "bytes=" + "9" * 30 + "-" + "9" * 29 + "8", "bytes=0-4-5"]),
        lambda: "If-Range: " + rnd.choice(tags + dates[:2]),
        lambda: "Connection: " + rnd.choice(["close", "keep-alive", "Keep-Alive, x", "upgrade"]),
        lambda: "Content-Length: " + rnd.choice(["0", "3", "abc", "99999999", "", "0003", "+3", "-3",
                                                  "3_0", "3 3", " 3 ", "\xd9\xa3", "9" * 40,
                                                  "000000000000000000003", "1048577"]),
        lambda: "Transfer-Encoding: " + rnd.choice(["chunked", "gzip, chunked", "gzip", "chunked, x"]),
        lambda: rnd.choice(["X: a\x01b", "X : y", " folded", "Host: y", "NoColon", "X: a\rb",
                            "X-Fine: \tvalue\t ", "X: \x80\xff"]),
    ]
    # bytes that cannot begin a request line: answered 400 at once (no line end needed)
    junk = [CLIENT_HELLO, b"\x00GET / HTTP/1.1", b"\x16\x03\x01\x02\x00\x01", b" GET / HTTP/1.1",
            b"\r\n\x80", b"GE(T / HTTP/1.1\r\nHost: x", b"\x00"]
    out = []
    for _ in range(n):
        data = rnd.choice(junk) if rnd.random() < 0.04 else b""
        for _ in range(rnd.choice([1, 1, 1, 2, 3])):
            end = "\r\n" if rnd.random() < 0.9 else "\n"
            lines = [f"{rnd.choice(methods)} {rnd.choice(targets)} {rnd.choice(versions)}"]
            if rnd.random() < 0.93:
                lines.append("Host: x")
            lines += [rnd.choice(fields)() for _ in range(rnd.randint(0, 5))]
            rest = lines[1:]
            rnd.shuffle(rest)
            lines[1:] = rest
            data += (end.join(lines) + end + end).encode("latin-1")
            if rnd.random() < 0.1:
                data += b"abc"
        if rnd.random() < 0.04:
            data += rnd.choice(junk)
        out.append(data)
    return out


def test_the_c_core_answers_like_the_python_core(image):
    """The same build served by the Python core (epoll) and booted: the same bytes but Date."""
    from conftest import Server
    from httpraw import exchange
    from unikernel_target import Booted
    site = load_site(image)
    py = Server(image, "--loop", "epoll", "--workers", "1")
    uk = Booted(image, [])
    date = re.compile(rb"Date: [^\r\n]*\r\n")
    try:
        for i, data in enumerate(_heads(site, 800)):
            want = date.sub(b"", exchange(py.port, data))
            got = date.sub(b"", exchange(uk.port, data))
            assert got == want, (i, data, want[:600], got[:600])
    finally:
        py.stop()
        assert uk.stop() == 0
