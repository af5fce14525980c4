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
import socket
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

from orisha.serving.server import load_site

REAL = "/usr/share/doc/postgresql-doc-15/html"
DECODE = {b"identity": lambda b: b, b"gzip": gzip.decompress, b"br": brotli.decompress,
          b"zstd": lambda b: zstandard.ZstdDecompressor().decompressobj().decompress(b)}

pytestmark = pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                                reason="apt-get install qemu-system-x86")


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


def test_loop_unikernel_is_another_name_for_the_target(image, tmp_path):
    """``orisha build --target unikernel`` makes the image (the ``image`` fixture's build);
    ``--loop unikernel``, its older name, makes the same and says so once on stderr. A loop
    body with the image, or the image with the container, is a usage error."""
    out = str(tmp_path / "o")
    r = orisha("build", DEMO, "-o", out, "--loop", "unikernel", "--not-found", "404.html")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("orisha: --loop unikernel is --target unikernel\n") == 1, r.stderr
    built = json.load(open(os.path.join(out, "manifest.json")))
    assert built["loop"] == "unikernel" and built["image"] == "orisha.img"
    assert os.path.getsize(os.path.join(out, "orisha.img")) == built["image_bytes"]
    for opts in (["--target", "unikernel", "--loop", "epoll"],
                 ["--target", "container", "--loop", "unikernel"]):
        r = orisha("build", DEMO, "-o", str(tmp_path / "x"), *opts)
        assert r.returncode == 2 and "Error: --loop " in r.stderr and "Traceback" not in r.stderr, \
            r.stderr
        assert not (tmp_path / "x").exists()


def test_image_size_excluding_site_bytes(image):
    m = json.load(open(os.path.join(image, "manifest.json")))
    assert m["generator"] == "orisha" and m["loop"] == "unikernel" and m["image"] == "orisha.img"
    size = os.path.getsize(os.path.join(image, "orisha.img"))
    assert m["image_bytes"] == size
    assert m["kernel_bytes"] == size - m["site_image_bytes"]
    print(f"\nimage {size:,} bytes = kernel {m['kernel_bytes']:,} + site image {m['site_image_bytes']:,}")
    assert m["kernel_bytes"] < 256 * 1024


