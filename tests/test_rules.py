"""``_headers`` and ``_redirects`` (Netlify / Cloudflare Pages syntax) over real sockets.

``sites/rules/`` uses every form Orisha supports; it is served by every target
(test ids carry the name), the booted unikernel included: its C core matches
the run-time rules from the site image (tests/test_unikernel.py compares it with
the Python matcher on generated paths). Build errors are one line naming file
and line.
"""

from __future__ import annotations

import os

import pytest
from conftest import PURE, ROOT, TEST_LIMITS, UNIKERNELS, Server, _servers, orisha
from httpraw import Conn
from test_build import one_line_error

RULES = os.path.join(ROOT, "sites", "rules")


def site_file(rel: str) -> bytes:
    with open(os.path.join(RULES, rel), "rb") as f:
        return f.read()


@pytest.fixture(scope="session")
def rules_port(loop, tmp_path_factory):
    """A server of sites/rules for the target ``loop`` (stopped with the conftest's servers)."""
    key = (loop, "rules")
    if key not in _servers:
        if loop in UNIKERNELS:
            from unikernel_target import boot
            _servers[key] = boot(RULES, [], TEST_LIMITS + UNIKERNELS[loop])
        elif loop == "container":
            from container_target import start
            _servers[key] = start(RULES, [], TEST_LIMITS)
        else:
            out = str(tmp_path_factory.mktemp("rules") / "out")
            r = orisha("build", RULES, "-o", out)
            assert r.returncode == 0, r.stderr
            env = {**os.environ, "ORISHA_PURE": "1"} if loop in PURE else None
            _servers[key] = Server(out, "--loop", loop.removesuffix("-pure"), "--workers", "2",
                                   *TEST_LIMITS, **({"env": env} if env else {}))
    return _servers[key].port


def get(port, path, method="GET", **headers):
    c = Conn(port)
    try:
        return c.request(path, method, headers={k.replace("_", "-"): v for k, v in headers.items()})
    finally:
        c.close()


# -- _redirects: exact rules (every target) ---------------------------------------------------

@pytest.mark.parametrize("path,status,location", [
    ("/home", 301, "/"), ("/home?utm=x&y", 301, "/?utm=x&y"), ("/old-about", 302, "/about.html"),
    ("/see-other", 303, "/about"), ("/temp", 307, "/about"), ("/perm?a=%20", 308, "/about?a=%20"),
    ("/moved", 301, "https://example.com/moved"), ("/forced.html", 301, "/about"),
])
def test_exact_redirects(rules_port, path, status, location):
    c = Conn(rules_port)
    r = c.request(path)
    assert r.status == status and r.body == b"" and r.h("location") == location
    assert r.h("content-length") == "0"
    assert r.h("cache-control") == ("public, max-age=3600" if status in (301, 308) else "no-cache")
    h = c.request(path, method="HEAD")  # HEAD has the GET head
    assert [f for f in h.fields if f[0] != "date"] == [f for f in r.fields if f[0] != "date"]


def test_non_forced_rule_is_shadowed_by_a_file(rules_port):
    r = get(rules_port, "/kept.html")
    assert r.status == 200 and r.body == site_file("kept.html")


def test_rewrite_keeps_the_url_and_the_document_semantics(rules_port):
    want = site_file("blog/hello.html")
    c = Conn(rules_port)
    r = c.request("/pretty")
    assert r.status == 200 and r.body == want and r.h("location") is None
    assert c.request("/pretty", headers={"If-None-Match": r.h("etag")}).status == 304
    gz = c.request("/pretty", headers={"Accept-Encoding": "gzip"})
    assert gz.status == 200 and gz.h("content-encoding") == "gzip"


def test_404_rule_serves_its_document_with_404(rules_port):
    r = get(rules_port, "/gone")
    assert r.status == 404 and r.body == site_file("en/404.html")
    assert r.h("accept-ranges") is None and r.h("cache-control") == "no-cache"
    assert get(rules_port, "/gone", if_none_match="*").status == 404  # not conditional


def test_rule_files_are_not_served(rules_port, loop):
    for path in ("/_headers", "/_redirects"):
        r = get(rules_port, path)
        assert r.status == 404 and b"X-Frame-Options" not in r.body and b"/home" not in r.body


def test_destination_with_its_own_query_drops_the_requests(rules_port):
    assert get(rules_port, "/query-kept?a=1").h("location") == "/about?from=rule"


# -- _redirects: run-time rules (every target) -------------------------------------------------

