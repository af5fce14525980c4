"""What the build knows about the site, served: issue 23.

- The SPA fallback answers navigations only: a missing asset (a path ending in an
  extension of a non-HTML type the site serves, or a request whose Sec-Fetch-Dest is not
  a document) gets the 404, on every target (``spa_port``: the demo built with
  ``--fallback 200.html``), the booted image's C core included; ``--fallback-all`` keeps
  the old behaviour.
"""

from __future__ import annotations

import re
import subprocess

import pytest
from conftest import DEMO, Server, demo_file, orisha
from httpraw import exchange
from tlsutil import _stop_servers, pki  # noqa: F401  (fixtures: servers stopped at the end when run alone)

from orisha.embed.assemble import BUILTIN_404


def curl(port: int, path: str, *args: str) -> tuple[int, str, bytes]:
    """(status, content type, body) of a GET by curl."""
    r = subprocess.run(["curl", "-sS", "--max-time", "10", "-o", "-", "-w",
                        "\n%{http_code} %{content_type}", *args, f"http://127.0.0.1:{port}{path}"],
                       capture_output=True, timeout=20)
    assert r.returncode == 0, r.stderr
    body, _, tail = r.stdout.rpartition(b"\n")
    status, _, ctype = tail.decode().partition(" ")
    return int(status), ctype, body


# -- the fallback only for navigations ------------------------------------------------

SHELL = demo_file("200.html")
# (path, request fields) → whether the SPA shell answers (else the built-in 404)
NAVIGATION_CASES = [
    ("/app/some/client/route", (), True),
    ("/app/route", ("Sec-Fetch-Dest: document",), True),
    ("/app/route", ("Sec-Fetch-Dest: iframe",), True),
    ("/users/john.doe", (), True),             # an extension the site does not serve
    ("/report.php", (), True),
    ("/js/app.deadbeef.js", (), False),        # a bundle gone after a deploy
    ("/JS/APP.DEADBEEF.JS", (), False),        # extensions compare without case
    ("/img/missing.png", ("Sec-Fetch-Dest: document",), False),
    ("/data/missing.json", (), False),
    ("/fonts/x.woff2", (), False),
    ("/missing.html", (), True),               # HTML is a page
    ("/app/route", ("Sec-Fetch-Dest: script",), False),
    ("/app/route", ("Sec-Fetch-Dest: empty",), False),   # fetch()
    ("/app/route", ("Sec-Fetch-Dest: image",), False),
    ("/app/route", ("Sec-Fetch-Dest: Document",), False),  # a token: case matters
    ("/app/route", ("Sec-Fetch-Dest: script", "Sec-Fetch-Dest: script"), True),  # repeated: absent
    ("/app/route", ("Sec-Fetch-Dest: ",), True),
    ("/dir.js/", (), True),                    # the last segment is empty
    ("/x/a%2Ejs", (), False),                  # decoded first: a.js
]


def test_the_fallback_answers_navigations_only(spa_port):
    for path, fields, shell in NAVIGATION_CASES:
        data = (f"GET {path} HTTP/1.1\r\nHost: x\r\n" + "".join(f + "\r\n" for f in fields)
                + "Connection: close\r\n\r\n").encode()
        out = exchange(spa_port, data)
        head, _, body = out.partition(b"\r\n\r\n")
        if shell:
            assert head.startswith(b"HTTP/1.1 200 OK\r\n") and body == SHELL, (path, fields, head)
        else:
            assert head.startswith(b"HTTP/1.1 404 Not Found\r\n") and body == BUILTIN_404, (
                path, fields, head)


def test_a_missing_bundle_is_a_404_for_curl_over_http1_and_h2(spa_port, loop):
    assert curl(spa_port, "/js/app.deadbeef.js")[:2] == (404, "text/html; charset=utf-8")
    assert curl(spa_port, "/app/x", "-H", "Sec-Fetch-Dest: script")[0] == 404
    status, ctype, body = curl(spa_port, "/app/x", "-H", "Sec-Fetch-Dest: document")
    assert (status, body) == (200, SHELL)
    assert curl(spa_port, "/js/app.3f2a1b9c.js", "-H", "Sec-Fetch-Dest: script")[0] == 200
    if not loop.startswith("unikernel"):  # h2c is the hosted server's (the image speaks h2 over TLS)
        assert curl(spa_port, "/js/x.js", "--http2-prior-knowledge")[0] == 404
        assert curl(spa_port, "/app/x", "--http2-prior-knowledge",
                    "-H", "Sec-Fetch-Dest: empty")[0] == 404
        assert curl(spa_port, "/app/x", "--http2-prior-knowledge")[:2] == (200, "text/html; charset=utf-8")