def test_serve_on_an_image_boots_it(image):
    """``orisha serve`` of an image boots it, and a SIGINT stops it cleanly (exit 0). The
    stop is bounded by boot.py: the grace for the guest to drain, ``EXIT_TIMEOUT`` for
    QEMU to leave, two reader threads joined for 2 s each; waited that long and 10 s more
    (proof22 once saw the stop take over 20 s, the old wait, beside the slow half)."""
    from orisha.core.policy import Limits
    from orisha.targets.unikernel.boot import EXIT_TIMEOUT
    p = subprocess.Popen([sys.executable, "-m", "orisha.cli", "serve", image, "--port", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = p.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/ \(loop unikernel,", line)
        assert m, line
        assert Conn(int(m.group(1))).request("/css/site.css").status == 200
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=Limits().grace + EXIT_TIMEOUT + 2 * 2 + 10)
        assert p.returncode == 0, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_guest_that_never_answers_is_stopped_within_the_bounds(image):
    """A guest that hears nothing (its QEMU stopped with SIGSTOP: no vCPU runs, no
    console is read) cannot keep ``orisha boot`` from stopping: after SIGINT it says
    the kernel has not answered ``stop``, waits out ``--grace``, then QEMU's
    ``EXIT_TIMEOUT``, kills QEMU, says so, and exits 0 with no QEMU left behind."""
    from orisha.targets.unikernel.boot import EXIT_TIMEOUT, STOP_ANSWER
    grace = STOP_ANSWER + 1
    p = subprocess.Popen([sys.executable, "-m", "orisha.cli", "boot", image, "--port", "0",
                          "--grace", str(grace)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    qemu = None
    try:
        line = p.stdout.readline()
        assert "(loop unikernel," in line, line
        kids = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True)
        qemu, = (int(k) for k in kids.stdout.split())
        os.kill(qemu, signal.SIGSTOP)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=grace + EXIT_TIMEOUT + 2 * 2 + 10)
        assert p.returncode == 0, err
        assert f"orisha: the kernel has not answered 'stop' within {STOP_ANSWER:.0f} s\n" in err
        assert f"orisha: QEMU did not exit within {EXIT_TIMEOUT:.0f} s of 'exit': killed\n" in err
        assert not os.path.exists(f"/proc/{qemu}"), "QEMU outlived orisha boot"
    finally:
        if qemu and os.path.exists(f"/proc/{qemu}"):
            os.kill(qemu, signal.SIGKILL)
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
    r = orisha("build", REAL, "-o", out, "--target", "unikernel")
    assert r.returncode == 0, r.stderr
    site = load_site(out)  # the same build's Python module: the expected responses
    image = os.path.join(out, "orisha.img")
    image_mib = os.path.getsize(image) / (1 << 20)
    # the memory goal: the whole real site with at most its image size + 16 MiB of RAM
    # on one core; each core beyond it adds what `orisha boot --cpus` adds (its own state
    # and table: boot.guest_megabytes), as under ORISHA_TEST_CPUS=2.
    from orisha.targets.unikernel.boot import guest_megabytes
    cpus = int(os.environ.get("ORISHA_TEST_CPUS") or 1)
    more = guest_megabytes(image, cpus=cpus) - guest_megabytes(image)
    s = Booted(out, ["--memory", str(int(image_mib + 16) + more)])
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
    # several ranges and rules: the framing comes in the image, the bounds in the header
    from orisha.core import ranges
    from orisha.core.matcher import LOCATION_SAFE
    code = re.sub(r"/\*.*?\*/|//[^\n]*", "", src, flags=re.S)  # comments may name them
    assert "multipart/byteranges" not in code and "boundary=" not in code
    assert LOCATION_SAFE.decode()[-18:] not in code
    header = open(policy_header.write(str(tmp_path))).read()
    assert "DO NOT EDIT" in header and '"if-none-match"' in header and "X(head_timeout, 10000ull, 1000)" in header
    for name, value in (("GAP", ranges.GAP), ("PARTS_MAX", ranges.MAX_PARTS),
                        ("BYTES_MAX", ranges.MAX_BYTES), ("DIGITS", ranges.DIGITS),
                        ("BIG", ranges.BIG)):
        assert re.search(rf"#define POLICY_RANGE_{name} {value}(ull)?\n", header), name



# Elements of a Range list: every branch of ranges.range_set (dropped, invalid, saturated).
_ODD_SPECS = ["", " ", "-", "1-2-3", "x", "0x1-2", "+1-2", "1 -2", "1- 2", "9" * 19 + "-",
              "0" * 30 + "5-6", "-" + "9" * 25, "1-" + "9" * 19, "9" * 18 + "-",
              "9" * 20 + "-" + "9" * 20, "9" * 19 + "-" + "9" * 18, "\t3-4\t", "\xd9\xa3-4", "-0",
              "0-", "1200037-", "1200038-", "-1200039", "1023-1023", "1024-2000"]


def _range_spec(rnd) -> str:
    scale = rnd.choice([10, 120, 1100, 1_200_038])
    k = rnd.random()
    a = rnd.randint(0, scale)
    if k < 0.35:  # gaps around ranges.GAP decide what merges
        return f"{a}-{a + rnd.choice([0, 1, 2, 79, 80, 81, 82, rnd.randint(0, scale)])}"
    if k < 0.45:
        return f"{a}-"
    if k < 0.6:
        return f"-{rnd.choice([0, 1, 5, a])}"
    if k < 0.75:
        return f"{a}-{rnd.randint(0, scale)}"  # last < first makes the header invalid
    return rnd.choice(_ODD_SPECS)


def _range_list(rnd) -> str:
    """A Range value with a comma (ranges.range_set): overlapping, adjacent and distant
    ranges, suffixes and prefixes, more than MAX_PARTS parts, OWS and empty elements."""
    fixed = ["bytes=0-,0-", "bytes=0-1,5-6", "bytes=,0-1", "bytes=0-1,", "bytes=-1,0-0",
             "bytes=0-524287,600000-1124287", "bytes=0-524288,600000-1124287",
             "bytes=" + ",".join(f"{i * 100}-{i * 100}" for i in range(16)),
             "bytes=" + ",".join(f"{i * 100}-{i * 100}" for i in range(17)),
             "bytes=" + ",".join(f"{i * 82}-{i * 82}" for i in range(40)),
             "bytes=" + ",".join("0-0" for _ in range(1900))]
    if rnd.random() < 0.15:
        return rnd.choice(fixed)
    seps = [",", ",", ", ", " ,", ",\t", ",,", " , "]
    count = rnd.choice([2, 2, 3, 4, 16, 17, rnd.randint(2, 40)])
    value = _range_spec(rnd) + "".join(rnd.choice(seps) + _range_spec(rnd) for _ in range(count - 1))
    unit = rnd.choice(["bytes="] * 8 + ["Bytes=", "BYTES=", "bytes= ", "bytes=\t", "bytes =",
                                        "items=", "bytes"])
    return unit + value


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
        lambda: "Range: " + (_range_list(rnd) if rnd.random() < 0.5 else rnd.choice([
            "bytes=0-99", "bytes=-5", "bytes=5-", "bytes=1-0", "bytes=99999999999999999999-1",
            "bytes=0-1,5-6", "bytes = 3 - 4", "bytes=-0", "bytes=99999999-", "items=0-1",
            "bytes=00000000000000000000000000001-2", "bytes=3 -4", "bytes= 3-4", "bytes=+3-4",
            "bytes=3_0-40", "bytes=" + "9" * 5000 + "-", "bytes=0-" + "9" * 40,
            "bytes=-" + "9" * 40, "bytes=-\xd9\xa3", "bytes=" + "9" * 30 + "-" + "9" * 29 + "8",
            "bytes=0-4-5", "Bytes=0-1", "bytes=0-1 "])),
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


@pytest.fixture(scope="module")
def cores(image):
    """The demo build served by the Python core (epoll) and booted."""
    yield from _both(image)


def _both(out: str):
    from conftest import Server
    py = Server(out, "--loop", "epoll", "--workers", "1")
    try:
        uk = Booted(out, [])
    except BaseException:
        py.stop()
        raise
    try:
        yield py, uk
    finally:
        py.stop()
        assert uk.stop() == 0


def _compare(cores, streams: list[bytes]) -> None:
    """The same bytes from both cores for every stream, but the Date line."""
    from httpraw import exchange
    py, uk = cores
    date = re.compile(rb"Date: [^\r\n]*\r\n")
    for i, data in enumerate(streams):
        want = date.sub(b"", exchange(py.port, data))
        got = date.sub(b"", exchange(uk.port, data))
        assert got == want, (i, data[:600], want[:600], got[:600])


def test_a_client_port_reused_after_the_kernel_closed_first_is_answered(cores):
    """QEMU forwards every connection from 10.0.2.2 and the client's own port, and the host
    reuses a port as soon as its side is closed. When the kernel closed first its side is in
    TIME_WAIT; a new SYN there must start a new connection (net.c, net_ip4_input), not wait
    up to two minutes for a handshake (the rare 10 s time-outs of the differential tests)."""
    _, uk = cores
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        client_port = probe.getsockname()[1]
    for i in range(4):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.settimeout(10)
        try:
            s.bind(("127.0.0.1", client_port))
            s.connect(("127.0.0.1", uk.port))
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            out = b""
            while chunk := s.recv(1 << 16):  # the kernel closes first: its side lingers
                out += chunk
        finally:
            s.close()
        assert out.startswith(b"HTTP/1.1 200 OK\r\n"), (i, out[:100])
        time.sleep(0.2)  # the host's side of the forward is closed too


def test_the_c_core_answers_like_the_python_core(image, cores):
    """The same build served by the Python core (epoll) and booted: the same bytes but Date."""
    _compare(cores, _heads(load_site(image), 800))


def test_the_c_core_answers_several_ranges_like_the_python_core(image, cores):
    """Range lists (ranges.range_set, the multipart 206) on documents of every size."""
    import random
    rnd = random.Random(14)
    targets = ["/files/big.txt"] * 3 + ["/css/site.css", "/", "/img/pixel.png", "/files/empty.txt",
                                        "/nope", "/files/caf%C3%A9%20men%C3%BC.txt"]
    streams = []
    for _ in range(300):
        data = b""
        for _ in range(rnd.choice([1, 1, 2, 3])):
            method = rnd.choice(["GET"] * 5 + ["HEAD"])
            data += (f"{method} {rnd.choice(targets)} HTTP/1.1\r\nHost: x\r\n"
                     f"Range: {_range_list(rnd)}\r\n\r\n").encode("latin-1")
        streams.append(data)
    _compare(cores, streams)


# -- the C matcher against the Python one: sites/rules, and rules that stress it ----------

# Rules before the site's own (--redirect comes first), each under its own prefix: two
# placeholders in a segment, a splat inside the path, a placeholder before text or a
# splat, a capture used thrice, query captures into a rewrite's path and a redirect's
# query, rewrites to a redirect and to a Rules route, a 404 rule's destinations, forced
# query rules on files (Rules routes with placeholders), non-ASCII and escaped literals.
STRESS_RULES = [
    "/two/:a-:b /blog/:b/:a 302", "/mid/*/end /x/:splat 301", "/ext/:name.html /posts/:name.html 200",
    "/q/:x k=:v /posts/:v.html 200", "/qq k=:v t=lit /about?v=:v&x=:k 307",
    "/to-dir/* /docs 200", "/to-store/* /store 200", "/rep/:a /x/:a/:a/:a 301",
    "/gone2/* /en/:splat 404", "/adj/:a* /blog/:a/:splat 301", "/blog/* v=:v /about?ver=:v 302!",
    "/café/* /blog/:splat 301", "/pct/* /posts/%34%32.html 200", "/back/* /:splat/../about.html 200",
]


@pytest.fixture(scope="module")
def rules_cores(tmp_path_factory):
    from test_rules import RULES
    out = str(tmp_path_factory.mktemp("uk") / "rules")
    opts = [a for rule in STRESS_RULES for a in ("--redirect", rule)]
    r = orisha("build", RULES, "-o", out, "--target", "unikernel", *opts)
    assert r.returncode == 0, r.stderr
    yield from _both(out)


# Paths that reach each rule's edges; the generator also composes random ones.
_RULE_PATHS = [
    "/two/a-b", "/two/a-b-c", "/two/-", "/two/a--b", "/two/-a", "/mid/x/end", "/mid/end",
    "/mid//end", "/mid/a/b/end", "/mid/end/end", "/ext/42.html", "/ext/7.html", "/ext/.html",
    "/ext/x.html.html", "/ext/42.html/", "/q/x?k=42", "/q/x?k=7", "/q/?k=42", "/q/x?k=..%2F42",
    "/q/x?k=%34%32", "/q/x?k=4?2", "/q/x?k=42&k=7", "/qq?k=1&t=lit", "/qq?t=lit&k=a%20b",
    "/qq?k=&t=lit", "/qq?k=x&t=lit&k=y", "/qq?t=lit", "/qq?k=1&t=li", "/qq?k=1&t=lit#f",
    "/rep/abc", "/rep/a%20b", "/rep/caf%C3%A9", "/rep/a%2Fb", "/rep/%25", "/gone2/404.html",
    "/gone2/x", "/gone2/", "/adj/abc", "/adj/a/b", "/adj/", "/adj/a", "/blog/hello.html?v=2",
    "/blog/?v=", "/blog/index.html?v=%2F", "/blog/hello?v=1", "/blog/hello.html?x=1",
    "/pct/x", "/pct/", "/back/x", "/back/a/b", "/back/", "/to-dir/x?y=1", "/to-dir/x",
    "/to-store/?id=42", "/to-store/x", "/store?id=42&x", "/store?id=", "/store?id", "/store?",
    "/news/a%3Fb", "/news/a?b", "/news/%E2%82%AC", "/news/", "/news", "/posts/42/edit",
    "/posts/7/edit?x", "/posts/x/edit", "/posts//edit", "/caf%C3%A9/x", "/café/x?q",
    "/en/", "/en/x/y", "/search?q=orisha&q=x", "/search?x&q=orisha", "/app/", "/app",
]


def _rule_paths(rnd) -> str:
    if rnd.random() < 0.5:
        return rnd.choice(_RULE_PATHS)
    prefixes = ["/news/", "/store", "/search", "/posts/", "/app/", "/en/", "/two/", "/mid/",
                "/ext/", "/q/", "/qq", "/to-dir/", "/to-store/", "/rep/", "/gone2/", "/adj/",
                "/blog/", "/caf%C3%A9/", "/café/", "/pct/", "/back/", "/", "/home", "/docs",
                "/about", "/assets/", "/kept.html", "/forced.html", "/pretty", "/gone",
                "/query-kept"]
    segments = ["x", "hello", "hello.html", "42", "7", "42.html", "a-b", "a-b-c", "-", "a--b",
                "caf%C3%A9", "%20", "%3F", "%2F", "a%25b", "..", ".", "", "end", "end", "404.html",
                "x.html", "%zz", "%00", "a:b@c", "~u", "%22q%22", "%E2%82%AC", "app.css",
                "index.html", "edit"]
    queries = ["id=42", "id=", "id", "a=b&id=7", "id=1&id=2", "q=orisha", "q=other", "k=v%2F",
               "k=a?b", "k=..%2F", "v=1", "t=lit&k=z", "k=x&t=lit", "k=%E2%82%AC&t=lit", "",
               "&&k=1", "k=42", "k=7", "v=", "=x&k=7", "t=li&k=1"]
    prefix = rnd.choice(prefixes)
    segs = "/".join(rnd.choice(segments) for _ in range(rnd.choice([0, 1, 1, 2, 3])))
    path = prefix + ("/" if segs and not prefix.endswith("/") and rnd.random() < 0.8 else "") + segs
    if rnd.random() < 0.6:
        path += "?" + "&".join(rnd.choice(queries) for _ in range(rnd.choice([1, 1, 2])))
    return path


def test_the_c_matcher_answers_like_the_python_one(rules_cores):
    """Generated paths and queries against every rule form: the same bytes but Date."""
    import random
    rnd = random.Random(13)
    fields = ["Accept-Encoding: gzip", "Accept-Encoding: br, zstd", "Range: bytes=0-9",
              "Range: bytes=0-1,100-200", "If-None-Match: *", "Connection: close"]
    streams = []
    for _ in range(600):
        data = b""
        for _ in range(rnd.choice([1, 1, 2, 3])):
            lines = [f"{rnd.choice(['GET'] * 4 + ['HEAD'])} {_rule_paths(rnd)} HTTP/1.1", "Host: x"]
            lines += rnd.sample(fields, rnd.choice([0, 0, 1, 2]))
            data += ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8")
        streams.append(data)
    _compare(rules_cores, streams)
