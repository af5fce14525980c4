"""``orisha build --autoindex``: generated listings for folders without index.html, like nginx's."""

from __future__ import annotations

import html
import re
from urllib.parse import urljoin

from conftest import Server, orisha
from httpraw import Conn

NAMES = ['a<b>&"c\'.txt', "ü space.txt", "100%.txt", "#hash?.txt"]


def test_listings_escape_names_and_link_to_every_entry(tmp_path):
    site = tmp_path / "s"
    (site / "sub" / "deep").mkdir(parents=True)
    (site / "with-index").mkdir()
    for n in NAMES:
        (site / "sub" / n).write_text(f"file {n}")
    (site / "sub" / "deep" / "x.txt").write_text("x")
    (site / "with-index" / "index.html").write_text("<p>own index")
    out = str(tmp_path / "o")
    assert orisha("build", str(site), "-o", out).returncode == 0
    plain = Server(out, "--loop", "epoll", "--workers", "1")
    try:
        assert Conn(plain.port).request("/sub/").status == 404  # off by default
    finally:
        plain.stop()
    r = orisha("build", str(site), "-o", out, "--autoindex")
    assert r.returncode == 0, r.stderr
    assert "6 files" in r.stdout  # the listings are not counted as the site's files
    s = Server(out, "--loop", "epoll", "--workers", "1")
    try:
        c = Conn(s.port)
        page = c.request("/sub/")
        assert page.status == 200 and page.h("content-type") == "text/html; charset=utf-8"
        text = page.body.decode()
        assert "<title>Index of /sub/</title>" in text
        links = re.findall(r'<a href="([^"]*)">([^<]*)</a>', text)
        assert [html.unescape(name) for _, name in links] == ["../", "deep/", *sorted(NAMES)]
        assert all(n not in text for n in NAMES if html.escape(n) != n)  # escaped in the page
        for href, name in links[2:]:
            assert re.fullmatch(r"[A-Za-z0-9%._~\-]+", href), href  # percent-encoded
            got = c.request(urljoin("/sub/", href))
            assert got.status == 200 and got.body == f"file {html.unescape(name)}".encode()
        assert c.request(urljoin("/sub/", links[1][0])).status == 200      # deep/ is listed too
        assert c.request("/sub").status == 301 and c.request("/sub").h("location") == "/sub/"
        assert c.request("/with-index/").body == b"<p>own index"            # an index.html wins
        root = c.request("/").body.decode()
        assert '<a href="sub/">sub/</a>' in root and "../" not in root
    finally:
        s.stop()