def test_the_build_records_the_asset_extensions(builds):
    site_py = open(f"{builds['spa']}/site.py").read()
    m = re.search(r"frozenset\((\[.*?\])\)\)\n", site_py)
    assert m and eval(m.group(1)) == [b"css", b"js", b"json", b"png", b"svg", b"txt", b"woff2"]
    assert ", None)\n" in open(f"{builds['notfound']}/site.py").read()  # no fallback: no set


def test_fallback_all_keeps_the_old_behaviour(tmp_path):
    out = str(tmp_path / "all")
    r = orisha("build", DEMO, "-o", out, "--fallback", "200.html", "--fallback-all")
    assert r.returncode == 0, r.stderr
    s = Server(out, "--loop", "epoll", "--workers", "1")
    try:
        assert curl(s.port, "/js/app.deadbeef.js") == (200, "text/html; charset=utf-8", SHELL)
        assert curl(s.port, "/app/x", "-H", "Sec-Fetch-Dest: script")[0] == 200
    finally:
        s.stop()


def test_fallback_all_needs_a_fallback(tmp_path):
    r = orisha("build", DEMO, "-o", str(tmp_path / "o"), "--fallback-all")
    assert r.returncode == 2 and "--fallback-all goes with --fallback" in r.stderr
    assert not (tmp_path / "o").exists()


def test_the_rule_applies_under_rules_routes_too(tmp_path):
    """A ``_redirects`` rule that matches nothing falls to the same choice (the Rules
    default in the core); checked in the core, without a socket."""
    from orisha.core.connection import App
    from orisha.serving.server import load_site
    out = str(tmp_path / "r")
    r = orisha("build", DEMO, "-o", out, "--fallback", "200.html",
               "--redirect", "/store id=:id /x/:id 301")
    assert r.returncode == 0, r.stderr
    app = App(load_site(out))
    for dest in ("document", "script", "", None):
        field = b"" if dest is None else b"\r\nSec-Fetch-Dest: " + dest.encode()
        for path, asset in ((b"/store", False), (b"/store/a.css", True)):
            plan = app.plan(b"GET " + path + b" HTTP/1.1\r\nHost: x" + field)
            want = 404 if asset or dest == "script" else 200
            assert plan[5] == want, (path, dest, plan[:1])


# slow: it boots the image, which conftest's marking (by module, target or name) misses here;
# in the slow half the booted SPA image is the one the conformance suite uses (one boot, not
# one in each half).
@pytest.mark.slow
def test_the_c_core_chooses_like_the_python_core(builds):
    """The demo in SPA mode, served by epoll and booted: generated paths and Sec-Fetch-Dest
    values give the same bytes but Date (the choice is connection.unknown in both)."""
    import random
    from conftest import _server
    py, uk = _server(builds, "epoll", "spa"), _server(builds, "unikernel", "spa")
    rnd = random.Random(23)
    segs = ["app", "x", "a.js", "A.CSS", "b.Png", "c.woff2", "d.json", "e.txt", "f.svg", "g.html",
            "h.php", "i.", ".js", "j.js.map", "k.tar.gz", "%2Ejs", "l%2ejs", "caf%C3%A9.js", "",
            "m.JSON", "n.jsx", "docs", "index.html"]
    dests = [None, "document", "iframe", "frame", "script", "style", "image", "empty", "font",
             "", "Document", "embed", "object", "document, script"]
    date = re.compile(rb"Date: [^\r\n]*\r\n")
    for i in range(150):
        data = b""
        for _ in range(rnd.choice([1, 1, 2])):
            path = "/" + "/".join(rnd.choice(segs) for _ in range(rnd.choice([1, 2, 3])))
            lines = [f"{rnd.choice(['GET', 'GET', 'HEAD'])} {path} HTTP/1.1", "Host: x"]
            for _ in range(rnd.choice([0, 1, 1, 1, 2])):
                d = rnd.choice(dests)
                if d is not None:
                    lines.append(f"Sec-Fetch-Dest: {d}")
            if rnd.random() < 0.3:
                lines.append("Accept-Encoding: gzip, br")
            data += ("\r\n".join(lines) + "\r\n\r\n").encode()
        want = date.sub(b"", exchange(py.port, data))
        got = date.sub(b"", exchange(uk.port, data))
        assert got == want, (i, data, want[:300], got[:300])


# -- links checked at build time -------------------------------------------------------

