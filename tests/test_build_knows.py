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
    if loop != "unikernel":  # h2c is the hosted server's (the image speaks h2 over TLS)
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


@pytest.mark.parametrize("dest", ["document", "script", "", None])
def test_the_rule_applies_under_rules_routes_too(tmp_path, dest):
    """A ``_redirects`` rule that matches nothing falls to the same choice (the Rules
    default in the core); checked in the core, without a socket."""
    from orisha.core.connection import App
    from orisha.server import load_site
    out = str(tmp_path / "r")
    r = orisha("build", DEMO, "-o", out, "--fallback", "200.html",
               "--redirect", "/store id=:id /x/:id 301")
    assert r.returncode == 0, r.stderr
    app = App(load_site(out))
    field = b"" if dest is None else b"\r\nSec-Fetch-Dest: " + dest.encode()
    for path, asset in ((b"/store", False), (b"/store/a.css", True)):
        plan = app.plan(b"GET " + path + b" HTTP/1.1\r\nHost: x" + field)
        want = 404 if asset or dest == "script" else 200
        assert plan[5] == want, (path, dest, plan[:1])


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
