"""Compression dictionaries (RFC 9842): builds announce them, later builds answer deltas.

A site is built twice into one folder (v1, then v2 with changed scripts and page);
the second build keeps dcz deltas from v1's bodies. Every answer is read off a real
socket: HTTP/1.1 (compiled and pure core), HTTP/2 over TLS, Varnish in front, and
headless Chromium over HTTPS on a named host across a SIGHUP reload. The figures of
docs/incoming-33.md come from ``test_npm_releases_cross_the_wire_as_small_deltas``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TEST_LIMITS, Server, orisha
from httpraw import Conn
from tlsutil import pki  # noqa: F401 - the session's test CA (a fixture)

MAGIC = b"\x5e\x2a\x4d\x18\x20\x00\x00\x00"


def _script(version: int, n: int = 600) -> bytes:
    """A JavaScript file of ~25 KB whose functions change a little from one version to the next."""
    lines = [f"function f{i}(a) {{ return a * {i} + {i * 7 + (version if i % 97 == 0 else 0)}; }}"
             for i in range(n)]
    return ("\n".join(lines) + f"\nwindow.version = {version};\n").encode()


def _page(version: int, app: str) -> bytes:
    body = "".join(f"<p>Paragraph {i} of the page, version {version if i % 40 == 0 else 1}.</p>\n"
                   for i in range(80))
    return (f"<!doctype html>\n<meta charset=utf-8>\n<title>v{version}</title>\n"
            f"<script src=/lib.js></script>\n<script src=/assets/{app}></script>\n{body}").encode()


APPS = {1: "app.1a2b3c4d.js", 2: "app.5e6f7a8b.js", 3: "app.9c0d1e2f.js"}


def make_site(folder, version: int) -> dict[str, bytes]:
    """Version ``version`` of the test site: a page, a fingerprinted app script, a plain
    library script and a stylesheet that never changes. Returns path → bytes."""
    files = {"index.html": _page(version, APPS[version]),
             f"assets/{APPS[version]}": _script(version) + b"document.title += ' ok';\n",
             "lib.js": _script(version + 10, 300),
             "style.css": b"".join(b"p.c%d { margin: %dpx }\n" % (i, i) for i in range(200))}
    shutil.rmtree(folder, ignore_errors=True)
    for rel, data in files.items():
        path = os.path.join(folder, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return files


def available(data: bytes) -> str:
    return ":" + base64.b64encode(hashlib.sha256(data).digest()).decode() + ":"


def undelta(body: bytes, dictionary: bytes) -> bytes:
    """Decode a dcz body (RFC 9842 §4): check its header, then zstd with the raw dictionary."""
    assert body[:8] == MAGIC and body[8:40] == hashlib.sha256(dictionary).digest()
    d = zstandard.ZstdCompressionDict(dictionary, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    return zstandard.ZstdDecompressor(dict_data=d).decompress(body[40:])


def decoded(r, dictionary: bytes | None = None) -> bytes:
    """A response's content, whatever its coding."""
    import brotli
    import gzip
    coding = r.h("content-encoding")
    if coding == "dcz":
        return undelta(r.body, dictionary)
    if coding == "zstd":
        return zstandard.ZstdDecompressor().decompressobj().decompress(r.body)
    if coding == "br":
        return brotli.decompress(r.body)
    if coding == "gzip":
        return gzip.decompress(r.body)
    assert coding is None, coding
    return r.body


def build(site, out, *opts) -> str:
    if "--dictionaries" not in opts and "--no-dictionaries" not in opts:
        opts = (*opts, "--dictionaries", "3")  # the default, said (conftest.BUILD_ARGS)
    r = orisha("build", str(site), "-o", str(out), *opts)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory):
    """(out, v1 files, v2 files): v2 built into the folder v1 was built in."""
    base = tmp_path_factory.mktemp("dict")
    out = base / "out"
    v1 = make_site(base / "site", 1)
    build(base / "site", out)
    v2 = make_site(base / "site", 2)
    summary = build(base / "site", out)
    assert "4 dictionaries, 3 dcz deltas" in summary, summary  # every file; deltas: not the css
    return str(out), v1, v2