LINKED = {
    "index.html": """<!doctype html>
<html><head><link rel="stylesheet" href="/css/a.css"><link rel="icon" href="/nope.ico">
<link rel="preconnect" href="/not-checked"><link rev="made" href="author@example.org">
<style>body { background: url('/img/gone.png') }</style></head>
<body><a href="/docs/">docs</a> <a href="/docs">redirect</a> <a href="/page">page.html</a>
<a href="page.html#top">frag</a> <a href="#here">here</a> <a href="https://example.org/x">ext</a>
<a href="mailto:a@b.c">mail</a> <a href="//cdn.example.org/x.js">cdn</a> <a href="data:,x">data</a>
<a href="/missing">missing</a>
<img src="/img/ok.png" srcset="/img/ok.png 1x, /img/big.png 2x,/img/ok.png" alt="">
<p style="background: url(/img/style.png)">x</p>
<a href="/old">rule</a> <a href="/news/anything">splat</a> <a href="/gone">404 rule</a>
<a href="/caf%C3%A9.txt">encoded</a> <a href="/café.txt">raw</a> <a href="/bad%zz">bad</a>
<a href="docs/../page?x=1">dots and query</a>
</body></html>
""",
    "page.html": "<a href=index.html>home</a> <a href=nowhere.html>nowhere</a>\n",
    "docs/index.html": """<base href="/img/">
<img src="ok.png"><img src="docs-missing.png">
""",
    "css/a.css": """/* url(/in-a-comment.png) */
@import "b.css";
@import 'missing.css';
a { background: url("../img/ok.png") }
b { background: url(/img/css-missing.png) }
""",
    "css/b.css": "",
    "img/ok.png": "",
    "café.txt": "x",
    "_redirects": "/old /page 301\n/news/* /page 302\n/gone /page.html 404\n",
}
BROKEN = ["index.html:2: broken link /nope.ico", "index.html:4: broken link /img/gone.png",
          "index.html:8: broken link /missing", "index.html:9: broken link /img/big.png",
          "index.html:10: broken link /img/style.png", "index.html:11: broken link /gone",
          "index.html:12: broken link /bad%zz", "page.html:1: broken link /nowhere.html",
          "docs/index.html:2: broken link /img/docs-missing.png",
          "css/a.css:3: broken link /css/missing.css",
          "css/a.css:5: broken link /img/css-missing.png"]


def _linked_site(tmp_path, files=LINKED) -> str:
    site = tmp_path / "linked"
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    return str(site)


def _warnings(stderr: str) -> list[str]:
    return [ln.removeprefix("orisha: warning: ") for ln in stderr.splitlines()]


