"""The compiled loop bodies and their pure fallback.

setup.py builds ``orisha.loops.compiled_epoll`` and ``compiled_io_uring`` when
Cython and a C compiler are there; ``orisha.loops.load`` prefers them, and
``ORISHA_PURE=1`` makes it take the .py modules instead. The conformance and
curl suites run against both bodies (conftest ``PURE`` targets); these tests
check which one is loaded and that an install without a compiler or without
Cython still gives a working, pure server.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import DEMO, ROOT, Server, orisha
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from httpraw import Conn

from orisha import loops
from orisha.cli import loop_bodies
from orisha.compiled import H2_MODULE, compiled_core, compiled_file

BUILT = (all(importlib.util.find_spec(m) is not None
             for m in (*loops.COMPILED.values(), "orisha.protocols.compiled_h3"))
         and compiled_core() is not None and compiled_file(H2_MODULE) is not None)
# ./dev test (what CI runs) installs everything the compiled modules need, so there a module
# that did not compile fails these tests instead of skipping them (ORISHA_TEST_COMPILED);
# a developer's own venv without a compiler skips them.
needs_compiled = pytest.mark.skipif(not BUILT and not os.environ.get("ORISHA_TEST_COMPILED"),
                                    reason="compiled modules not built (pip install -e . with "
                                    "Cython, a C compiler and the libraries setup.py names)")


def _loaded(loop: str, env: dict | None = None) -> str:
    code = f"from orisha import loops; print(loops.load({loop!r}).__module__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@needs_compiled
@pytest.mark.parametrize("loop", ["epoll", "io-uring"])
def test_compiled_body_is_loaded_and_orisha_pure_loads_the_py(loop):
    if loop == "io-uring" and loops.io_uring_problem():
        pytest.skip(loops.io_uring_problem())
    assert _loaded(loop) == loops.COMPILED[loop]
    assert _loaded(loop, {**os.environ, "ORISHA_PURE": "1"}) == loops.MODULES[loop]


@needs_compiled
def test_version_says_compiled_or_pure():
    version = orisha("--version").stdout
    assert "epoll compiled" in version and "core compiled" in version
    assert "tls compiled" in version  # orisha/protocols/compiled_tls.pyx
    assert "h2 compiled" in version  # orisha/protocols/h2.py with h2.pxd
    assert "h3 compiled" in version  # orisha/protocols/compiled_h3.pyx over ngtcp2
    r = orisha("--version", env={**os.environ, "ORISHA_PURE": "1"})
    assert "epoll pure" in r.stdout and "io-uring pure" in r.stdout and "core pure" in r.stdout
    assert "tls pure" in r.stdout and "h2 pure" in r.stdout and "h3 off" in r.stdout


def _core_file(env: dict | None = None, cwd: str = ROOT) -> tuple[str, str]:
    r = subprocess.run([sys.executable, "-c", "import orisha.core.connection as c; print(c.__file__)"],
                       capture_output=True, text=True, cwd=cwd, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip(), r.stderr


@needs_compiled
def test_the_core_is_compiled_unless_orisha_pure_or_its_source_changed(tmp_path):
    """connection.py compiled with connection.pxd shadows the .py; ORISHA_PURE=1 loads the
    .py, and so does an edit made after the build (a stale .so would run old code)."""
    path, err = _core_file()
    assert path == compiled_core() and err == ""
    path, err = _core_file({**os.environ, "ORISHA_PURE": "1"})
    assert path.endswith(os.path.join("orisha", "core", "connection.py")) and err == ""
    shutil.copytree(os.path.join(ROOT, "orisha"), tmp_path / "orisha",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "orisha" / "core" / "connection.py", "a") as f:
        f.write("# an edit after the build\n")
    path, err = _core_file({**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=str(tmp_path))
    assert path == str(tmp_path / "orisha" / "core" / "connection.py")
    assert err == ("orisha: the compiled core is older than orisha/core/connection.py; using "
                   "the .py (pip install -e . rebuilds it)\n")


@needs_compiled
def test_compiled_epoll_serves_a_large_body_from_the_file(tmp_path):
    """A FileRegion (sendfile) after its head, on keep-alive, then a small response."""
    out = str(tmp_path / "o")
    assert orisha("build", DEMO, "-o", out).returncode == 0
    s = Server(out, "--loop", "epoll", "--workers", "1")
    try:
        c = Conn(s.port)
        big = open(os.path.join(DEMO, "files/big.txt"), "rb").read()
        r = c.request("/files/big.txt", headers={"Accept-Encoding": "identity"})
        assert r.status == 200 and r.body == big
        assert c.request("/").status == 200
    finally:
        assert s.stop() == 0


def _pip_install(tmp_path, env: dict) -> str:
    """``pip install`` this tree into a target folder without build isolation; the target."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "*.so", "*.c", ".pytest_cache", ".hypothesis", "__pycache__",
        "*.egg-info", "sites", "unikernel", "docs"))
    target = tmp_path / "target"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "--target", str(target), str(src)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return str(target)


