"""The manual (docs/) is an Orisha site, and README.md is its front door.

docs/ is built through the CLI with --strict-links (no internal href, src, srcset or CSS
url() that would get a 404), served by `orisha serve` on a loopback port, and every page is
fetched over a real socket: 200, the page's own bytes, its own <title>, and a nav that links
every page. README.md stays at most 250 lines, each of its relative links names a file of the
checkout, and each manual page it links is one the built manual serves. Links to a section
(page.html#id) must name an id of that page. A copy of docs/ with
one link to a missing file must fail the strict build, so the check can fail.
"""

from __future__ import annotations

import os
import re
import shutil
from html.parser import HTMLParser
from urllib.parse import unquote, urlsplit

import pytest
from conftest import ROOT, Server, orisha
from httpraw import Conn

DOCS = os.path.join(ROOT, "docs")
README = os.path.join(ROOT, "README.md")
README_MAX_LINES = 250  # issue 34: the front door fits on a few screens
PAGES = sorted(n for n in os.listdir(DOCS) if n.endswith(".html"))


class _Page(HTMLParser):
    """The <title> text and the hrefs inside <nav> of one page."""

    def __init__(self) -> None:
        super().__init__()
        self.title, self.nav, self._in = "", [], []

    def handle_starttag(self, tag, attrs):
        self._in.append(tag)
        if tag == "a" and "nav" in self._in:
            self.nav.append(dict(attrs).get("href"))

    def handle_endtag(self, tag):
        while self._in and self._in.pop() != tag:
            pass

    def handle_data(self, data):
        if self._in and self._in[-1] == "title":
            self.title += data


def parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    return page


def build(site: str, out: str):
    return orisha("build", site, "-o", out, "--strict-links", timeout=120)


@pytest.fixture(scope="module")
def manual(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("docs") / "out")
    r = build(DOCS, out)
    assert r.returncode == 0, r.stderr
    assert "broken link" not in r.stderr, r.stderr
    return out


@pytest.fixture(scope="module")
def served(manual):
    server = Server(manual, "--workers", "1")
    yield server.port
    assert server.stop() == 0


def test_the_manual_has_its_pages():
    # The sections issue 34 names, one page each (a rename must update this list and the nav).
    assert set(PAGES) >= {"index.html", "install.html", "build.html", "serve.html", "https.html",
                          "http2-http3.html", "targets.html", "operations.html",
                          "performance.html", "reliability.html", "architecture.html",
                          "tests.html"}


@pytest.mark.parametrize("name", PAGES)
def test_every_page_is_served_with_its_title_and_a_nav_to_every_page(served, name):
    with open(os.path.join(DOCS, name), "rb") as f:
        source = f.read()
    expected = parse(source.decode("utf-8"))
    assert expected.title.strip(), f"{name} has no <title>"
    assert sorted(h for h in expected.nav if h.endswith(".html")) == PAGES, \
        f"the nav of {name} does not list every page"
    conn = Conn(served)
    try:
        r = conn.request("/" + name)
    finally:
        conn.close()
    assert r.status == 200, name
    assert r.h("content-type") == "text/html; charset=utf-8"
    assert r.body == source  # identity: the page exactly as written
    assert parse(r.body.decode("utf-8")).title == expected.title


def test_the_root_is_the_index(served):
    conn = Conn(served)
    try:
        r = conn.request("/")
    finally:
        conn.close()
    assert r.status == 200
    with open(os.path.join(DOCS, "index.html"), "rb") as f:
        assert r.body == f.read()


def test_every_fragment_a_page_links_is_an_id_of_its_target():
    # --strict-links checks paths only; the manual's cross-references name sections too.
    ids = {}
    for name in PAGES:
        with open(os.path.join(DOCS, name), encoding="utf-8") as f:
            ids[name] = set(re.findall(r'\sid="([^"]+)"', f.read()))
    dangling = []
    for name in PAGES:
        with open(os.path.join(DOCS, name), encoding="utf-8") as f:
            for href in re.findall(r'href="([^"#:]*)#([^"]*)"', f.read()):
                target = href[0] or name
                if target in ids and href[1] not in ids[target]:
                    dangling.append(f"{name}: {href[0]}#{href[1]}")
    assert not dangling, dangling