def test_broken_links_are_one_warning_each_then_a_count(tmp_path):
    site = _linked_site(tmp_path)
    r = orisha("build", site, "-o", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    lines = _warnings(r.stderr)
    assert sorted(lines[:-1]) == sorted(f"{site}/{b}" for b in BROKEN)
    assert lines[-1] == f"{site}: {len(BROKEN)} broken links"
    assert (tmp_path / "out" / "site.py").exists()


def test_strict_links_is_an_error_and_writes_nothing(tmp_path):
    site = _linked_site(tmp_path)
    out = tmp_path / "out"
    r = orisha("build", site, "-o", str(out), "--strict-links")
    assert r.returncode == 1 and not out.exists()
    assert r.stderr.splitlines()[-1] == (f"orisha: error: {site}: {len(BROKEN)} broken links "
                                         "(--strict-links)")
    assert len(r.stderr.splitlines()) == len(BROKEN) + 1
    # an earlier build in OUT stays as it was
    fixed = dict(LINKED, **{"index.html": "<a href=/page>ok</a>", "page.html": "",
                            "css/a.css": "", "docs/index.html": ""})
    good = _linked_site(tmp_path / "good", fixed)
    r = orisha("build", good, "-o", str(out), "--strict-links")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    before = (out / "site.py").read_bytes()
    assert orisha("build", site, "-o", str(out), "--strict-links").returncode == 1
    assert (out / "site.py").read_bytes() == before


def test_the_fallback_answers_links_to_pages_not_to_assets(tmp_path):
    files = {"200.html": "<a href=/app/route>app</a> <script src=/js/gone.js></script>"
                         "<img src=/img/gone.png>", "js/app.js": "", "index.html": ""}
    site = _linked_site(tmp_path, files)
    r = orisha("build", site, "-o", str(tmp_path / "o"), "--fallback", "200.html")
    assert _warnings(r.stderr) == [f"{site}/200.html:1: broken link /js/gone.js",
                                   f"{site}: 1 broken link"]  # .png: no PNG in the site
    r = orisha("build", site, "-o", str(tmp_path / "o"), "--fallback", "200.html", "--fallback-all")
    assert r.returncode == 0 and r.stderr == ""


def test_the_real_sites_have_no_false_positives():
    """Debian's PostgreSQL (DocBook) and panoramisk (Sphinx) HTML, checked without a build:
    every file's references against its route table. The one panoramisk link it reports is
    real: Debian's package ships no py-modindex.html."""
    from orisha.embed import assemble, links
    from orisha.embed.walk import walk
    for root, want in (("/usr/share/doc/postgresql-doc-15/html", []),
                       ("/usr/share/doc/python-panoramisk-doc/html",
                        [("index.html", 183, "/py-modindex.html")])):
        files = walk(root, lambda m: None)
        table = assemble.routes([f.rel for f in files])
        routes = links.Routes(table, [], None, False, None)
        found = []
        # every third PostgreSQL page (their links reach the whole site), to keep the time
        sample = files[::3] if "postgresql" in root else files
        for f in sample:
            with open(f.path, "rb") as fh:
                base, refs = links.refs(f.rel, fh.read())
            found += [(f.rel, line, t) for line, t in links.broken(f.rel, base, refs, routes)]
        assert found == want, found[:20]


# -- progress on a terminal ------------------------------------------------------------

SUMMARY = re.compile(r"built \S+: 3 files, 72,022 bytes; gzip [\d,]+ \(\d+%\), br [\d,]+ "
                     r"\(\d+%\), zstd [\d,]+ \(\d+%\) of identity"
                     r"(?:; \d+ dictionaries, \d+ dcz deltas [\d,]+ bytes, history [\d,]+ bytes)?"
                     r" in \d+\.\ds")


def test_progress_on_a_terminal_only(tmp_path):
    """Under a pseudo-terminal the build shows its bars (files, bytes, the estimate); with
    a pipe it prints the summary line alone, as before."""
    import os
    import pty
    import sys
    from conftest import ROOT
    site = _linked_site(tmp_path, {"index.html": "<link rel=stylesheet href=a.css>" * 1000,
                                   "a.css": "a { color: red }\n" * 1000, "b.js": "x;\n" * 7674})
    args = [sys.executable, "-m", "orisha.cli", "build", site, "--no-cache"]
    master, slave = pty.openpty()
    try:
        p = subprocess.Popen([*args, "-o", str(tmp_path / "tty")], stdout=slave,
                             stderr=subprocess.PIPE, cwd=ROOT)
        os.close(slave)
        out = b""
        while True:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        assert p.wait(120) == 0, p.stderr.read()
        p.stderr.close()
    finally:
        os.close(master)
    text = out.decode()
    assert "compressing" in text and "checking links" in text
    assert re.search(r"\d/3 files, 0\.\d of 0\.1 MB", text), text
    assert SUMMARY.fullmatch(text.replace("\r", "\n").rstrip().splitlines()[-1].strip()), text
    r = subprocess.run([*args, "-o", str(tmp_path / "pipe")], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stderr == ""
    assert SUMMARY.fullmatch(r.stdout.removesuffix("\n")), r.stdout


# -- Basic auth --------------------------------------------------------------------------

USERS = {"alice": "s3cret", "bob": "pässwörd"}
CHALLENGE = 'Basic realm="/docs/*", charset="UTF-8"'


def _htpasswd(path, *flags: str, users=USERS) -> str:
    """An htpasswd file made by Apache's htpasswd (bcrypt unless ``flags`` say otherwise)."""
    first = True
    for user, password in users.items():
        subprocess.run(["htpasswd", *(["-c"] if first else []), *(flags or ["-B"]), "-b",
                        str(path), user, password], check=True, capture_output=True)
        first = False
    return str(path)


@pytest.fixture(scope="module")
def auth_build(tmp_path_factory):
    base = tmp_path_factory.mktemp("auth")
    out = str(base / "out")
    r = orisha("build", DEMO, "-o", out, "--not-found", "404.html",
               "--basic-auth", f"/docs/*={_htpasswd(base / 'pw')}")
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module", params=["epoll", "io-uring", "kqueue", "asyncio", "epoll-pure",
                                        "io-uring-pure"])
def auth_port(request, auth_build):
    from conftest import PURE
    loop = request.param
    env = None
    if loop in PURE:
        import os
        env = {**os.environ, "ORISHA_PURE": "1"}
    s = Server(auth_build, "--loop", loop.removesuffix("-pure"), "--workers", "1", env=env)
    try:
        yield s.port
    finally:
        s.stop()