def _serves_pure(target: str, tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": target}
    assert not [f for f in os.listdir(os.path.join(target, "orisha", "loops")) if f.endswith(".so")]
    out = str(tmp_path / "o")
    r = subprocess.run([sys.executable, "-m", "orisha.cli", "build", DEMO, "-o", out], env=env,
                       capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    p = subprocess.Popen([sys.executable, "-m", "orisha.cli", "serve", out, "--port", "0",
                          "--workers", "1", "--loop", "epoll"], env=env, cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    s = Server.attach(p)
    try:
        assert Conn(s.port).request("/").status == 200
    finally:
        assert s.stop() == 0
    r = subprocess.run([sys.executable, "-m", "orisha.cli", "--version"], env=env, capture_output=True,
                       text=True, cwd=tmp_path)
    assert "epoll pure" in r.stdout and "core pure" in r.stdout and "tls pure" in r.stdout, r.stdout


@pytest.mark.slow
def test_install_without_a_c_compiler_is_pure_and_works(tmp_path):
    target = _pip_install(tmp_path, {**os.environ, "CC": "false", "LDSHARED": "false"})
    _serves_pure(target, tmp_path)


@pytest.mark.slow
def test_install_without_cython_is_pure_and_works(tmp_path):
    # A Cython package that cannot be imported shadows the real one during the build.
    fake = tmp_path / "nocython" / "Cython"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no Cython here')\n")
    pythonpath = os.pathsep.join(filter(None, [str(fake.parent), os.environ.get("PYTHONPATH")]))
    target = _pip_install(tmp_path, {**os.environ, "PYTHONPATH": pythonpath})
    _serves_pure(target, tmp_path)


@pytest.mark.slow
def test_a_module_that_fails_to_compile_leaves_the_others_in_place(tmp_path):
    """An in-place build (what ``pip install -e`` runs, as ./dev does) of a tree where HTTP/3's
    module cannot compile (an ngtcp2.h that stops the compiler, found first through
    ``ORISHA_H3_INCLUDE``) still puts every other compiled module beside its source, and says
    which one was not compiled and why. Before, the failed module's missing file stopped the
    copying, and the io_uring body after it in the list was lost with it: a fresh machine
    without libngtcp2-dev installed a pure io_uring body and said so in one line."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "*.so", "*.c", ".pytest_cache", ".hypothesis", "__pycache__",
        "*.egg-info", "sites", "unikernel", "docs", "tests"))
    include = tmp_path / "include"
    for header in ("ngtcp2/ngtcp2.h", "ngtcp2/ngtcp2_crypto_gnutls.h", "nghttp3/nghttp3.h"):
        (include / header).parent.mkdir(parents=True, exist_ok=True)
        (include / header).write_text("#error not this ngtcp2\n")
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=src,
                       env={**os.environ, "ORISHA_H3_INCLUDE": str(include)},
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    built = {f.split(".")[0] for d in ("loops", "protocols", "core")
             for f in os.listdir(src / "orisha" / d) if f.endswith(".so")}
    assert built == {"compiled_epoll", "compiled_udp", "compiled_io_uring", "connection", "h2",
                     "compiled_tls"}, built
    assert re.search(r"orisha: compiled build: .*; not compiled: orisha\.protocols\.compiled_h3 "
                     r"\(compiler failed: ngtcp2 1\.x and nghttp3\?", r.stderr), r.stderr[-3000:]


def test_loops_module_names_the_pure_module_under_orisha_pure(monkeypatch):
    monkeypatch.setenv("ORISHA_PURE", "1")
    assert all(loops.module(n) == loops.MODULES[n] for n in loops.COMPILED)
    assert re.fullmatch(r"(\S+ (compiled|pure|off)(, )?)+", loop_bodies())  # h3: off or compiled


# The compiled io_uring body on older kernels' paths: single-shot accept (before 5.19),
# single-shot recv from the buffer ring (before 6.0), no buffer ring at all (before 5.19).
OLD_KERNELS = {
    "single-shot-accept": "L.multishot_accept = False",
    "single-shot-recv": "L.multishot_recv = False",
    "no-buffer-ring": "M.PROVIDED_BUFFERS = False",
}


@needs_compiled
@pytest.mark.parametrize("kernel", OLD_KERNELS)
def test_compiled_io_uring_on_older_kernels(tmp_path, kernel):
    if loops.io_uring_problem():
        pytest.skip(loops.io_uring_problem())
    out = str(tmp_path / "o")
    assert orisha("build", DEMO, "-o", out).returncode == 0
    setting = OLD_KERNELS[kernel]
    prelude = ("import orisha.loops.compiled_io_uring as M\n"
               "class L(M.Loop):\n"
               "    def __init__(self, *a):\n"
               f"        super().__init__(*a); {setting.replace('L.', 'self.')}\n"
               + ("M.PROVIDED_BUFFERS = False\n" if setting.startswith("M.") else "")
               + "M.Loop = L\n")
    p = subprocess.Popen([sys.executable, "-c", prelude + "from orisha.cli import main; main()",
                          "serve", out, "--port", "0", "--workers", "1", "--loop", "io-uring"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    s = Server.attach(p)
    try:
        big = open(os.path.join(DEMO, "files/big.txt"), "rb").read()
        for _ in range(10):  # each new connection needs the accept re-armed when single-shot
            c = Conn(s.port)
            assert c.request("/").status == 200
            assert c.request("/files/big.txt", headers={"Accept-Encoding": "identity"}).body == big
    finally:
        assert s.stop() == 0


def test_large_bodies_are_file_regions_and_small_ones_views(tmp_path):
    """orisha/blob.py: a body of REGION_MIN bytes or more is a FileRegion of the blob file
    (sliced for a 206 into a region or, when small, a view); the rest are memoryviews."""
    from orisha.blob import REGION_MIN, FileRegion
    from orisha.serving.server import load_site
    out = str(tmp_path / "o")
    assert orisha("build", DEMO, "-o", out).returncode == 0
    site = load_site(out)
    big = open(os.path.join(DEMO, "files/big.txt"), "rb").read()
    body = site.routes[b"/files/big.txt"].identity.body
    assert isinstance(body, FileRegion) and len(body) == len(big) >= REGION_MIN
    assert bytes(body) == big and os.pread(body.fd, 100, body.offset) == big[:100]
    part = body[1000:1000 + REGION_MIN]
    assert isinstance(part, FileRegion) and bytes(part) == big[1000:1000 + REGION_MIN]
    small = body[5:10]
    assert isinstance(small, memoryview) and bytes(small) == big[5:10]
    assert isinstance(site.routes[b"/index.html"].identity.body, memoryview)


def test_release_drops_the_blob_pages_from_the_process(tmp_path):
    """orisha.blob.release(): the pages a send mapped in leave this process's PSS."""
    from orisha import blob
    from orisha.serving.server import load_site

    def blob_kib() -> int:
        kib, inside = 0, False
        for line in open("/proc/self/smaps"):
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                inside = line.rstrip().endswith("site.blob")
            elif inside and line.startswith("Rss:"):
                kib += int(line.split()[1])
        return kib

    out = str(tmp_path / "o")
    assert orisha("build", DEMO, "-o", out).returncode == 0
    site = load_site(out)
    for entry in site.routes.values():
        for v in getattr(entry, "variants", ()):
            bytes(v.body)  # what a send from the map does: touches every page
    assert blob_kib() > 0
    blob.release()
    assert blob_kib() == 0


@needs_compiled
@pytest.mark.parametrize("loop", ["epoll", "epoll-pure"])
def test_the_pure_targets_serve_with_no_compiled_module(tmp_path, loop):
    """The suite's PURE targets (conftest ``Server`` with ``--loop NAME-pure``) run the .py
    loop body and core in the workers; the others the compiled ones (their maps say)."""
    out = str(tmp_path / "o")
    assert orisha("build", DEMO, "-o", out).returncode == 0
    s = Server(out, "--loop", loop, "--workers", "1")
    try:
        assert Conn(s.port).request("/").status == 200
        worker = subprocess.run(["pgrep", "-P", str(s.proc.pid)], capture_output=True,
                                text=True).stdout.split()[0]
        maps = open(f"/proc/{worker}/maps").read()
        compiled = loop == "epoll"
        assert ("compiled_epoll" in maps) == compiled
        assert ("core/connection.cpython" in maps) == compiled
    finally:
        assert s.stop() == 0


@needs_compiled
@pytest.mark.parametrize("build", ["compiled", "pure"])
def test_h2_is_served_by_the_compiled_layer_unless_orisha_pure(builds, build):
    """h2.py compiled with h2.pxd is the module that answers HTTP/2 (the worker maps it, and
    nothing else serves h2); under ORISHA_PURE=1 the .py does. Both answer curl's h2c."""
    out = builds["notfound"]
    env = {**os.environ, "ORISHA_PURE": "1"} if build == "pure" else None
    s = Server(out, "--loop", "epoll", "--workers", "1", env=env)
    try:
        r = subprocess.run(["curl", "-sS", "--http2-prior-knowledge", "-o", "/dev/null", "-w",
                            "%{http_version} %{http_code}", f"http://127.0.0.1:{s.port}/"],
                           capture_output=True, text=True, timeout=60)
        assert r.stdout == "2 200", r.stderr
        worker = subprocess.run(["pgrep", "-P", str(s.proc.pid)], capture_output=True,
                                text=True).stdout.split()[0]
        maps = open(f"/proc/{worker}/maps").read()
        assert ("protocols/h2.cpython" in maps) == (build == "compiled")
        code = "import orisha.protocols.h2 as h; print(h.__file__)"
        path = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=60).stdout.strip()
        assert path == (compiled_file(H2_MODULE) if build == "compiled" else
                        os.path.join(ROOT, "orisha", "protocols", "h2.py"))
    finally:
        assert s.stop() == 0


@needs_compiled
def test_an_edit_to_h2_py_after_the_build_runs_the_py(tmp_path):
    """A stale compiled h2 (its stamp is not h2.py's and h2.pxd's digest) is not loaded."""
    shutil.copytree(os.path.join(ROOT, "orisha"), tmp_path / "orisha",
                    ignore=shutil.ignore_patterns("__pycache__", "*.c"))
    with open(tmp_path / "orisha" / "protocols" / "h2.pxd", "a") as f:
        f.write("# an edit after the build\n")
    r = subprocess.run([sys.executable, "-c", "import orisha.protocols.h2 as h; print(h.__file__)"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.stdout.strip() == str(tmp_path / "orisha" / "protocols" / "h2.py")
    assert r.stderr == ("orisha: the compiled HTTP/2 layer is older than orisha/protocols/h2.py; "
                        "using the .py (pip install -e . rebuilds it)\n")
    # compiled_tls calls the compiled h2 in C (it cimports H2Connection): beside the .py the
    # TLS layer is the pure one, said in one more line, instead of a failed import.
    r = subprocess.run([sys.executable, "-c", "import orisha.protocols.tls as t; print(t.LAYER)"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.stdout.strip() == "pure", r.stderr
    assert r.stderr.endswith("orisha: the compiled TLS layer needs the compiled HTTP/2 layer; "
                             "using ssl.SSLObject\n"), r.stderr


def _pure_core():
    """connection.py loaded from its source beside the compiled module, under another name."""
    path = os.path.join(ROOT, "orisha", "core", "connection.py")
    spec = importlib.util.spec_from_file_location("orisha.core._connection_source", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses and NamedTuples look themselves up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def demo_site(tmp_path_factory):
    from orisha.serving.server import load_site
    out = str(tmp_path_factory.mktemp("differential") / "build")
    subprocess.run([sys.executable, "-m", "orisha.cli", "build", DEMO, "-o", out], check=True,
                   capture_output=True, cwd=ROOT, timeout=120)
    return load_site(out)


_LINES = [b"GET / HTTP/1.1\r\nHost: a\r\n", b"GET /missing HTTP/1.1\r\nHost: a\r\n",
          b"HEAD /index.html HTTP/1.1\r\nHost: a\r\nAccept-Encoding: gzip\r\n",
          b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n", b"GET / HTTP/1.0\r\n",
          b"GET / HTTP/1.1\nHost: a\n", b"\r\n", b"\r", b"\n", b"\r\n\r\n", b"X: \r\r\n",
          b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc"]


@needs_compiled
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=st.lists(st.sampled_from(_LINES) | st.binary(max_size=12), max_size=12),
       cuts=st.lists(st.integers(1, 40), max_size=8), eof=st.booleans())
def test_the_compiled_core_frames_every_stream_as_its_source_does(demo_site, parts, cuts, eof):
    """The compiled core's C helpers (connection.pxd: the end of a head by memchr, slices and
    list.clear without Python calls) against connection.py itself, on random byte streams cut
    anywhere: the same bytes out, the same close."""
    import orisha.core.connection as compiled
    assert compiled.__file__.endswith(".so")
    source = _pure_core()
    assert not source._COMPILED  # the .py: bytes.find, slices, list.clear
    site = demo_site
    stream = b"".join(parts)
    chunks, pos = [], 0
    for c in cuts:
        if pos < len(stream):
            chunks.append(stream[pos:pos + c])
            pos += c
    if pos < len(stream):
        chunks.append(stream[pos:])
    results = []
    for module in (compiled, source):
        app = module.App(site, module.Limits(pipeline=4))
        conn, out = app.connect(1_764_470_000.0), b""
        for chunk in chunks + ([b""] if eof else []):
            if conn.should_close:
                break
            conn.receive(chunk, 1_764_470_000.0)
            while conn.outgoing:
                data = b"".join(bytes(b) for b in conn.outgoing)
                out += data
                conn.sent(len(data), 1_764_470_000.0)
        results.append((out, conn.should_close, conn.shut_write, conn.buf))
    assert results[0] == results[1]

