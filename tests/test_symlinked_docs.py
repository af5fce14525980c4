"""Debian's HTML documentation, whose scripts are symlinks out of its root, served whole.

Debian's ``dh_sphinxdoc`` replaces each Sphinx build's ``_static/jquery.js``,
``underscore.js``, ``doctools.js``… with symlinks into
``/usr/share/javascript/`` (issue 13). ``python-panoramisk-doc`` (28 files,
~0.5 MB) is such a tree. Built with the default ``--symlinks follow`` every
file is served byte-identical in every encoding, and headless Chromium loads
its pages with no failed request, no 4xx/5xx and no script error; built with
``--symlinks inside`` the scripts are missing and the browser check says so
(the failure this test guards against). ``./dev test`` installs both packages.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from browser import chromium, load_pages
from conftest import LOOPS, ROOT, Server, orisha
from test_real_site import check_every_file, site_files

from orisha.serving.server import load_site

DOCS = "/usr/share/doc/python-panoramisk-doc/html"
PAGES = ["index.html", "manager.html", "actions.html", "fast_agi.html", "genindex.html", "search.html"]

needs_docs = pytest.mark.skipif(not os.path.isdir(DOCS),
                                reason="apt-get install python-panoramisk-doc (./dev test does)")
needs_browser = pytest.mark.skipif(chromium() is None, reason="apt-get install chromium (./dev test does)")


def _build(tmp_path_factory, *opts: str) -> str:
    out = str(tmp_path_factory.mktemp("docs") / "out")
    r = orisha("build", DOCS, "-o", out, *opts)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def docs_build(tmp_path_factory):
    return _build(tmp_path_factory)


@needs_docs
def test_the_tree_links_its_scripts_out_of_its_root():
    links = {rel for rel in site_files(DOCS) if os.path.islink(os.path.join(DOCS, rel))}
    assert "_static/jquery.js" in links and "_static/underscore.js" in links
    real = os.path.realpath(os.path.join(DOCS, "_static/jquery.js"))
    assert real.startswith("/usr/share/javascript/")


@needs_docs
@pytest.mark.parametrize("loop", LOOPS)
def test_every_file_byte_identical_in_every_encoding(docs_build, loop):
    site = load_site(docs_build)
    s = Server(docs_build, "--loop", loop, "--workers", "2")
    try:
        check_every_file(s.port, site, DOCS)
    finally:
        s.stop()


@needs_docs
@needs_browser
def test_browser_loads_pages_without_errors(docs_build):
    s = Server(docs_build, "--loop", "epoll", "--workers", "2")
    try:
        # The front page shows CI badges from other hosts: this machine has no network.
        results = load_pages([f"http://127.0.0.1:{s.port}/{p}" for p in PAGES], timeout=20,
                             same_origin=True)
    finally:
        s.stop()
    assert [r.url.rsplit("/", 1)[1] for r in results if r.loaded] == PAGES
    assert [p for r in results for p in r.problems] == []


@needs_docs
@needs_browser
def test_without_the_links_the_browser_sees_the_missing_scripts(tmp_path_factory):
    inside = _build(tmp_path_factory, "--symlinks", "inside")
    s = Server(inside, "--loop", "epoll", "--workers", "1")
    try:
        r, = load_pages([f"http://127.0.0.1:{s.port}/manager.html"], timeout=20, same_origin=True)
    finally:
        s.stop()
    assert r.loaded
    assert any(p.endswith("/_static/jquery.js") and p.startswith("404 ") for p in r.bad_responses)
    assert any("/_static/underscore.js" in p for p in r.failed_requests)


# -- the walk itself ---------------------------------------------------------------------------

def test_links_are_followed_wherever_they_point_and_the_walk_ends(tmp_path):
    site, elsewhere = tmp_path / "s", tmp_path / "elsewhere"
    (site / "d").mkdir(parents=True)
    (elsewhere / "lib").mkdir(parents=True)
    (site / "index.html").write_text("<p>home")
    (elsewhere / "lib" / "app.js").write_text("let x = 1;")
    (elsewhere / "one.css").write_text("p{}")
    os.symlink(elsewhere / "one.css", site / "one.css")            # a file outside
    os.symlink(elsewhere / "lib", site / "lib")                     # a directory outside
    os.symlink(site, elsewhere / "lib" / "back")                    # ...that leads back: a cycle
    os.symlink(site / "d", site / "d" / "self")                     # a directory inside itself
    os.symlink(tmp_path / "gone", site / "broken.txt")
    out = tmp_path / "o"
    r = orisha("build", str(site), "-o", str(out))
    assert r.returncode == 0, r.stderr
    warnings = r.stderr.strip().splitlines()
    assert all(w.startswith("orisha: warning: ") for w in warnings)
    assert any("broken.txt: broken symlink, skipped" in w for w in warnings)
    assert any("lib/back: directory symlink loop, skipped" in w for w in warnings)
    assert any("d/self: directory symlink loop, skipped" in w for w in warnings)
    routes = load_site(str(out)).routes
    assert bytes(routes[b"/one.css"].identity.body) == b"p{}"
    assert bytes(routes[b"/lib/app.js"].identity.body) == b"let x = 1;"
    assert b"/broken.txt" not in routes
    r = orisha("build", str(site), "-o", str(tmp_path / "o2"), "--symlinks", "inside")
    assert r.returncode == 0 and "one.css: symlink points outside the site root" in r.stderr
    assert b"/one.css" not in load_site(str(tmp_path / "o2")).routes


def test_unreadable_link_target_is_skipped_with_a_warning(tmp_path):
    """As root the build runs without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH (setpriv drops them
    from the bounding set), so a mode-0 file is unreadable to it as to anyone else."""
    site = tmp_path / "s"
    site.mkdir()
    (site / "index.html").write_text("x")
    secret = tmp_path / "secret.txt"
    secret.write_text("no")
    secret.chmod(0)
    os.symlink(secret, site / "secret.txt")
    argv = [sys.executable, "-m", "orisha.cli", "build", str(site), "-o", str(tmp_path / "o")]
    if os.geteuid() == 0:
        argv = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *argv]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and "secret.txt is not readable, skipped" in r.stderr, r.stderr
    assert b"/secret.txt" not in load_site(str(tmp_path / "o")).routes


# -- the same tree from the container and the booted image ------------------------------------

@pytest.fixture(scope="module", params=["container", "unikernel"])
def packaged(request):
    """The docs served by the FROM-scratch container or the booted unikernel image: a port
    and the build whose Python module holds the expected responses."""
    if request.param == "container":
        import container_target
        out, tag = container_target.build(DOCS, [])
        served = container_target.Container(tag, ["--workers", "2"])
        try:
            yield served.port, out
        finally:
            served.stop(check=False)
            served.kill()
    else:
        import unikernel_target
        served = unikernel_target.boot(DOCS, [], [])
        try:
            yield served.port, os.path.join(served.tmp, "out")
        finally:
            served.stop()


@needs_docs
@needs_browser
def test_docs_from_the_container_and_the_image(packaged):
    port, out = packaged
    check_every_file(port, load_site(out), DOCS)
    results = load_pages([f"http://127.0.0.1:{port}/{p}" for p in PAGES], timeout=30,
                         same_origin=True)
    assert [r.url.rsplit("/", 1)[1] for r in results if r.loaded] == PAGES
    assert [p for r in results for p in r.problems] == []