def _curl_head(port: int, path: str, *args: str) -> tuple[int, dict, bytes]:
    r = subprocess.run(["curl", "-sS", "--max-time", "10", "-D", "/dev/stderr", "-o", "-", *args,
                        f"http://127.0.0.1:{port}{path}"], capture_output=True, timeout=20)
    assert r.returncode == 0, r.stderr
    # the final head: over h2 a page with early hints has a 103 first
    lines = r.stderr.decode("utf-8").rstrip("\r\n").split("\r\n\r\n")[-1].split("\r\n")
    fields = {}
    for ln in lines[1:]:
        name, sep, value = ln.partition(": ")
        if sep:
            fields[name.lower()] = value
    return int(lines[0].split()[1]), fields, r.stdout


def test_basic_auth_over_curl(auth_port):
    port = auth_port
    status, h, body = _curl_head(port, "/docs/")
    assert (status, h["www-authenticate"], body) == (401, CHALLENGE, b"401 Unauthorized\n")
    for user, password in USERS.items():  # bob's password is UTF-8 (RFC 7617 §2.1)
        status, h, body = _curl_head(port, "/docs/", "-u", f"{user}:{password}")
        assert (status, body) == (200, demo_file("docs/index.html"))
        assert h["cache-control"] == "private, no-cache" and "www-authenticate" not in h
    assert _curl_head(port, "/docs/", "-u", "alice:wrong")[0] == 401
    assert _curl_head(port, "/docs/", "-u", "eve:s3cret")[0] == 401
    assert _curl_head(port, "/docs/", "-H", "Authorization: Bearer x")[0] == 401
    assert _curl_head(port, "/docs/", "-H", "Authorization: Basic !!!")[0] == 401
    # every route of the area, its unknown paths too; not the rest of the site
    assert _curl_head(port, "/docs/guide/getting-started")[0] == 401
    assert _curl_head(port, "/docs/nope")[0] == 401
    status, h, body = _curl_head(port, "/docs/nope", "-u", "alice:s3cret")
    assert (status, body) == (404, demo_file("404.html"))
    status, h, _ = _curl_head(port, "/css/site.css")
    assert status == 200 and h["cache-control"] == "public, max-age=3600"
    out = exchange(port, b"HEAD /docs/ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 401 Unauthorized\r\n") and out.endswith(b"\r\n\r\n")
    assert b"\r\nContent-Length: 17\r\n" in out
    # HTTP/2 goes through the same answer()
    assert _curl_head(port, "/docs/", "--http2-prior-knowledge")[0] == 401
    status, h, _ = _curl_head(port, "/docs/", "--http2-prior-knowledge", "-u", "bob:pässwörd")
    assert status == 200 and h["cache-control"] == "private, no-cache"


def test_a_credential_is_verified_once_per_worker(auth_build, monkeypatch):
    """bcrypt runs once per Authorization value however many heads carry it (the plan memo
    aside: every head here is new), and the worker remembers a bounded number of them."""
    import base64

    import bcrypt

    from orisha.core.connection import App
    from orisha.core.policy import AUTH_REMEMBERED
    from orisha.serving.server import load_site
    calls = []
    real = bcrypt.checkpw
    monkeypatch.setattr(bcrypt, "checkpw", lambda p, h: calls.append(p) or real(p, h))
    app = App(load_site(auth_build))
    token = base64.b64encode(b"alice:s3cret").decode()
    for i in range(40):
        head = f"GET /docs/?v={i} HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {token}".encode()
        assert app.plan(head)[5] == 200
    assert calls == [b"s3cret"]
    wrong = base64.b64encode(b"alice:nope").decode()
    for i in range(3):
        assert app.plan(f"GET /docs/?w={i} HTTP/1.1\r\nHost: x\r\n"
                        f"Authorization: Basic {wrong}".encode())[5] == 401
    assert calls == [b"s3cret", b"nope"]  # a wrong password is remembered too
    area = app.site.routes[b"/docs/"].auth
    for i in range(AUTH_REMEMBERED + 50):  # unknown users: no bcrypt, but bounded all the same
        area.allows(b"Basic " + base64.b64encode(b"u%d:x" % i))
    assert len(area.judged) == AUTH_REMEMBERED


def test_a_rule_may_set_cache_control_behind_auth(tmp_path):
    from orisha.core.connection import App
    from orisha.serving.server import load_site
    out = str(tmp_path / "o")
    r = orisha("build", DEMO, "-o", out, "--basic-auth", f"/*={_htpasswd(tmp_path / 'pw')}",
               "--cache-control", "css/*=no-store", "--header", "img/*:Cache-Control=max-age=5")
    assert r.returncode == 0, r.stderr
    app = App(load_site(out))
    import base64
    cred = b"\r\nAuthorization: Basic " + base64.b64encode(b"alice:s3cret")
    for path, cc in ((b"/css/site.css", b"no-store"), (b"/img/logo.svg", b"max-age=5"),
                     (b"/files/big.txt", b"private, max-age=3600"),
                     (b"/js/app.3f2a1b9c.js", b"private, max-age=31536000, immutable")):
        head = app.plan(b"GET " + path + b" HTTP/1.1\r\nHost: x" + cred)[0]
        assert b"\r\nCache-Control: " + cc + b"\r\n" in head, (path, head)
        assert app.plan(b"GET " + path + b" HTTP/1.1\r\nHost: x")[5] == 401