def test_the_build_keeps_its_history_and_reports_it(two_builds):
    out, v1, v2 = two_builds
    with open(os.path.join(out, "manifest.json")) as f:
        m = json.load(f)
    builds = m["dictionaries"]["builds"]
    assert len(builds) == 2
    assert builds[0]["/assets/app.5e6f7a8b.js"] == [
        "/assets/app.*.js", hashlib.sha256(v2["assets/app.5e6f7a8b.js"]).hexdigest()]
    assert builds[1]["/lib.js"][1] == hashlib.sha256(v1["lib.js"]).hexdigest()
    assert builds[0]["/index.html"][0] == "/{index.html}?"
    kept = set(os.listdir(os.path.join(out, "dictionaries")))
    assert kept == {v[1] for b in builds for v in b.values()}
    assert m["bytes"]["dcz"] > 0 and m["dictionaries"]["history_bytes"] == sum(
        os.path.getsize(os.path.join(out, "dictionaries", k)) for k in kept)


@pytest.mark.parametrize("loop", ["epoll", "epoll-pure"])
def test_a_known_dictionary_gets_a_delta_over_http11(two_builds, loop):
    out, v1, v2 = two_builds
    s = Server(out, "--loop", loop, "--workers", "1", *TEST_LIMITS)
    try:
        c = Conn(s.port)
        for path, old, new in (("/assets/app.5e6f7a8b.js", v1["assets/app.1a2b3c4d.js"],
                                v2["assets/app.5e6f7a8b.js"]),
                               ("/lib.js", v1["lib.js"], v2["lib.js"]),
                               ("/", v1["index.html"], v2["index.html"])):
            ae = "gzip, deflate, br, zstd, dcz"
            r = c.request(path, headers={"Accept-Encoding": ae, "Available-Dictionary": available(old)})
            assert r.status == 200 and r.h("content-encoding") == "dcz", (path, r.headers)
            assert r.h("vary") == "Accept-Encoding, Available-Dictionary"
            assert r.h("use-as-dictionary")
            assert undelta(r.body, old) == new
            plain = c.request(path, headers={"Accept-Encoding": ae})
            assert plain.h("content-encoding") in ("br", "zstd") and len(r.body) < len(plain.body)
            assert plain.h("vary") == "Accept-Encoding, Available-Dictionary"
            assert r.h("etag") != plain.h("etag")
            # HEAD and a revalidation behave as for every other variant
            head = c.request(path, "HEAD", {"Accept-Encoding": ae, "Available-Dictionary": available(old)})
            assert head.h("content-encoding") == "dcz" and head.h("etag") == r.h("etag")
            assert int(head.h("content-length")) == len(r.body) and head.body == b""
            again = c.request(path, headers={"Accept-Encoding": ae, "Available-Dictionary": available(old),
                                             "If-None-Match": r.h("etag")})
            assert again.status == 304 and again.h("etag") == r.h("etag")
        # the fingerprinted app announces the pattern the next build's name matches
        r = c.request("/assets/app.5e6f7a8b.js", headers={"Accept-Encoding": "zstd"})
        assert r.h("use-as-dictionary") == 'match="/assets/app.*.js"'
        assert c.request("/lib.js").h("use-as-dictionary") == 'match="/lib.js"'
        # a file that never changed has no delta and no Vary on Available-Dictionary
        css = c.request("/style.css", headers={"Accept-Encoding": "zstd, dcz",
                                               "Available-Dictionary": available(v1["style.css"])})
        assert css.h("content-encoding") == "zstd" and css.h("vary") == "Accept-Encoding"
        c.close()
    finally:
        s.stop()