@pytest.mark.parametrize("path,status,location", [
    ("/news/2024/01/hello", 301, "/blog/2024/01/hello"),
    ("/news/caf%C3%A9?x=1", 301, "/blog/caf%C3%A9?x=1"),
    ("/news/special", 301, "/blog/special"),      # first match wins: /news/* comes first
    ("/store?id=42", 301, "/posts/42.html"),      # a query condition binds :id
    ("/store?a=b&id=7", 301, "/posts/7.html"),
    ("/search?q=orisha", 302, "/about"),
])
def test_run_time_redirects(rules_port, path, status, location):
    r = get(rules_port, path)
    assert (r.status, r.h("location")) == (status, location)


@pytest.mark.parametrize("path,status,rel", [
    ("/posts/42/edit", 200, "posts/42.html"), ("/app/some/client/route", 200, "app/index.html"),
    ("/posts/99/edit", 404, None),                 # a rewrite to a missing document: not found
    ("/en/missing", 404, "en/404.html"), ("/nowhere", 404, "404.html"),
    ("/store", 404, "404.html"),                    # the condition fails: on to /* → 404
    ("/search?q=other", 404, "404.html"),
])
def test_run_time_rewrites_and_404s(rules_port, path, status, rel):
    r = get(rules_port, path, accept_encoding="identity")
    assert r.status == status
    assert r.body == site_file(rel) if rel else b"404 Not Found" in r.body  # (the built-in page)


# -- _headers (every target) ------------------------------------------------------------------

def test_headers_on_every_variant_and_on_head(rules_port):
    c = Conn(rules_port)
    for enc in ("identity", "gzip", "br"):
        r = c.request("/assets/app.css", headers={"Accept-Encoding": enc})
        assert r.status == 200
        assert r.h("cache-control") == "public, max-age=600"
        assert r.h("expires") == "Thu, 01 Jan 2099 00:00:00 GMT"
        assert r.h("vary") == "Accept-Encoding, Origin"
        assert r.h("access-control-allow-origin") == "*"
        assert r.h("x-frame-options") == "DENY" and r.h("x-content-type-options") == "nosniff"
        assert (r.h("accept-ranges") == "bytes") == (enc == "identity")
        h = c.request("/assets/app.css", method="HEAD", headers={"Accept-Encoding": enc})
        assert [f for f in h.fields if f[0] != "date"] == [f for f in r.fields if f[0] != "date"]


def test_304_keeps_the_fields_rfc_9110_lists(rules_port):
    c = Conn(rules_port)
    r = c.request("/assets/app.css")
    n = c.request("/assets/app.css", headers={"If-None-Match": r.h("etag")})
    assert n.status == 304
    # RFC 9110 §15.4.5: Cache-Control, Content-Location, Date, ETag, Expires, Vary
    assert {k for k, _ in n.fields} == {"etag", "cache-control", "expires", "vary", "date"}
    assert n.h("cache-control") == "public, max-age=600" and n.h("expires") == r.h("expires")
    assert n.h("vary") == "Accept-Encoding, Origin"


def test_header_patterns_and_detach(rules_port):
    assert get(rules_port, "/").h("x-frame-options") == "DENY"
    assert get(rules_port, "/blog/hello").h("x-blog") == "yes"           # :slug
    assert get(rules_port, "/blog/hello.html").h("x-blog") == "yes"
    assert get(rules_port, "/blog/").h("x-blog") is None                 # :slug needs a segment
    about = get(rules_port, "/about.html")
    assert about.h("x-frame-options") is None                             # "! X-Frame-Options"
    assert about.h("content-security-policy") == "default-src 'self'"
    assert about.h("x-content-type-options") == "nosniff"
    assert get(rules_port, "/about").h("x-frame-options") == "DENY"      # another path
    assert get(rules_port, "/").h("cache-control") == "no-cache"         # the build's policy stays


# -- the command line (one hosted server) ----------------------------------------------------

def test_header_and_redirect_options(tmp_path):
    from conftest import DEMO
    out = str(tmp_path / "o")
    r = orisha("build", DEMO, "-o", out, "--header", "*.css:X-Test=1",
               "--header", "css/*:Cache-Control=public, max-age=60",
               "--redirect", "/old /css/site.css 302", "--redirect", "/img/* /files/:splat 307")
    assert r.returncode == 0, r.stderr
    s = Server(out, "--loop", "epoll", "--workers", "1")
    try:
        css = get(s.port, "/css/site.css")
        assert css.h("x-test") == "1" and css.h("cache-control") == "public, max-age=60"
        assert get(s.port, "/index.html").h("x-test") is None
        assert (get(s.port, "/old").status, get(s.port, "/old").h("location")) == (302, "/css/site.css")
        assert get(s.port, "/img/logo.svg").status == 200                   # shadowed by the file
        r = get(s.port, "/img/nope.svg")
        assert (r.status, r.h("location")) == (307, "/files/nope.svg")
    finally:
        s.stop()


