"""Orisha installed the way Python tools are installed (issue 25): from the sdist and its
wheel, into fresh virtualenvs outside the checkout, on Python 3.11, 3.12 and 3.13.

The module's fixtures do what a user and PyPI do, once per Python: a clone of the
checkout's HEAD (so only committed files count), its sdist (setuptools' PEP 517 hook),
and a wheel built from that sdist with ``pip wheel --no-build-isolation --no-deps`` — the
``python -m build`` sequence, so a file the sdist forgot breaks the wheel too. 3.11
builds with the suite's own venv (Cython, liburing); 3.12 and 3.13 in a venv of
pyenv's interpreter with setuptools, Cython and Orisha's dependencies, which then
runs the wheel too (liburing 2024.5.3 has no wheel there: that body is not compiled,
and the build says so). The three builds run at once.

Every command then runs the installed ``orisha`` with the working directory outside the
checkout and no ``ORISHA_UNIKERNEL``: the compiled core loads with no warning, the demo
site builds and answers a GET on a hosted loop, an image builds (sources from the wheel,
objects and lwIP in ``$ORISHA_CACHE``) and boots under QEMU, the container executable
builds and ``docker build OUT`` makes an image that answers. ``pipx`` installs the same
wheel; the sdist in a venv without Cython installs pure, with its one line saying so.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import tomllib
import zipfile

import pytest
from conftest import DEMO, ROOT, Server
from httpraw import Conn
from tlsutil import pki  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow

PYENV = os.path.expanduser(os.environ.get("PYENV_ROOT", "~/.pyenv"))
# The interpreters the wheel is built for; 3.11 is the suite's own (.venv's base).
OTHER_PYTHONS = {"3.12": os.path.join(PYENV, "versions", "3.12.1", "bin", "python"),
                 "3.13": os.path.join(PYENV, "versions", "3.13.0", "bin", "python")}
BUILD_DEPS = ["setuptools>=68", "Cython>=3.0"]
with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    RUN_DEPS = tomllib.load(f)["project"]["dependencies"]  # what `pip install orisha` pulls
PIP = ["-m", "pip", "--disable-pip-version-check"]
TIMEOUT = 900


def run(cmd: list[str], cwd: str, env: dict | None = None, check: bool = True,
        timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, env=env or user_env(), capture_output=True, text=True,
                       timeout=timeout)
    if check and r.returncode:
        raise AssertionError(f"{' '.join(cmd[:4])}… failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def user_env() -> dict:
    """A user's environment: nothing pointing into the checkout. ``ORISHA_CACHE`` stays
    (conftest: the suite's cache, so lwIP is fetched and the container frozen once)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "ORISHA_UNIKERNEL", "ORISHA_PURE", "VIRTUAL_ENV")}
    return env


def venv(python: str, where: str, *packages: str) -> str:
    """A fresh virtualenv of ``python`` with ``packages``; its python."""
    run([python, "-m", "venv", where], cwd=os.path.dirname(where))
    py = os.path.join(where, "bin", "python")
    if packages:
        run([py, *PIP, "install", "-q", *packages], cwd=where)
    return py


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("wheel")


@pytest.fixture(scope="module")
def sdist(work) -> str:
    clone = str(work / "clone")
    run(["git", "clone", "-q", "--no-hardlinks", ROOT, clone], cwd=str(work))
    dist = str(work / "dist")
    r = run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
             "print(b.build_sdist(sys.argv[1]))", dist], cwd=clone)
    return os.path.join(dist, r.stdout.strip().splitlines()[-1])