def _answer(sock) -> bytes:
    """One response's head (and whatever came with it) from a socket, up to EOF or head."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_a_flood_of_wrong_passwords_is_bounded_and_the_rest_is_served(auth_build):
    """Each unknown Authorization value costs a bcrypt check; a worker runs at most
    policy.AUTH_CHECKS of them a second and answers the excess 503 with Retry-After (not
    remembered), so a burst of distinct wrong passwords neither stalls the other requests
    nor locks out the right password once the second has passed."""
    import base64
    import socket
    import time
    from orisha.core.policy import AUTH_CHECKS

    def request(path: str, user: str | None = None, password: str = "") -> bytes:
        auth = b""
        if user is not None:
            auth = b"Authorization: Basic " + base64.b64encode(
                f"{user}:{password}".encode()) + b"\r\n"
        return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n"

    s = Server(auth_build, "--loop", "epoll", "--workers", "1")
    bogus = []
    try:
        began = time.monotonic()
        for i in range(40):  # all sent before the normal request
            c = socket.create_connection(("127.0.0.1", s.port), timeout=20)
            c.sendall(request("/docs/", "alice", f"wrong-{i}"))
            bogus.append(c)
        with socket.create_connection(("127.0.0.1", s.port), timeout=20) as c:
            c.sendall(request("/css/site.css"))
            assert _answer(c).startswith(b"HTTP/1.1 200 OK\r\n")
        answers = [_answer(c) for c in bogus]
        elapsed = time.monotonic() - began
        statuses = [a[:12] for a in answers]
        assert set(statuses) <= {b"HTTP/1.1 401", b"HTTP/1.1 503"}, statuses
        checked = statuses.count(b"HTTP/1.1 401")
        assert 1 <= checked <= AUTH_CHECKS * (int(elapsed) + 2), (checked, elapsed)
        busy = [i for i, a in enumerate(answers) if a.startswith(b"HTTP/1.1 503")]
        assert busy and all(b"\r\nRetry-After: 1\r\n" in answers[i] for i in busy)
        # The next seconds: a value answered 503 is judged now (it was not remembered), and
        # the right password gets in.
        got = {}
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            for what, req in (("wrong", request("/docs/", "alice", f"wrong-{busy[0]}")),
                              ("right", request("/docs/", "alice", "s3cret"))):
                if what not in got:
                    with socket.create_connection(("127.0.0.1", s.port), timeout=20) as c:
                        c.sendall(req)
                        status = _answer(c)[:12]
                    if status != b"HTTP/1.1 503":
                        got[what] = status
            time.sleep(0.3)
        assert got == {"wrong": b"HTTP/1.1 401", "right": b"HTTP/1.1 200"}, got
    finally:
        for c in bogus:
            c.close()
        s.stop()


@pytest.mark.parametrize("case", ["md5", "sha", "plain", "nouser", "badline", "missing", "syntax",
                                  "unikernel", "glob"])
def test_basic_auth_errors_are_one_line(tmp_path, case):
    """Three through the CLI (the line, exit 1, nothing written), the rest in process: the
    same BuildError the CLI prints."""
    out = tmp_path / "o"
    pw = tmp_path / "pw"
    opts = ["--basic-auth", f"/docs/*={pw}"]
    if case in ("md5", "sha", "plain"):
        _htpasswd(pw, {"md5": "-m", "sha": "-s", "plain": "-p"}[case])
        want = f"{pw}:1: alice: not a bcrypt hash (make it with htpasswd -B)"
    elif case == "nouser":
        pw.write_text("# nobody\n\n")
        want = f"{pw}: no user in the htpasswd file"
    elif case == "badline":
        pw.write_text("alice\n")
        want = f"{pw}:1: expected user:hash"
    elif case == "missing":
        want = f"{pw}: cannot read the htpasswd file (No such file or directory)"
    elif case == "syntax":
        opts = ["--basic-auth", "/docs/*"]
        want = "--basic-auth '/docs/*': expected GLOB=HTPASSWD, e.g. '/private/*=site.htpasswd'"
    elif case == "glob":
        _htpasswd(pw)
        opts = ["--basic-auth", f"docs/*={pw}"]
        want = f"--basic-auth 'docs/*={pw}': 'docs/*': the pattern must be a URL path starting with /"
    else:
        _htpasswd(pw)
        opts += ["--target", "unikernel"]
        want = ("--basic-auth: not with --target unikernel (the booted image has no bcrypt to "
                "check passwords); serve the build hosted or as a container")
    if case in ("md5", "syntax", "unikernel"):
        r = orisha("build", DEMO, "-o", str(out), *opts)
        assert r.returncode == 1 and r.stderr == f"orisha: error: {want}\n", r.stderr
        assert not out.exists()
        return
    from orisha.embed.build import build
    from orisha.errors import BuildError
    with pytest.raises(BuildError) as e:
        build(DEMO, str(out), basic_auth=[opts[1]], loop=opts[3] if len(opts) > 2 else "auto")
    assert str(e.value) == want and not out.exists()


# -- Early Hints -------------------------------------------------------------------------

def test_pages_carry_their_early_hints_as_link_fields(tmp_path):
    """Stylesheets and blocking scripts of the head, preloads and modulepreloads the site
    serves become one Link value; async/defer/module scripts, body scripts, external and
    missing ones do not. _headers adds to it or detaches it; --no-early-hints omits it."""
    files = {
        "index.html": """<!doctype html><html><head>