def limit_rows() -> dict[str, tuple[str, str]]:
    """serve.html's limits table: option flag → (default, accepted range) as written."""
    with open(os.path.join(DOCS, "serve.html"), encoding="utf-8") as f:
        text = f.read()
    table = text[text.index('<table id="limits-table">'):]
    table = table[:table.index("</table>")]
    rows = {}
    for cells in re.findall(r"<tr>(.*?)</tr>", table, re.S):
        td = re.findall(r"<td[^>]*>(.*?)</td>", cells, re.S)
        if td:
            flag = re.search(r"<code>--([a-z-]+)", td[1]).group(1)
            rows[flag] = (td[2], td[3])
    return rows


def test_the_manual_states_every_limit_as_the_policy_has_it():
    # One source of truth: the limits, their defaults and ranges are core/policy.py's; the
    # hand-written table must say the same (a changed default fails here until it is updated).
    from orisha.core import policy
    rows = limit_rows()
    assert set(rows) == {limit.flag for limit in policy.LIMITS}
    for limit in policy.LIMITS:
        default, accepted = rows[limit.flag]
        assert float(default) == limit.default, limit.flag
        rng = getattr(limit, "range", None)  # the ranges of issue 34's range checks
        if rng is not None:
            low, _, high = accepted.partition("–")
            assert (float(low), float(high)) == (rng.low, rng.high), limit.flag


def test_a_link_to_a_missing_file_fails_the_strict_build(tmp_path):
    site = tmp_path / "docs"
    shutil.copytree(DOCS, site)
    page = site / "serve.html"
    text = page.read_text(encoding="utf-8")
    page.write_text(text.replace("</main>", '<p><a href="no-such-page.html">gone</a></p>\n</main>'),
                    encoding="utf-8")
    r = build(str(site), str(tmp_path / "out"))
    assert r.returncode != 0
    assert "serve.html:" in r.stderr and "broken link /no-such-page.html" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()  # nothing half-written


def readme_links() -> list[str]:
    """The targets of README.md's relative Markdown links, without their fragments."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [unquote(urlsplit(t).path) for t in targets
            if not urlsplit(t).scheme and not t.startswith(("#", "//"))]


def test_the_readme_fits_the_front_door():
    with open(README, encoding="utf-8") as f:
        n = len(f.read().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines, at most {README_MAX_LINES}"


def test_every_relative_link_of_the_readme_is_a_file_of_the_checkout():
    links = readme_links()
    assert links, "README.md links nothing: the manual's pages should be linked"
    missing = [t for t in links if not os.path.isfile(os.path.join(ROOT, t))]
    assert not missing, f"README.md links files that do not exist: {missing}"


def test_every_manual_page_the_readme_links_is_served(served):
    pages = sorted({t[len("docs/"):] for t in readme_links() if t.startswith("docs/")})
    assert "index.html" in pages and len(pages) >= len(PAGES)
    conn = Conn(served)
    try:
        for page in pages:
            r = conn.request("/" + page)
            assert r.status == 200, page
    finally:
        conn.close()


def _readme_commands() -> list[list[str]]:
    """Every ``orisha COMMAND …`` the README shows in a shell block, as words (comments,
    continuations and `&&` chains taken apart)."""
    import shlex
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    out = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|;", line.split(" #")[0]):
                words = shlex.split(part)
                if words and words[0] in ("orisha", ".venv/bin/orisha"):
                    out.append(words[1:])
    return out


def test_every_orisha_command_in_the_readme_names_options_that_exist():
    """The README's commands as written: each subcommand exists and each option it gives is
    one of that subcommand's (a renamed flag fails here, not at a newcomer's prompt)."""
    from orisha import cli
    commands = _readme_commands()
    assert len(commands) >= 8, commands
    for words in commands:
        sub = cli.main.commands.get(words[0])
        assert sub is not None, words
        known = {o for p in sub.params for o in p.opts + p.secondary_opts}
        for w in words[1:]:
            if w.startswith("--"):
                assert w.split("=")[0] in known, (words, w)


def test_the_readme_serves_the_manual_as_it_says():
    """`orisha serve docs` (the README's line): a real server on the manual's source folder,
    built into the cache first, answering the index page."""
    import subprocess
    from conftest import RUN_DIR, orisha_cmd
    proc = subprocess.Popen([*orisha_cmd(), "serve", DOCS, "--port", "0", "--workers", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=RUN_DIR)
    built = proc.stdout.readline()  # a site folder is built into the cache first, and says so
    assert built.startswith("built "), built
    s = Server(DOCS, proc=proc)
    try:
        conn = Conn(s.port)
        try:
            r = conn.request("/")
        finally:
            conn.close()
        with open(os.path.join(DOCS, "index.html"), "rb") as f:
            assert r.status == 200 and r.body == f.read()
    finally:
        assert s.stop() == 0