class Steps:
    """The module's installs, run at once in threads (pip and the compilers of three builds,
    pipx and the pure install overlap): each step's result, or the error its tests report."""

    def __init__(self) -> None:
        self.results: dict[str, object] = {}
        self.errors: dict[str, str] = {}
        self.threads: list[threading.Thread] = []

    def start(self, name: str, fn, *args) -> None:
        def step() -> None:
            try:
                self.results[name] = fn(*args)
            except (AssertionError, OSError, subprocess.TimeoutExpired) as e:
                self.errors[name] = f"{name}: {e}"
        self.threads.append(threading.Thread(target=step))
        self.threads[-1].start()

    def join(self) -> "Steps":
        for t in self.threads:
            t.join()
        return self

    def __getitem__(self, name: str):
        if name not in self.results:
            pytest.fail(self.errors.get(name, f"{name}: not run"), pytrace=False)
        return self.results[name]


def build_wheel(py: str, work, version: str, sdist: str) -> tuple[str, str]:
    """(wheel, the build's output) of ``py`` from the sdist."""
    dest = str(work / f"wheels-{version}")
    # -v: setup.py's summary line ("orisha: compiled build: ...") is in pip's output
    r = run([py, *PIP, "wheel", "-v", "--no-build-isolation", "--no-deps", "-w", dest, sdist],
            cwd=str(work))
    (name,) = os.listdir(dest)
    return os.path.join(dest, name), r.stdout + r.stderr


def wheel_and_pipx(work, sdist: str) -> tuple[str, str, str]:
    """3.11 (the suite's venv builds): the wheel, then ``pipx install`` of it with the
    container extra — pipx makes the fresh virtualenv, one install for the pipx check and the
    targets' tests. (wheel, build output, the pipx venv's bin/ folder)."""
    wheel, log = build_wheel(sys.executable, work, "3.11", sdist)
    assert shutil.which("pipx"), "pipx is not installed (./dev test installs Debian's pipx)"
    base = getattr(sys, "_base_executable", sys.executable)  # the wheel's Python (3.11)
    run(["pipx", "install", "--python", base, f"{wheel}[container]"], cwd=str(work),
        env=pipx_env(work))
    bin_dir = str(work / "pipx" / "venvs" / "orisha" / "bin")
    assert os.path.realpath(str(work / "bin" / "orisha")) == os.path.join(bin_dir, "orisha")
    return wheel, log, bin_dir


def wheel_in_venv(work, version: str, python: str, sdist: str) -> tuple:
    """3.12/3.13: one venv builds the wheel (setuptools, Cython, Orisha's dependencies) and
    then has it installed; the suite's subset then starts against it, in the background.
    (wheel, build output, the venv's python, the Subset)."""
    py = venv(python, str(work / f"venv-{version}"), *BUILD_DEPS, *RUN_DEPS)
    wheel, log = build_wheel(py, work, version, sdist)
    run([py, *PIP, "install", "-q", "--no-deps", wheel], cwd=str(work))
    return wheel, log, py, Subset(work, version, py)


def pure_from_sdist(work, sdist: str) -> tuple[str, str]:
    """The sdist in a venv without Cython: (its python, pip's output)."""
    base = getattr(sys, "_base_executable", sys.executable)
    py = venv(base, str(work / "venv-pure"), "setuptools>=68")
    assert run([py, "-c", "import importlib.util as u; print(u.find_spec('Cython'))"],
               cwd=str(work)).stdout.strip() == "None"
    r = run([py, *PIP, "install", "-v", "--no-build-isolation", sdist], cwd=str(work))
    return py, r.stdout + r.stderr


def pipx_env(work) -> dict:
    return {**user_env(), "PIPX_HOME": str(work / "pipx"), "PIPX_BIN_DIR": str(work / "bin")}


# The suite's conformance and TLS parts on one hosted loop (the compiled epoll body, the
# compiled core and TLS layer): every test of theirs parametrised by it.
SUBSET = ["tests/test_conformance.py", "tests/test_tls.py", "-k", "epoll and not pure"]