<link rel=stylesheet href="css/a.css"><link rel="alternate stylesheet" href="/css/a.css">
<link rel=stylesheet href="https://cdn.example.org/x.css"><script src="/js/a.js"></script>
<script src="/js/b.js" defer></script><script src="/js/c.js" async></script>
<script type=module src="/js/m.js"></script><link rel=modulepreload href="/js/m.js">
<link rel=preload href="/fonts/f.woff2" as=font crossorigin><link rel=preload href="/gone.js" as=script>
<link rel=stylesheet href="/css/a.css"></head><body><script src="/js/d.js"></script></body></html>""",
        "css/a.css": "", "js/a.js": "", "js/b.js": "", "js/c.js": "", "js/d.js": "", "js/m.js": "",
        "fonts/f.woff2": "", "other.html": "<link rel=stylesheet href=/css/a.css>",
        "_headers": "/other.html\n  ! Link\n/\n  Link: </extra>; rel=preconnect\n",
    }
    site = _linked_site(tmp_path, files)
    from orisha.core.connection import App
    from orisha.serving.server import load_site
    out = str(tmp_path / "o")
    assert orisha("build", site, "-o", out).returncode == 0
    app = App(load_site(out))
    head = app.plan(b"GET / HTTP/1.1\r\nHost: x")[0]
    assert (b"\r\nLink: </css/a.css>; rel=preload; as=style, </js/a.js>; rel=preload; as=script, "
            b"</js/m.js>; rel=modulepreload, </fonts/f.woff2>; rel=preload; as=font; crossorigin, "
            b"</extra>; rel=preconnect\r\n") in head, head
    assert b"Link:" not in app.plan(b"GET /other.html HTTP/1.1\r\nHost: x")[0]
    assert b"Link:" not in app.plan(b"GET /css/a.css HTTP/1.1\r\nHost: x")[0]
    assert orisha("build", site, "-o", out, "--no-early-hints").returncode == 0
    head = App(load_site(out)).plan(b"GET / HTTP/1.1\r\nHost: x")[0]
    assert b"\r\nLink: </extra>; rel=preconnect\r\n" in head  # the author's own stays


@pytest.mark.parametrize("loop", ["epoll", "io-uring", "kqueue", "asyncio", "epoll-pure",
                                  "io-uring-pure"])
def test_a_103_precedes_the_page_on_http2_only(builds, loop):
    """curl over h2c: the 103 with the page's Link, then its 200; HTTP/1.1 and HTTP/1.0 get
    the 200 alone (README: why not over HTTP/1.1)."""
    from tlsutil import tls_server
    port = tls_server(builds, loop, None).port
    r = subprocess.run(["curl", "-sS", "-D", "-", "-o", "/dev/null", "--http2-prior-knowledge",
                        f"http://127.0.0.1:{port}/docs/"], capture_output=True, timeout=20)
    heads = r.stdout.decode().split("\r\n\r\n")
    assert heads[0] == "HTTP/2 103 \r\nlink: </css/site.css>; rel=preload; as=style", heads
    assert heads[1].startswith("HTTP/2 200 \r\n")
    assert "\r\nlink: </css/site.css>; rel=preload; as=style\r\n" in heads[1]
    css = subprocess.run(["curl", "-sS", "-D", "-", "-o", "/dev/null", "--http2-prior-knowledge",
                          f"http://127.0.0.1:{port}/css/site.css"], capture_output=True, timeout=20)
    assert css.stdout.startswith(b"HTTP/2 200")  # no hints, no 103
    for version in ("1.1", "1.0"):
        out = exchange(port, f"GET /docs/ HTTP/{version}\r\nHost: x\r\nConnection: close\r\n\r\n"
                       .encode())
        assert out.startswith(f"HTTP/1.1 200 OK\r\n".encode()) and b" 103 " not in out
        assert b"\r\nLink: </css/site.css>; rel=preload; as=style\r\n" in out


def _chromium_network(build: str, pki, tmp_path, path: str) -> list[dict]:
    """The DevTools Network events of one page load over https/h2 in headless Chromium."""
    import time

    from browser import _Browser
    from tlsutil import serve, trusting_chromium
    s = serve(build, "--loop", "epoll", "--workers", "1", "--tls-cert", pki.chain,
              "--tls-key", pki.key)
    try:
        b = _Browser(trusting_chromium(pki.cert, tmp_path))
        try:
            b.call("Target.getTargets", timeout=30)
            target = b.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = b.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Network", "Page"):
                b.call(f"{domain}.enable", session=session)
            b.call("Network.setCacheDisabled", {"cacheDisabled": True}, session=session)
            b.call("Page.navigate", {"url": f"https://127.0.0.1:{s.port}{path}"}, session=session)
            events, deadline = [], time.monotonic() + 20
            while (m := b.wait_event(deadline)) is not None:
                if m.get("sessionId") == session and m.get("method", "").startswith(("Network.", "Page.load")):
                    events.append(m)
                    if m["method"] == "Page.loadEventFired":
                        deadline = min(deadline, time.monotonic() + 1)
            return events
        finally:
            b.close()
    finally:
        s.stop()


@pytest.mark.slow
def test_chromium_reports_the_early_hints_and_the_preload_they_start(builds, pki, tmp_path):
    """DevTools: Network.responseReceivedEarlyHints for the page with its Link, and the
    stylesheet fetched by that preload (initiator "other", before the parser reaches it)
    over h2; built with --no-early-hints, no hints and the parser fetches it."""
    def summary(events):
        hints = [e["params"]["headers"] for e in events
                 if e["method"] == "Network.responseReceivedEarlyHints"]
        css = [e["params"] for e in events if e["method"] == "Network.requestWillBeSent"
               and e["params"]["request"]["url"].endswith("/css/site.css")]
        got = {e["params"]["requestId"]: e["params"]["response"] for e in events
               if e["method"] == "Network.responseReceived"}
        return hints, css, got
    # Once in a CI run (the machine at full load) Chromium's DevTools reported the page and
    # its stylesheet but no responseReceivedEarlyHints: a second load decides, and a build
    # without hints fails both.
    for attempt in range(2):
        events = _chromium_network(builds["notfound"], pki, tmp_path, "/docs/")
        hints, css, got = summary(events)
        if hints:
            break
    assert hints == [{"link": "</css/site.css>; rel=preload; as=style"}], \
        [e["method"] for e in events]
    assert len(css) == 1 and css[0]["initiator"]["type"] == "other", css
    assert got[css[0]["requestId"]]["status"] == 200
    assert got[css[0]["requestId"]]["protocol"] == "h2"
    plain = str(tmp_path / "plain")
    assert orisha("build", DEMO, "-o", plain, "--not-found", "404.html",
                  "--no-early-hints").returncode == 0
    hints, css, got = summary(_chromium_network(plain, pki, tmp_path, "/docs/"))
    assert hints == [] and len(css) == 1 and css[0]["initiator"]["type"] == "parser", css


def test_basic_auth_in_the_container(tmp_path):
    """The frozen executable carries bcrypt: the container checks a password like the loops."""
    from container_target import start
    pw = _htpasswd(tmp_path / "pw")
    c = start(DEMO, ["--not-found", "404.html", "--basic-auth", f"/docs/*={pw}"], [])
    try:
        status, h, _ = _curl_head(c.port, "/docs/")
        assert (status, h["www-authenticate"]) == (401, CHALLENGE)
        status, h, body = _curl_head(c.port, "/docs/", "-u", "bob:pässwörd")
        assert (status, body, h["cache-control"]) == (200, demo_file("docs/index.html"),
                                                      "private, no-cache")
        assert _curl_head(c.port, "/docs/", "-u", "bob:wrong")[0] == 401
    finally:
        c.stop()
