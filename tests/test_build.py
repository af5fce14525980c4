"""The build step through the CLI: outputs, determinism and one-line errors."""

from __future__ import annotations

import filecmp
import gzip
import json
import os
import subprocess
import sys

from conftest import BUILD_ARGS, DEMO, ROOT, orisha

from orisha.embed.assemble import cache_control
from orisha.embed.mime import compressible, content_type
from orisha.serving.server import load_site


def one_line_error(r, *needles):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("orisha: error: "), r.stderr
    for n in needles:
        assert n in lines[0]


def test_build_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert orisha("build", DEMO, "-o", str(a), "--fallback", "200.html").returncode == 0
    assert orisha("build", DEMO, "-o", str(b), "--fallback", "200.html", "--no-cache").returncode == 0
    cmp = filecmp.dircmp(a, b)
    history = [] if "--no-dictionaries" in BUILD_ARGS else ["dictionaries"]  # RFC 9842's
    assert sorted(os.listdir(a)) == sorted(os.listdir(b)) == sorted(
        ["__pycache__", "manifest.json", "site.blob", "site.py", *history])
    for name in ("manifest.json", "site.blob", "site.py"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    if history:
        assert not filecmp.dircmp(a / "dictionaries", b / "dictionaries").diff_files
    pyc = os.listdir(a / "__pycache__")
    assert (a / "__pycache__" / pyc[0]).read_bytes() == (b / "__pycache__" / pyc[0]).read_bytes()
    assert not cmp.diff_files


def test_summary_and_quiet_progress(tmp_path):
    r = orisha("build", DEMO, "-o", str(tmp_path / "o"))
    assert r.returncode == 0
    assert "compressing" not in r.stdout  # no progress bar when stdout is not a terminal
    line = r.stdout.strip().splitlines()[-1]
    assert "14 files" in line and "gzip" in line and "br" in line and "zstd" in line and "s" in line


def test_progress_bar_on_a_terminal(tmp_path):
    import pty
    out = tmp_path / "o"
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(ROOT)
        os.execv(sys.executable, [sys.executable, "-m", "orisha.cli", "build", DEMO, "-o", str(out), "--no-cache"])
    data = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        data += chunk
    os.waitpid(pid, 0)
    assert b"compressing" in data and b"built" in data


def test_every_file_and_variants_kept_only_when_smaller(tmp_path):
    out = tmp_path / "o"
    assert orisha("build", DEMO, "-o", str(out)).returncode == 0
    site = load_site(str(out))
    for dirpath, _, names in os.walk(DEMO):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), DEMO)
            entry = site.routes["/{}".format(rel).encode()]
            data = open(os.path.join(DEMO, rel), "rb").read()
            assert bytes(entry.identity.body) == data
            for v in entry.variants:
                assert v.coding == b"identity" or v.length < len(data)
            codings = {v.coding for v in entry.variants}
            if rel.endswith((".png", ".woff2")) or not data:
                assert codings == {b"identity"}
            elif rel.endswith((".css", ".txt", ".html", ".js")) and len(data) > 200:
                assert codings == {b"identity", b"gzip", b"br", b"zstd"}
    big = site.routes[b"/files/big.txt"]
    gz = next(v for v in big.variants if v.coding == b"gzip")
    assert gzip.decompress(bytes(gz.body)) == open(os.path.join(DEMO, "files/big.txt"), "rb").read()


def test_mime_table():
    for name, t in {"a.html": "text/html; charset=utf-8", "a.mjs": "text/javascript; charset=utf-8",
                    "a.map": "application/json; charset=utf-8", "a.md": "text/markdown; charset=utf-8",
                    "a.csv": "text/csv; charset=utf-8", "a.xml": "application/xml; charset=utf-8",
                    "a.JPG": "image/jpeg", "a.avif": "image/avif", "a.ico": "image/x-icon",
                    "a.woff": "font/woff", "a.ttf": "font/ttf", "a.otf": "font/otf",
                    "a.wasm": "application/wasm", "a.pdf": "application/pdf", "a.mp4": "video/mp4",
                    "a.webm": "video/webm", "a.mp3": "audio/mpeg", "a.ogg": "audio/ogg",
                    "a.zip": "application/zip", "a.gz": "application/gzip", "a.gif": "image/gif",
                    "a.webp": "image/webp", "README": "application/octet-stream",
                    "a.unknown": "application/octet-stream"}.items():
        assert content_type(name) == t, name
    assert compressible("text/css; charset=utf-8") and compressible("application/wasm")
    assert not any(compressible(content_type(n)) for n in ("a.png", "a.jpg", "a.woff2", "a.zip", "a.gz", "a.mp4"))


def test_cache_control_policy_and_overrides():
    assert cache_control("a/index.html", "text/html", []) == "no-cache"
    for hashed in ("app.3f2a1b9c.js", "assets/index-B7xQ2aKp.css", "chunk.0123456789abcdef.mjs"):
        assert "immutable" in cache_control(hashed, "text/javascript", []), hashed
    for plain in ("report-2024final.pdf", "download2024.txt", "logo.svg", "a-bcdefghi.css"):
        assert cache_control(plain, "x", []) == "public, max-age=3600", plain
    assert cache_control("img/a.png", "image/png", [("img/*", "max-age=60")]) == "max-age=60"