class Subset:
    """SUBSET as a pytest of the suite's venv whose servers and builds run ``py``'s installed
    Orisha (conftest's ORISHA_TEST_PYTHON) from a folder outside the checkout; started as
    soon as the wheel is installed, so it runs beside the module's other tests. Its own
    session (a process group): stopped with its servers whatever happens."""

    def __init__(self, work, version: str, py: str) -> None:
        self.dir = work / f"subset-{version}"
        self.dir.mkdir()
        self.mapped = self.dir / "mapped"
        self.out = self.dir / "pytest.log"
        env = {**user_env(), "ORISHA_TEST_PYTHON": py, "ORISHA_TEST_CWD": str(self.dir),
               "ORISHA_TEST_MODULES": str(self.mapped)}
        with open(self.out, "w") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 f"--basetemp={self.dir / 'tmp'}", *SUBSET], cwd=ROOT, env=env, stdout=f,
                stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self) -> tuple[int, str]:
        try:
            code = self.proc.wait(TIMEOUT)
        finally:
            self.stop()
        return code, self.out.read_text()

    def stop(self) -> None:
        for sig, grace in ((signal.SIGINT, 60), (signal.SIGKILL, 10)):  # SIGINT: its teardown
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, sig)
                try:
                    self.proc.wait(grace)
                except subprocess.TimeoutExpired:
                    pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # a server it left behind
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def steps(work, sdist):
    s = Steps()
    s.start("3.11", wheel_and_pipx, work, sdist)
    for version, python in OTHER_PYTHONS.items():
        s.start(version, wheel_in_venv, work, version, python, sdist)
    s.start("pure", pure_from_sdist, work, sdist)
    try:
        yield s.join()
    finally:
        for v in OTHER_PYTHONS:
            if v in s.results:
                s.results[v][3].stop()


@pytest.fixture(scope="module")
def wheels(steps) -> dict[str, tuple[str, str]]:
    """Python version → (wheel, the build's output)."""
    return {v: steps[v][:2] for v in ("3.11", *OTHER_PYTHONS)}


@pytest.fixture(scope="module")
def installed(steps) -> str:
    """The pipx venv's bin/ folder (3.11 wheel, container extra)."""
    return steps["3.11"][2]


def orisha_version(exe: str, cwd: str) -> str:
    r = run([exe, "--version"], cwd=cwd)
    assert r.stderr == "", r.stderr  # no stale-core warning, nothing else
    return r.stdout