# -- build errors ------------------------------------------------------------------------------

def _site(tmp_path, redirects: str | None = None, headers: str | None = None) -> str:
    site = tmp_path / "s"
    (site / "d").mkdir(parents=True, exist_ok=True)
    (site / "index.html").write_text("<p>hi")
    (site / "d" / "page.html").write_text("<p>page")
    if redirects is not None:
        (site / "_redirects").write_text(redirects)
    if headers is not None:
        (site / "_headers").write_text(headers)
    return str(site)


@pytest.mark.parametrize("text,line,needle", [
    ("/a /b 301\n\n# c\n/x /y 399\n", 4, "unknown status 399"),
    ("/a\n", 1, "no destination"),
    ("/a b 301\n", 1, "a destination is a path"),
    ("a /b\n", 1, "a path must start with /"),
    ("/a https://x.org/ 200\n", 1, "proxying"),
    ("/a /b 302 Country=us\n", 1, "country conditions are not supported"),
    ("/a /b 301 extra\n", 1, "unexpected 'extra'"),
    ("/a/*/b/* /c\n", 1, "* appears twice"),
    ("https://x.org/* /b\n", 1, "host-specific"),
    ("/a /missing.html 200\n", 1, "/missing.html is not a document of the site"),
    ("/a /d/page.html 404\n/b/* /nothing/:splat 404\n", 2, "names no document"),
])
def test_bad_redirects_line_is_a_one_line_error(tmp_path, text, line, needle):
    site = _site(tmp_path, redirects=text)
    r = orisha("build", site, "-o", str(tmp_path / "o"))
    one_line_error(r, f"{os.path.join(site, '_redirects')}:{line}: ", needle)
    assert not os.path.exists(tmp_path / "o")


@pytest.mark.parametrize("text,line,needle", [
    ("  X-A: 1\n", 1, "a header line before any path"),
    ("/*\n  Content-Length: 5\n", 2, "set by the server"),
    ("/*\n  ETag: \"x\"\n", 2, "set by the server"),
    ("/*\n  Bad Name: 1\n", 2, "is not a header name"),
    ("/*\n  NoColon\n", 2, "expected 'Name: value'"),
    ("/a\n/b\n  X: 1\n", 1, "has no header lines"),
])
def test_bad_headers_line_is_a_one_line_error(tmp_path, text, line, needle):
    site = _site(tmp_path, headers=text)
    one_line_error(orisha("build", site, "-o", str(tmp_path / "o")),
                   f"{os.path.join(site, '_headers')}:{line}: ", needle)


@pytest.mark.parametrize("option,value,needle", [
    ("--redirect", "/only-one", "no destination"), ("--redirect", "/a /b 418", "unknown status 418"),
    ("--header", "no-colon", "expected GLOB:NAME=VALUE"),
    ("--header", "*:Connection=close", "set by the server"),
])
def test_bad_options_are_one_line_errors(tmp_path, option, value, needle):
    one_line_error(orisha("build", _site(tmp_path), "-o", str(tmp_path / "o"), option, value),
                   option, needle)


def test_unikernel_build_refuses_rules_beyond_its_buffers_in_one_line(tmp_path):
    """The C core's fixed buffers bound a rule (image.PIECES_MAX, SLOTS_MAX, URL_MAX);
    run-time rules within them build (sites/rules is served by the unikernel above)."""
    many = "/" + "/".join(f":p{i}" for i in range(17))
    for text, needle in [
        ("/a/* /:splat/:splat/:splat/:splat/:splat/:splat 200\n", "unikernel's 65,536"),
        (f"{many} /d/page.html 302\n", "more than 16 placeholders"),
        ("/b/* " + "/x:splat" * 17 + " 301\n", "more than 32 pieces"),
    ]:
        site = _site(tmp_path, redirects="/ok/* /d/:splat 301\n" + text)
        one_line_error(orisha("build", site, "-o", str(tmp_path / "o"), "--target", "unikernel"),
                       os.path.join(site, "_redirects") + ":2: ", needle)
        assert not os.path.exists(tmp_path / "o")