def test_cache_control_option(tmp_path):
    out = tmp_path / "o"
    r = orisha("build", DEMO, "-o", str(out), "--cache-control", "css/*=public, max-age=60")
    assert r.returncode == 0
    assert b"Cache-Control: public, max-age=60" in load_site(str(out)).routes[b"/css/site.css"].identity.head
    one_line_error(orisha("build", DEMO, "-o", str(out), "--cache-control", "nonsense"), "--cache-control")


def test_missing_and_empty_site(tmp_path):
    one_line_error(orisha("build", str(tmp_path / "none"), "-o", str(tmp_path / "o")), "none", "no such directory")
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    one_line_error(orisha("build", str(tmp_path / "empty"), "-o", str(tmp_path / "o")), "empty", "no files")
    assert not (tmp_path / "o").exists()


def test_out_inside_site(tmp_path):
    site = tmp_path / "s"
    site.mkdir()
    (site / "a.txt").write_text("a")
    one_line_error(orisha("build", str(site), "-o", str(site / "out")), "inside the site")
    assert not (site / "out").exists()


def test_unreadable_file_fails_and_keeps_the_old_output():
    import shutil
    import tempfile
    base = tempfile.mkdtemp()  # outside pytest's private (0700) tmp tree, so another user can enter it
    try:
        os.chmod(base, 0o777)
        site = os.path.join(base, "s")
        os.mkdir(site)
        open(os.path.join(site, "a.txt"), "w").write("hello")
        open(os.path.join(site, "secret.txt"), "w").write("no")
        out = os.path.join(base, "o")
        assert orisha("build", site, "-o", out).returncode == 0
        before = open(os.path.join(out, "site.py"), "rb").read()
        os.chmod(os.path.join(site, "secret.txt"), 0)
        os.chmod(out, 0o777)
        # root reads anything: import as root, then drop to an unprivileged user and build
        code = ("import os, sys, difflib, gettext; from orisha import cli; import orisha.embed.build; os.setgroups([]); os.setgid(65534); "
                "os.setuid(65534); sys.argv = ['orisha', 'build', sys.argv[1], '-o', sys.argv[2]]; cli.main()")
        r = subprocess.run([sys.executable, "-c", code, site, out], capture_output=True, text=True,
                           cwd=ROOT, env={**os.environ, "ORISHA_CACHE": os.path.join(base, "c")})
        one_line_error(r, "secret.txt", "not readable")
        assert open(os.path.join(out, "site.py"), "rb").read() == before
        assert not [p for p in os.listdir(base) if p.startswith(".orisha")]
    finally:
        shutil.rmtree(base)


def test_refuses_to_replace_a_non_build(tmp_path):
    site = tmp_path / "s"
    site.mkdir()
    (site / "a.txt").write_text("a")
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    one_line_error(orisha("build", str(site), "-o", str(precious)), "precious", "not an Orisha build")
    assert (precious / "thesis.tex").read_text() == "years of work"


def test_symlinks(tmp_path, capfd):
    site = tmp_path / "s"
    (site / "d").mkdir(parents=True)
    (site / "d" / "real.txt").write_text("inside")
    (tmp_path / "outside.txt").write_text("outside")
    os.symlink(site / "d" / "real.txt", site / "link.txt")
    os.symlink(site / "d", site / "dlink")
    os.symlink(tmp_path / "outside.txt", site / "escape.txt")
    os.symlink(site, site / "d" / "loop")
    out = tmp_path / "o"
    r = orisha("build", str(site), "-o", str(out), "--symlinks", "inside")  # default: follow
    assert r.returncode == 0, r.stderr
    assert "escape.txt" in r.stderr and "outside the site root" in r.stderr
    routes = load_site(str(out)).routes
    assert bytes(routes[b"/link.txt"].identity.body) == b"inside"
    assert bytes(routes[b"/dlink/real.txt"].identity.body) == b"inside"
    assert b"/escape.txt" not in routes


def test_fallback_must_exist(tmp_path):
    one_line_error(orisha("build", DEMO, "-o", str(tmp_path / "o"), "--fallback", "nope.html"), "nope.html")


def small_site(tmp_path, text: str = "a"):
    """A one-file site (a.txt) and where its build goes."""
    site = tmp_path / "s"
    site.mkdir()
    (site / "a.txt").write_text(text)
    return site, tmp_path / "o"


def test_rebuild_replaces_output(tmp_path):
    site, out = small_site(tmp_path, "one")
    assert orisha("build", str(site), "-o", str(out)).returncode == 0
    (site / "a.txt").write_text("two")
    assert orisha("build", str(site), "-o", str(out)).returncode == 0
    assert bytes(load_site(str(out)).routes[b"/a.txt"].identity.body) == b"two"
    assert json.load(open(out / "manifest.json"))["files"] == 1


def test_builtin_404(tmp_path):
    site, out = small_site(tmp_path)
    assert orisha("build", str(site), "-o", str(out)).returncode == 0
    nf = load_site(str(out)).not_found.identity
    assert nf.head.startswith(b"HTTP/1.1 404 Not Found\r\n") and b"404" in bytes(nf.body)