def test_wrong_stale_or_malformed_dictionaries_get_no_delta(two_builds):
    out, v1, v2 = two_builds
    old = v1["lib.js"]
    good = available(old)
    s = Server(out, "--workers", "1", *TEST_LIMITS)
    try:
        c = Conn(s.port)
        cases = {
            "another body's hash": {"Available-Dictionary": available(v2["lib.js"])},
            "a hash of no body": {"Available-Dictionary": available(b"nothing")},
            "no colons": {"Available-Dictionary": good.strip(":")},
            "not base64": {"Available-Dictionary": ":" + "!" * 43 + ":"},
            "truncated": {"Available-Dictionary": good[:-5] + ":"},
            "two values": {"Available-Dictionary": good + ", " + good},
            "dcz not accepted": {"Available-Dictionary": good, "Accept-Encoding": "br, zstd"},
            "dcz with q=0": {"Available-Dictionary": good, "Accept-Encoding": "zstd, dcz;q=0"},
            "only a star": {"Available-Dictionary": good, "Accept-Encoding": "*"},
            "a Dictionary-ID we never sent": {"Available-Dictionary": good, "Dictionary-ID": '"v1"'},
        }
        for name, extra in cases.items():
            headers = {"Accept-Encoding": "zstd, dcz", **extra}
            r = c.request("/lib.js", headers=headers)
            assert r.status == 200 and r.h("content-encoding") != "dcz", name
            assert decoded(r) == v2["lib.js"], name
        # a repeated Available-Dictionary line is invalid (a single field): no delta either
        c.send(b"GET /lib.js HTTP/1.1\r\nHost: t\r\nAccept-Encoding: dcz\r\nAvailable-Dictionary: "
               + good.encode() + b"\r\nAvailable-Dictionary: " + good.encode() + b"\r\n\r\n")
        assert c.read().h("content-encoding") != "dcz"
        # and a range is served from identity, as with every other coding
        r = c.request("/lib.js", headers={"Accept-Encoding": "dcz", "Available-Dictionary": good,
                                          "Range": "bytes=0-9"})
        assert r.status == 206 and r.body == v2["lib.js"][:10] and r.h("content-encoding") is None
        c.close()
    finally:
        s.stop()


def test_only_the_last_k_builds_give_deltas_and_a_damaged_history_gives_none(tmp_path):
    site, out = tmp_path / "site", tmp_path / "out"
    v1 = make_site(site, 1)
    build(site, out, "--dictionaries", "1")
    v2 = make_site(site, 2)
    build(site, out, "--dictionaries", "1")
    make_site(site, 3)
    # v2's lib.js edited in the history: its hash no longer matches, so no delta from it
    with open(os.path.join(out, "dictionaries", hashlib.sha256(v2["lib.js"]).hexdigest()), "ab") as f:
        f.write(b"// edited\n")
    summary = build(site, out, "--dictionaries", "1")
    assert "2 dcz deltas" in summary, summary  # page and app from v2; nothing from v1
    s = Server(str(out), "--workers", "1", *TEST_LIMITS)
    try:
        c = Conn(s.port)
        ae = {"Accept-Encoding": "zstd, dcz"}
        stale = c.request("/assets/app.9c0d1e2f.js",
                          headers={**ae, "Available-Dictionary": available(v1["assets/app.1a2b3c4d.js"])})
        assert stale.h("content-encoding") == "zstd"
        fresh = c.request("/assets/app.9c0d1e2f.js",
                          headers={**ae, "Available-Dictionary": available(v2["assets/app.5e6f7a8b.js"])})
        assert fresh.h("content-encoding") == "dcz"
        damaged = c.request("/lib.js", headers={**ae, "Available-Dictionary": available(v2["lib.js"])})
        assert damaged.h("content-encoding") == "zstd"
        c.close()
    finally:
        s.stop()
    for opt in ("0", "17"):  # --dictionaries is a count of builds, 1 to 16
        r = orisha("build", str(site), "-o", str(out), "--dictionaries", opt)
        assert r.returncode == 2 and "--dictionaries" in r.stderr


def test_headers_detach_or_override_the_announcement(tmp_path):
    """``_headers`` configures it per path: ``! Use-As-Dictionary`` detaches the build's, an
    author's value comes after it (the later key of a structured-field dictionary wins)."""
    site, out = tmp_path / "site", tmp_path / "out"
    make_site(site, 1)
    (site / "_headers").write_text("/lib.js\n  ! Use-As-Dictionary\n"
                                   "/style.css\n  Use-As-Dictionary: match=\"/style*.css\"\n")
    build(site, out)
    s = Server(str(out), "--workers", "1", *TEST_LIMITS)
    try:
        c = Conn(s.port)
        assert c.request("/lib.js").h("use-as-dictionary") is None
        assert c.request("/style.css").h("use-as-dictionary") == \
            'match="/style.css", match="/style*.css"'
        assert c.request("/").h("use-as-dictionary") == 'match="/{index.html}?"'
        c.close()
    finally:
        s.stop()