def serve_and_get(exe: str, out: str, cwd: str, *args: str) -> None:
    p = subprocess.Popen([exe, "serve", out, "--port", "0", "--workers", "1", *args], cwd=cwd,
                         env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    s = Server.attach(p)
    try:
        r = Conn(s.port).request("/", headers={"Accept-Encoding": "identity"})
        assert r.status == 200
        with open(os.path.join(DEMO, "index.html"), "rb") as f:
            assert r.body == f.read()
    finally:
        assert s.stop() == 0


# The hand-written C under orisha/ (the image's /init; HTTP/3 on ngtcp2's plain-C half);
# every other .c there is Cython's output, which neither the sdist nor the wheel carries.
CONTAINER_INIT = "orisha/targets/container/init.c"
H3_C = ("orisha/protocols/h3_quic.c", "orisha/protocols/h3_quic.h")


def test_the_sdist_holds_the_sources_and_no_build_output(sdist):
    with tarfile.open(sdist) as t:
        names = [n.split("/", 1)[1] for n in t.getnames() if "/" in n]
    for needed in ("Dockerfile", "unikernel/build.sh", "unikernel/Makefile", "unikernel/src/core.c",
                   "unikernel/mbedtls/orisha_config.h", "orisha/core/connection.pxd",
                   "orisha/loops/compiled_epoll.pyx", "orisha/loops/compiled_io_uring.pyx",
                   "orisha/protocols/compiled_tls.pyx", "orisha/protocols/compiled_tls.pxd",
                   "orisha/protocols/compiled_h3.pyx", CONTAINER_INIT, *H3_C):
        assert needed in names, needed
    leftovers = [n for n in names if n.endswith((".so", ".o", ".sources")) or "/.cache/" in n
                 or (n.startswith("orisha/") and n.endswith(".c")
                     and n not in (CONTAINER_INIT, *H3_C))]
    assert leftovers == []


def test_the_wheel_carries_the_compiled_core_its_stamp_and_the_targets_files(wheels):
    wheel, log = wheels["3.11"]
    names = zipfile.ZipFile(wheel).namelist()
    assert any(re.fullmatch(r"orisha/core/connection\.cpython-311-.*\.so", n) for n in names)
    assert any(re.fullmatch(r"orisha/protocols/compiled_tls\.cpython-311-.*\.so", n) for n in names)
    assert "orisha/core/connection.sources" in names
    assert "orisha/targets/container/Dockerfile" in names and CONTAINER_INIT in names
    for f in ("build.sh", "fetch-lwip.sh", "fetch-mbedtls.sh", "Makefile", "src/core.c",
              "port/lwipopts.h", "mbedtls/orisha_config.h"):
        assert f"orisha/targets/unikernel/tree/{f}" in names, f
    assert not [n for n in names if "/tree/build/" in n or "/tree/.cache/" in n]
    assert re.search(r"orisha: compiled build: .*orisha\.core\.connection", log)


def test_installed_wheel_runs_the_compiled_core_silently(installed, work, tmp_path):
    exe = str(work / "bin" / "orisha")  # pipx's link, the command a user runs
    assert "epoll compiled, io-uring compiled, core compiled, tls compiled" in \
        orisha_version(exe, str(tmp_path))
    r = run([os.path.join(installed, "python"), "-c",
             "import orisha.core.connection as c; print(c.__file__)"], cwd=str(tmp_path))
    assert r.stdout.strip().endswith(".so") and "site-packages" in r.stdout and r.stderr == ""


def test_installed_wheel_builds_and_serves_the_demo(installed, tmp_path):
    exe = os.path.join(installed, "orisha")
    out = str(tmp_path / "out")
    run([exe, "build", DEMO, "-o", out], cwd=str(tmp_path))
    serve_and_get(exe, out, str(tmp_path), "--loop", "epoll")


# HTTP/3's libraries, which setup.py links into compiled_h3 from their static archives, by
# soname prefix.
H3_LINKED = ("libngtcp2.so.", "libngtcp2_crypto_gnutls.so.", "libnghttp3.so.")


def _system_h3_copies() -> list[str]:
    """The system's own shared copies of those libraries (``ldconfig -p``), resolved."""
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    found = {os.path.realpath(line.split(" => ")[1].strip()) for line in out.splitlines()
             if " => " in line and line.strip().startswith(H3_LINKED)}
    return sorted(found)


def test_the_installed_wheel_serves_http3_without_the_systems_ngtcp2(installed, tmp_path, pki):
    """compiled_h3 has ngtcp2, its GnuTLS helper and nghttp3 (bookworm-backports', which a
    Debian 12 without that suite lacks) linked in statically: it names none of them as a
    library it needs, and with the system's copies hidden — each bound over by an empty
    file in a mount namespace of this test's own — the installed orisha still says ``h3
    compiled`` and answers a page over HTTP/3, byte-identical, while the hiding is checked
    to work (loading a system copy fails)."""
    from test_h3 import h3_get
    exe = os.path.join(installed, "orisha")
    python = os.path.join(installed, "python")
    module = run([python, "-c", "import importlib.util as u; "
                  "print(u.find_spec('orisha.protocols.compiled_h3').origin)"],
                 cwd=str(tmp_path)).stdout.strip()
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]",
                        run(["readelf", "-d", module], cwd=str(tmp_path)).stdout)
    assert "libc.so.6" in needed and any(n.startswith("libgnutls.so.") for n in needed), needed
    assert not [n for n in needed if n.startswith(H3_LINKED)], needed
    hidden = _system_h3_copies()  # every version the system has (bookworm's own too)
    assert hidden, "the system has no shared ngtcp2 or nghttp3 to hide: the test shows nothing"
    out = str(tmp_path / "out")
    run([exe, "build", DEMO, "-o", out], cwd=str(tmp_path))
    hide = "; ".join(f"mount --bind /dev/null {p}" for p in hidden)
    wrap = ["unshare", "-m", "--propagation", "private", "sh", "-c", f'{hide}; exec "$@"', "sh"]
    probe = run(wrap + [python, "-c", "import ctypes, sys\nfor name in sys.argv[1:]:\n"
                        "    try:\n        ctypes.CDLL(name)\n    except OSError:\n"
                        "        print('hidden', name)", *hidden], cwd=str(tmp_path))
    assert probe.stdout.split() == [w for n in hidden for w in ("hidden", n)], probe
    assert "h3 compiled" in run(wrap + [exe, "--version"], cwd=str(tmp_path)).stdout
    p = subprocess.Popen(wrap + [exe, "serve", out, "--port", "0", "--host", "127.0.0.1",
                                 "--workers", "1", "--tls-cert", pki.chain, "--tls-key", pki.key],
                         cwd=str(tmp_path), env=user_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        m = re.search(r"https://127\.0\.0\.1:(\d+)/ .*HTTP/3 on udp", line)
        assert m, (line, p.stderr.read() if p.poll() is not None else "")
        got = h3_get(int(m[1]), pki.ca, [("/", "GET", [("accept-encoding", "identity")])])
        with open(os.path.join(DEMO, "index.html"), "rb") as f:
            assert (got[0][0], got[0][2]) == (200, f.read())
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0


def _stamp(objdir: str, name: str) -> str:
    try:
        with open(os.path.join(objdir, name)) as f:
            return f.read().strip()
    except OSError:
        return ""


def test_installed_wheel_builds_and_boots_a_unikernel_image(installed, tmp_path):
    from orisha.targets.unikernel.kernel import DIGEST, build_dirs, tree_digest, tree_files
    exe = os.path.join(installed, "orisha")
    out = str(tmp_path / "out")
    (src,) = glob.glob(os.path.join(os.path.dirname(installed), "lib", "python3*", "site-packages",
                                    "orisha", "targets", "unikernel", "tree"))
    checkout = os.path.join(ROOT, "unikernel")
    digest = tree_digest(src, tree_files(src))
    # The checkout's object folder, when this run's cache has one built from these very
    # sources (a committed checkout: the wheel's copy is byte for byte its unikernel/), is
    # the installed tree's start: its lwIP objects are copied, not compiled again.
    donor = build_dirs(checkout)[0]
    lwip = sorted(glob.glob(os.path.join(donor, "lwip", "**", "*.o"), recursive=True))
    before = {os.path.relpath(f, donor): os.stat(f).st_mtime_ns for f in lwip}
    shared = bool(before) and _stamp(donor, DIGEST) == digest == tree_digest(
        checkout, tree_files(checkout))
    run([exe, "build", DEMO, "-o", out, "--target", "unikernel"], cwd=str(tmp_path))
    objdir = build_dirs(src)[0]
    assert _stamp(objdir, DIGEST) == digest
    if shared:
        assert {r: os.stat(os.path.join(objdir, r)).st_mtime_ns for r in before} == before
    # Nothing written beside the installed sources: objects and lwIP are in the cache.
    tree = [os.path.join(d, n) for d, _, ns in os.walk(src) for n in ns]
    assert os.path.join(src, "build.sh") in tree
    assert not [f for f in tree if f.endswith(".o") or "/lwip-" in f or "/build/" in f]
    p = subprocess.Popen([exe, "boot", out, "--port", "0"], cwd=str(tmp_path), env=user_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    drain = threading.Thread(target=lambda: log.extend(p.stderr), daemon=True)
    drain.start()  # the serial console streams to stderr while the VM runs
    try:
        s = Server.attach(p)
        r = Conn(s.port).request("/", headers={"Accept-Encoding": "identity"})
        assert r.status == 200, "".join(log)
    finally:
        if p.poll() is None:
            p.terminate()
        p.wait(20)
        # This venv's kernel objects (per source tree) are of no use to a later run.
        shutil.rmtree(build_dirs(src)[0], ignore_errors=True)


def test_installed_wheel_builds_the_container_and_docker_builds_out(installed, tmp_path):
    from container_target import docker, ensure_docker, wait_answering
    ensure_docker()
    exe = os.path.join(installed, "orisha")
    out = str(tmp_path / "out")
    run([exe, "build", DEMO, "-o", out, "--target", "container", "--loop", "epoll"],
        cwd=str(tmp_path))
    with open(os.path.join(ROOT, "Dockerfile")) as a, open(os.path.join(out, "Dockerfile")) as b:
        assert a.read() == b.read()  # the repository's one Dockerfile, carried by the wheel
    tag = f"orisha-wheel-test:{os.getpid()}"
    docker("build", "-q", "-t", tag, out)  # no -f: OUT/Dockerfile
    container = None
    try:
        container = docker("run", "-d", "-p", "127.0.0.1::8080", tag).stdout.strip()
        port = int(docker("port", container, "8080/tcp").stdout.splitlines()[0].rsplit(":", 1)[1])
        # The executable unpacks into /tmp before it listens (docker-proxy accepts and closes
        # meanwhile): wait for its first answer, or its exit.
        wait_answering(container, port)
        assert Conn(port, timeout=60).request("/").status == 200
    finally:
        if container:
            docker("rm", "-f", container, check=False)
        docker("rmi", "-f", tag, check=False)


def test_the_sdist_without_cython_installs_pure_and_says_so(steps, tmp_path):
    py, log = steps["pure"]
    assert "orisha: pure-Python build (Cython not installed)" in log
    exe = os.path.join(os.path.dirname(py), "orisha")
    assert "epoll pure, io-uring pure, core pure" in orisha_version(exe, str(tmp_path))


@pytest.mark.parametrize("version", list(OTHER_PYTHONS))
def test_the_wheel_on_newer_pythons(steps, version, tmp_path):
    """3.12 and 3.13: compiled (io_uring's body only where liburing 2024.5.3 exists), the
    demo builds and is served, and the kTLS probe reports the kernel, not the Python."""
    wheel, log, py, _ = steps[version]
    assert f"cp{version.replace('.', '')}" in os.path.basename(wheel)
    assert "not compiled: orisha.loops.compiled_io_uring (liburing not installed)" in log
    exe = os.path.join(os.path.dirname(py), "orisha")
    assert "epoll compiled, io-uring pure, core compiled, tls compiled" in \
        orisha_version(exe, str(tmp_path))
    out = str(tmp_path / "out")
    run([exe, "build", DEMO, "-o", out], cwd=str(tmp_path))
    serve_and_get(exe, out, str(tmp_path))  # auto: epoll, liburing being absent
    probe = run([py, "-c", "from orisha.protocols.tls import probe_ktls; print(probe_ktls())"],
                cwd=str(tmp_path)).stdout
    assert probe.startswith("kTLS off: ") and "OP_ENABLE_KTLS" not in probe, probe


@pytest.mark.parametrize("version", list(OTHER_PYTHONS))
def test_the_suites_conformance_and_tls_parts_pass_on_the_installed_wheel(steps, version):
    """Each server of those tests is checked (conftest.check_installed) to have mapped its
    compiled modules from the venv's site-packages; they are listed here."""
    _, _, py, subset = steps[version]
    code, out = subset.wait()
    assert code == 0, out[-8000:]
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 100 and " failed" not in out, out[-3000:]
    tmp = subset.dir
    site = run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['platlib'])"],
               cwd=str(tmp)).stdout.strip()
    mods = set(subset.mapped.read_text().split())
    tag = f"cpython-{version.replace('.', '')}"
    for m in ("orisha/core/connection", "orisha/loops/compiled_epoll",
              "orisha/protocols/compiled_tls"):
        assert any(p.startswith(f"{site}/{m}.{tag}-") for p in mods), (m, mods)
    assert all(p.startswith(site + "/") for p in mods), mods