def test_no_dictionaries_announces_nothing_and_keeps_no_history(tmp_path):
    site, out = tmp_path / "site", tmp_path / "out"
    v1 = make_site(site, 1)
    build(site, out)
    make_site(site, 2)
    summary = build(site, out, "--no-dictionaries")
    assert "dcz deltas" not in summary
    assert not os.path.exists(out / "dictionaries")
    s = Server(str(out), "--workers", "1", *TEST_LIMITS)
    try:
        c = Conn(s.port)
        r = c.request("/lib.js", headers={"Accept-Encoding": "zstd, dcz",
                                          "Available-Dictionary": available(v1["lib.js"])})
        assert r.h("content-encoding") == "zstd" and r.h("use-as-dictionary") is None
        assert r.h("vary") == "Accept-Encoding"
        c.close()
    finally:
        s.stop()


_VALUES = st.one_of(st.binary(max_size=60), st.sampled_from([b"", b":AAAA:", b"::", b":=:"]))
_CODINGS = st.lists(st.sampled_from([b"dcz", b"DCZ", b"dcz;q=0", b"dcz;q=0.001", b"zstd", b"*",
                                     b"br;q=1", b"dcz;q=2", b" dcz ", b"identity"]), max_size=4)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.integers(0, 3), value=_VALUES, codings=_CODINGS, dict_id=st.booleans(),
       method=st.sampled_from([b"GET", b"HEAD"]))
def test_a_delta_exactly_when_the_rfc_says(delta_site, which, value, codings, dict_id, method):
    """Any Available-Dictionary, Accept-Encoding and Dictionary-ID: the answer is the delta
    exactly when the value is a known hash byte for byte, dcz is accepted and no id is
    named; otherwise the normal negotiation (never a crash, never a 5xx)."""
    from orisha.core.connection import answer
    from orisha.core.policy import Limits
    site = delta_site
    entry = site.routes[b"/lib.js"]
    known = sorted(entry.deltas)
    if which < len(known):
        value = known[which]  # a real hash, then the value drawn otherwise
    ae = b", ".join(codings)
    head = (b"%s /lib.js HTTP/1.1\r\nHost: t\r\nAccept-Encoding: %s\r\nAvailable-Dictionary: %s"
            % (method, ae, value) + (b"\r\nDictionary-ID: \"x\"" if dict_id else b""))
    plan = answer(site, site.routes, Limits(), head)
    if plan.status == 400:  # bytes no field value may hold (CR, LF, NUL…)
        assert any(c in value for c in b"\r\n\x00") or b"\x7f" in value or \
            any(c < 32 and c != 9 for c in value)
        return
    assert plan.status in (200, 406), plan.status
    want = value.strip(b" \t") in entry.deltas and not dict_id and _dcz_ok(codings)
    assert (b"Content-Encoding: dcz\r\n" in plan.head) == want, (value, ae, dict_id)


@pytest.fixture(scope="module")
def delta_site(two_builds):
    """The second build's ``Site``, loaded in this process (the core called directly)."""
    from orisha.serving.server import load_site
    return load_site(two_builds[0])


def _dcz_ok(codings: list[bytes]) -> bool:
    """Whether the drawn Accept-Encoding members accept dcz (the last dcz member decides):
    of the weights drawn, q=0 refuses and q=2 is no weight at all (the member is ignored)."""
    ok = False
    for c in codings:
        token, _, q = c.partition(b";")
        if token.strip().lower() == b"dcz" and q != b"q=2":
            ok = q != b"q=0"
    return ok


@pytest.fixture(scope="module")
def tls(two_builds, pki):  # noqa: F811
    """The second build served over TLS (HTTP/2 by ALPN, HTTP/3 on the same port)."""
    from tlsutil import serve
    s = serve(two_builds[0], "--workers", "1", "--tls-cert", pki.chain, "--tls-key", pki.key,
              *TEST_LIMITS)
    yield s
    s.stop()


def test_http2_answers_the_same_deltas(two_builds, tls, pki):  # noqa: F811
    from h2util import H2Client
    from tlsutil import client_context, tls_connect
    out, v1, v2 = two_builds
    c = H2Client(tls_connect(tls.port, client_context(pki, alpn=("h2",))))
    old = v1["assets/app.1a2b3c4d.js"]
    r, plain = c.fetch([("GET", "/assets/app.5e6f7a8b.js",
                         {"accept-encoding": "br, zstd, dcz", "available-dictionary": available(old)}),
                        ("GET", "/assets/app.5e6f7a8b.js", {"accept-encoding": "br, zstd, dcz",
                                                            "available-dictionary": ":AAAA:"})])
    c.close()
    assert r.status == 200 and r.h("content-encoding") == "dcz"
    assert r.h("vary") == "Accept-Encoding, Available-Dictionary"
    assert undelta(r.body, old) == v2["assets/app.5e6f7a8b.js"]
    assert plain.h("content-encoding") in ("br", "zstd")


def test_http3_answers_the_same_deltas(two_builds, tls, pki):  # noqa: F811
    """HTTP/3 reaches the core's one answer() too: the same delta, framed by QUIC."""
    from test_h3 import h3_get
    out, v1, v2 = two_builds
    old = v1["lib.js"]
    (status, fields, body, _), (_, plain, _, _) = h3_get(tls.port, pki.ca, [
        ("/lib.js", "GET", [("accept-encoding", "zstd, dcz"), ("available-dictionary", available(old))]),
        ("/lib.js", "GET", [("accept-encoding", "zstd, dcz")])])
    assert status == 200 and fields["content-encoding"] == "dcz"
    assert fields["vary"] == "Accept-Encoding, Available-Dictionary"
    assert undelta(body, old) == v2["lib.js"] and plain["content-encoding"] == "zstd"


@pytest.mark.slow
def test_the_container_executable_answers_the_deltas(tmp_path):
    """`--target container` built twice into one OUT: the static executable (what the
    FROM-scratch image runs) carries the deltas and answers them."""
    import re
    site, out = tmp_path / "site", tmp_path / "out"
    v1 = make_site(site, 1)
    build(site, out, "--target", "container")
    v2 = make_site(site, 2)
    assert "3 dcz deltas" in build(site, out, "--target", "container")
    proc = subprocess.Popen([str(out / "orisha"), "--host", "127.0.0.1", "--port", "0",
                             "--workers", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd="/")
    try:
        m = re.search(r"http://127\.0\.0\.1:(\d+)/", proc.stdout.readline())
        assert m, proc.stderr.read()
        c = Conn(int(m.group(1)))
        old = v1["assets/app.1a2b3c4d.js"]
        r = c.request("/assets/app.5e6f7a8b.js", headers={"Accept-Encoding": "br, zstd, dcz",
                                                          "Available-Dictionary": available(old)})
        assert r.h("content-encoding") == "dcz" and undelta(r.body, old) == v2["assets/app.5e6f7a8b.js"]
        c.close()
    finally:
        proc.terminate()
        proc.wait(20)


# -- real releases from the npm registry ----------------------------------------------------

RELEASES = ("react-dom", "18.2.0", "18.3.1")


def _npm_pack(name: str, version: str, folder) -> str:
    """The package's files from the npm registry (``npm pack``), unpacked into ``folder``."""
    if shutil.which("npm") is None:
        pytest.fail("npm is needed (apt-get install npm; ./dev test does)")
    r = subprocess.run(["npm", "pack", f"{name}@{version}", "--silent"], cwd=folder,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    dest = os.path.join(folder, version)
    os.makedirs(dest)
    subprocess.run(["tar", "xzf", r.stdout.strip().splitlines()[-1], "-C", dest,
                    "--strip-components", "1"], cwd=folder, check=True, timeout=120)
    return dest


@pytest.mark.slow
def test_npm_releases_cross_the_wire_as_small_deltas(tmp_path):
    """Two releases of react-dom: every bundle of its umd/ folder that changed (production
    and development builds) crosses the wire as dcz at no more than 15 % of its zstd
    variant's bytes, and decodes to the new release's file byte for byte."""
    name, old_v, new_v = RELEASES
    old, new = (_npm_pack(name, v, tmp_path) for v in (old_v, new_v))
    site, out = tmp_path / "site", tmp_path / "out"
    for src in (old, new):
        shutil.rmtree(site, ignore_errors=True)
        shutil.copytree(os.path.join(src, "umd"), site)
        build(site, out)
    s = Server(str(out), "--workers", "1", *TEST_LIMITS)
    figures = []
    try:
        c = Conn(s.port)
        for f in sorted(os.listdir(os.path.join(new, "umd"))):
            if not f.endswith(".js"):
                continue
            with open(os.path.join(old, "umd", f), "rb") as a, open(os.path.join(new, "umd", f), "rb") as b:
                before, after = a.read(), b.read()
            if before == after:
                continue
            z = c.request("/" + f, headers={"Accept-Encoding": "zstd"})
            d = c.request("/" + f, headers={"Accept-Encoding": "br, zstd, dcz",
                                            "Available-Dictionary": available(before)})
            assert z.h("content-encoding") == "zstd" and d.h("content-encoding") == "dcz", f
            assert undelta(d.body, before) == after, f
            ratio = len(d.body) / len(z.body)
            figures.append(f"{f}: {len(after):,} bytes, zstd {len(z.body):,}, dcz {len(d.body):,} "
                           f"({ratio:.1%} of zstd)")
            assert ratio <= 0.15, figures[-1]
        c.close()
    finally:
        s.stop()
    assert len(figures) >= 6 and any(f.startswith("react-dom.production.min.js") for f in figures)
    print(f"\n{name} {old_v} -> {new_v}:\n" + "\n".join(figures))


# -- a cache in front: Varnish ---------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_varnish_in_front_keeps_the_variants_apart(two_builds, tmp_path):
    """Varnish (Debian's, its built-in VCL; no jail: the test's files are private; its own
    gzip handling off, so Accept-Encoding reaches the origin) caches by Vary: a client without the dictionary never gets the
    delta a client with it got, and each gets its own variant back from the cache."""
    varnishd = shutil.which("varnishd") or "/usr/sbin/varnishd"
    assert os.path.exists(varnishd), "apt-get install varnish (./dev test does)"
    out, v1, v2 = two_builds
    s = Server(out, "--workers", "1", *TEST_LIMITS)
    port = _free_port()
    work = tmp_path / "varnish"
    vcl = tmp_path / "default.vcl"
    vcl.write_text(f'vcl 4.1;\nbackend origin {{ .host = "127.0.0.1"; .port = "{s.port}"; }}\n')
    proc = subprocess.Popen([varnishd, "-F", "-j", "none", "-f", str(vcl), "-a", f"127.0.0.1:{port}",
                             "-n", str(work), "-s", "malloc,32m", "-p", "http_gzip_support=off"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                c = Conn(port)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.2)
        old = v1["lib.js"]
        dict_ae = {"Accept-Encoding": "zstd, dcz", "Available-Dictionary": available(old)}
        plain_ae = {"Accept-Encoding": "zstd, dcz"}
        wrong = {"Accept-Encoding": "zstd, dcz", "Available-Dictionary": available(b"other")}
        got = []
        for headers in (dict_ae, plain_ae, wrong, dict_ae, plain_ae, wrong):
            r = c.request("/lib.js", headers=headers)
            assert r.status == 200
            got.append((r.h("content-encoding"), int(r.h("age") or 0) >= 0, r.h("x-varnish")))
            assert decoded(r, old) == v2["lib.js"]
        assert [g[0] for g in got] == ["dcz", "zstd", "zstd"] * 2
        # the second round came from the cache (X-Varnish names the request and the hit's)
        assert all(len(g[2].split()) == 2 for g in got[3:]), got
        c.close()
    finally:
        proc.terminate()
        proc.wait(20)
        s.stop()


# -- a real browser: Chromium over HTTPS on a named host, across a rebuild and a reload -------

HOST = "shop.orisha.test"
# Chromium uses dictionaries only over a certificate from a publicly trusted root (or on
# localhost) unless told otherwise: a middlebox with its own CA might mangle dcz. The test's
# CA is no such root, so the check is turned off (a real deployment needs nothing).
FEATURES = "--disable-features=CompressionDictionaryTransportRequireKnownRootCert"


def _leaf_for(pki, name: str, folder) -> tuple[str, str]:  # noqa: F811
    """A certificate for ``name`` from the session's test CA: (chain file, key file)."""
    folder = str(folder)
    with open(os.path.join(folder, "leaf.ext"), "w") as f:
        f.write(f"subjectAltName=DNS:{name}\nbasicConstraints=CA:FALSE\n"
                "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    run = lambda *a: subprocess.run(["openssl", *a], cwd=folder, check=True,  # noqa: E731
                                    capture_output=True, timeout=60)
    run("req", *ec, "-keyout", "key.pem", "-out", "leaf.csr", "-subj", f"/CN={name}")
    run("x509", "-req", "-in", "leaf.csr", "-CA", pki.ca, "-CAkey",
        os.path.join(pki.dir, "ca.key"), "-CAcreateserial", "-out", "leaf.pem", "-days", "2",
        "-extfile", "leaf.ext")
    with open(os.path.join(folder, "chain.pem"), "wb") as out:
        for n in (os.path.join(folder, "leaf.pem"), pki.ca):
            with open(n, "rb") as f:
                out.write(f.read())
    return os.path.join(folder, "chain.pem"), os.path.join(folder, "key.pem")


def _workers(pid: int) -> list[int]:
    """The server's child processes (its workers)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _title(port: int, pki) -> str:  # noqa: F811
    from tlsutil import client_context
    import ssl
    ctx = client_context(pki, alpn=("http/1.1",))
    ctx.check_hostname = False  # the name is the test's: the CA is what is checked
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname=HOST) as sock:
        sock.sendall(f"GET / HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ssl.SSLZeroReturnError:
                break
            if not chunk:
                break
            data += chunk
    return data.split(b"<title>", 1)[1].split(b"</title>", 1)[0].decode()


@pytest.mark.slow
def test_chromium_gets_a_delta_after_a_rebuild_and_a_reload(tmp_path, pki):  # noqa: F811
    """Chromium loads v1 over HTTPS on a named host; the site is rebuilt as v2 into the same
    folder and the server reloaded with SIGHUP; on its next visit Chromium sends
    Available-Dictionary for v1's app script, gets v2's as dcz, and the page runs it."""
    from browser import chromium, load_pages
    from tlsutil import serve, trusting_chromium
    assert chromium() is not None, "no Chromium (apt-get install chromium; ./dev test does)"
    site, out = tmp_path / "site", tmp_path / "out"
    v1 = make_site(site, 1)
    build(site, out)
    chain, key = _leaf_for(pki, HOST, tmp_path)
    s = serve(str(out), "--workers", "1", "--tls-cert", chain, "--tls-key", key, *TEST_LIMITS)
    wrapper = trusting_chromium(os.path.join(str(tmp_path), "leaf.pem"), tmp_path)
    with open(wrapper) as f:
        script = f.read()
    with open(wrapper, "w") as f:  # the named host resolves to the test's server
        f.write(script.replace(' "$@"', f' "--host-resolver-rules=MAP {HOST} 127.0.0.1" {FEATURES} "$@"'))

    def between(i: int) -> None:
        if i == 1:  # the second visit: version 2, built into the folder being served
            make_site(site, 2)
            assert "3 dcz deltas" in build(site, out)
            old = _workers(s.proc.pid)
            s.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 20
            while _title(s.port, pki) != "v2":
                assert time.monotonic() < deadline, "the reload did not serve v2"
                time.sleep(0.2)
            # The reload is over when the old generation has exited, not when a new connection
            # first gets v2: until then Chromium's open connection is the old worker's, which
            # rightly answers a request it takes before its GOAWAY reaches the browser with v1
            # (the loaded proof32). Bound: the stop grace and the kill after it.
            deadline = time.monotonic() + 8 + 2 + 5
            while set(_workers(s.proc.pid)) & set(old):
                assert time.monotonic() < deadline, "the old generation did not exit"
                time.sleep(0.1)

    url = f"https://{HOST}:{s.port}/"
    try:
        first, second = load_pages([url, url], timeout=20, executable=wrapper, before=between,
                                   evaluate="document.title")
    finally:
        s.stop()
    assert first.ok and second.ok, (first.problems, second.problems)
    assert first.value == "v1 ok" and second.value == "v2 ok"
    base = f"https://{HOST}:{s.port}"
    old_app = base + "/assets/" + APPS[1]
    new_app = base + "/assets/" + APPS[2]
    assert first.headers[old_app].get("use-as-dictionary") == 'match="/assets/app.*.js"'
    # dcz is answered only to the exact Available-Dictionary of v1's app with dcz accepted
    # (the tests above): the browser sent both. DevTools shows the fields it sent unless the
    # request was the preload a 103 Early Hints started (reported outside the page's session).
    assert second.headers[new_app].get("content-encoding") == "dcz", second.headers[new_app]
    sent = second.sent.get(new_app)
    if sent is not None:
        assert "dcz" in sent.get("accept-encoding", "")
        assert sent.get("available-dictionary") == available(v1["assets/" + APPS[1]])
    assert int(second.headers[new_app]["content-length"]) < 200  # v2's app in br: ~2,100 bytes
