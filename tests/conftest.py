"""Fixtures: builds of the demo site and servers started per loop body.

Every server the suite talks to is a real process on a real loopback socket:
`orisha serve` per loop, and (when their issues land) the container and the
booted unikernel image. ``TARGETS`` lists them; test ids carry the name.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "sites", "demo")
sys.path.insert(0, os.path.dirname(__file__))

LOOPS = ["epoll", "io-uring", "kqueue", "asyncio"]
# The pure-Python bodies of the loops that also have a compiled one (setup.py), served with
# ORISHA_PURE=1: the conformance and curl suites run against both bodies; the slower suites
# (reliability, real site, supervisor) use LOOPS, i.e. the compiled body where it is built.
PURE = ["epoll-pure", "io-uring-pure"]
# Every server the conformance suite runs against: the loops, and the packaged targets.
# "unikernel-2cpu": the same image booted with --cpus 2 (core 0 polls QEMU's user networking
# and hands each connection's frames to its core): the conformance suites on both cores.
UNIKERNELS = {"unikernel": [], "unikernel-2cpu": ["--cpus", "2"]}
TARGETS = LOOPS + PURE + ["container", *UNIKERNELS]
TESTS = os.path.dirname(os.path.abspath(__file__))
# ORISHA_TEST_PYTHON: the interpreter of an installed Orisha (a wheel in a venv) that every
# server and build runs instead of the checkout's; from a folder outside the checkout, so
# `python -m orisha.cli` cannot import the checkout's package (tests/test_wheel.py).
PYTHON = os.environ.get("ORISHA_TEST_PYTHON") or sys.executable
INSTALLED = PYTHON != sys.executable
RUN_DIR = os.environ.get("ORISHA_TEST_CWD") or (tempfile.mkdtemp(prefix="orisha-run-")
                                                  if INSTALLED else ROOT)

# One compression cache for the whole run (builds of the same bytes reuse it), never the user's.
os.environ.setdefault("ORISHA_CACHE", os.path.join(ROOT, ".pytest_cache", "orisha"))


# ORISHA_TEST_BUILD_ARGS: options added to every `orisha build` of the suite that does not
# choose its compression dictionaries itself (e.g. --no-dictionaries: the suite must pass
# with them off too).
BUILD_ARGS = os.environ.get("ORISHA_TEST_BUILD_ARGS", "").split()


def with_build_args(args) -> tuple:
    """A build's arguments with ``BUILD_ARGS`` added unless it chooses its dictionaries
    (every build of the suite goes through here: this, and the image's and the container's
    in tests/unikernel_target.py and tests/container_target.py)."""
    if not {"--dictionaries", "--no-dictionaries"} & set(args):
        return (*args, *BUILD_ARGS)
    return tuple(args)


def orisha(*args: str, **kw) -> subprocess.CompletedProcess:
    if args[:1] == ("build",):
        args = with_build_args(args)
    return subprocess.run([PYTHON, "-m", "orisha.cli", *args], capture_output=True,
                          text=True, cwd=RUN_DIR, timeout=kw.pop("timeout", 600), **kw)


def orisha_cmd(args=(), prelude: str = "") -> list[str]:
    """The command that runs the CLI; with ``--loop kqueue`` on a platform without kqueue,
    the kqueue test double (tests/kqueue_double.py) is installed first."""
    import select
    if "kqueue" in args and not hasattr(select, "kqueue"):
        prelude += (f"import sys; sys.path.insert(0, {TESTS!r}); import kqueue_double; "
                    "kqueue_double.install(); ")
    if prelude:
        return [PYTHON, "-c", prelude + "from orisha.cli import main; main()"]
    return [PYTHON, "-m", "orisha.cli"]


class Server:
    """`orisha serve` in a subprocess; the port is read from its start-up line."""

    def __init__(self, build: str, *args: str, proc: subprocess.Popen | None = None,
                 env: dict | None = None) -> None:
        self.proc = proc or subprocess.Popen(
            self.cmd(build, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=RUN_DIR,
            env=env)
        line = self.proc.stdout.readline()
        m = re.search(r"http://([\d.]+):(\d+)/", line)
        if not m:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r} {self.proc.stderr.read()}")
        self.line = line
        self.port = int(m.group(2))
        check_installed(self.proc, env)

    @staticmethod
    def cmd(build: str, *args: str) -> list[str]:
        """``--loop NAME-pure`` (the PURE targets) serves with the .py loop body and core:
        ORISHA_PURE=1 is set in the server before Orisha is imported."""
        args, prelude = list(args), ""
        if "--loop" in args and args[args.index("--loop") + 1] in PURE:
            i = args.index("--loop") + 1
            args[i] = args[i].removesuffix("-pure")
            prelude = "import os; os.environ['ORISHA_PURE'] = '1'; "
        # One address, IPv4 (the suite's clients connect there): worker counts and PIDs are
        # the --workers asked for; the default's two loopback families: tests/test_hosts.py
        host = [] if "--host" in args else ["--host", "127.0.0.1"]
        return [*orisha_cmd(args, prelude), "serve", build, "--port", "0", *host, *args]

    @classmethod
    def attach(cls, proc: subprocess.Popen) -> "Server":
        """A Server for a process started elsewhere (e.g. under prlimit)."""
        return cls("", proc=proc)

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        """Stop it; its exit status. The server's own bound is --grace (8 s by default)
        and 2 s more before it kills a worker; ``timeout`` adds a loaded host's slack
        (a pure-Python server's exit took over 20 s beside two busy loops)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def orisha_modules(pid: int) -> set[str]:
    """The compiled Orisha modules (.so) a server and its workers have mapped."""
    found = set()
    for p in [str(pid), *subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                        text=True).stdout.split()]:
        try:
            with open(f"/proc/{p}/maps") as f:
                found |= {ln.split()[-1] for ln in f if "/orisha/" in ln and ".so" in ln}
        except OSError:  # a worker that exited meanwhile
            pass
    return found


def check_installed(proc: subprocess.Popen, env: dict | None = None) -> None:
    """With ORISHA_TEST_PYTHON: the server runs the installed Orisha, i.e. its compiled
    modules are mapped from that interpreter's site-packages (bounded wait for the workers)."""
    if not INSTALLED or proc.poll() is not None:
        return
    site = subprocess.run([PYTHON, "-c", "import sysconfig; print(sysconfig.get_paths()['platlib'])"],
                          capture_output=True, text=True, cwd=RUN_DIR, timeout=60).stdout.strip()
    pure = bool((os.environ if env is None else env).get("ORISHA_PURE"))
    for _ in range(1 if pure else 50):
        mods = orisha_modules(proc.pid)
        if mods:
            break
        time.sleep(0.1)
    assert site and (mods or pure) and all(m.startswith(site + "/orisha/") for m in mods), \
        (site, mods)
    log = os.environ.get("ORISHA_TEST_MODULES")  # test_wheel.py reads what was mapped
    if log:
        with open(log, "a") as f:
            f.writelines(m + "\n" for m in sorted(mods))


# The demo site is served in two modes: with its own 404 page, and as a single-page app.
MODES = {"notfound": ["--not-found", "404.html"], "spa": ["--fallback", "200.html"]}
# Limits the suite's servers run with, so timeout tests finish quickly.
TEST_LIMITS = ["--idle-timeout", "3", "--head-timeout", "2"]


@pytest.fixture(scope="session")
def builds(tmp_path_factory):
    base = tmp_path_factory.mktemp("builds")
    out = {}
    for name, opts in MODES.items():
        dest = str(base / name)
        r = orisha("build", DEMO, "-o", dest, *opts)
        assert r.returncode == 0, r.stderr
        out[name] = dest
    return out


_servers: dict = {}


@pytest.fixture(scope="session")
def image(tmp_path_factory):
    """The demo site built for the unikernel (``--not-found 404.html``), once a session, for
    the modules that boot it as it is (test_unikernel, _smp, _tap); modules that build
    theirs otherwise define their own ``image``."""
    out = str(tmp_path_factory.mktemp("uk") / "demo")
    r = orisha("build", DEMO, "-o", out, "--target", "unikernel", "--not-found", "404.html")
    assert r.returncode == 0, r.stderr
    return out


def _server(builds, loop: str, mode: str) -> Server:
    key = (loop, mode)
    if key not in _servers:
        if loop in UNIKERNELS:  # a booted image: built from the site with its own --loop
            from unikernel_target import boot
            _servers[key] = boot(DEMO, MODES[mode], TEST_LIMITS + UNIKERNELS[loop])
        elif loop == "container":  # the FROM-scratch image, run as uid 65534 on 127.0.0.1
            from container_target import start
            _servers[key] = start(DEMO, MODES[mode], TEST_LIMITS)
        elif loop in PURE:  # the .py body even where the compiled one is built
            _servers[key] = Server(builds[mode], "--loop", loop.removesuffix("-pure"), "--workers", "2",
                                   *TEST_LIMITS, env={**os.environ, "ORISHA_PURE": "1"})
        else:
            _servers[key] = Server(builds[mode], "--loop", loop, "--workers", "2", *TEST_LIMITS)
    return _servers[key]


@pytest.fixture(scope="session", params=TARGETS)
def loop(request):
    return request.param


@pytest.fixture(scope="session")
def port(builds, loop):
    """Port of a server for the demo site with --not-found 404.html."""
    return _server(builds, loop, "notfound").port


@pytest.fixture(scope="session")
def spa_port(builds, loop):
    """Port of a server for the demo site in SPA mode (--fallback 200.html)."""
    return _server(builds, loop, "spa").port


def pytest_sessionfinish(session, exitstatus):
    for s in _servers.values():
        try:
            s.stop()
        except Exception:  # teardown must try every server even if one misbehaves
            s.proc.kill()


def demo_file(rel: str) -> bytes:
    with open(os.path.join(DEMO, rel), "rb") as f:
        return f.read()


# `./dev test -m "not slow"` is the quick loop: besides the tests marked slow by hand, every
# test that boots the unikernel image, builds or runs the container, or starts a browser is
# slow, whether by its module or by the target it is parametrised over.
SLOW_MODULES = ("test_unikernel", "test_container", "test_symlinked_docs", "test_wheel")
SLOW_TARGETS = {*UNIKERNELS, "container"}


def pytest_collection_modifyitems(config, items):
    seed = os.environ.get("ORISHA_TEST_SHUFFLE")
    if seed:
        _shuffle(items, seed)
    for item in items:
        params = getattr(item, "callspec", None)
        values = set(map(str, params.params.values())) if params else set()
        if (os.path.basename(str(item.fspath)).startswith(SLOW_MODULES)
                or values & SLOW_TARGETS
                or any(w in item.name.lower() for w in ("chromium", "container"))):
            item.add_marker(pytest.mark.slow)


def _wide_params(item) -> tuple:
    """The values of ``item``'s parametrised fixtures of module scope or wider."""
    spec = getattr(item, "callspec", None)
    info = getattr(item, "_fixtureinfo", None)
    if spec is None or info is None:
        return ()
    return tuple(sorted((name, str(spec.params[name]))
                        for name, defs in info.name2fixturedefs.items()
                        if name in spec.params and defs[-1].scope != "function"))


def _shuffle(items: list, seed: str) -> None:
    """ORISHA_TEST_SHUFFLE=SEED (issue 45: "the suite passes in a random order"): the modules
    in a random order, and each module's tests in a random order, except that the tests of
    one value of a module-wide parametrised fixture (a server per loop) stay together, as
    that fixture is made once per value. Printed, so that an order that fails can be had
    again."""
    rnd = random.Random(seed)
    modules: dict = {}
    for item in items:
        modules.setdefault(str(item.fspath), []).append(item)
    order = list(modules)
    rnd.shuffle(order)
    items[:] = []
    for name in order:
        group = modules[name]
        rnd.shuffle(group)
        groups: dict = {}
        for item in group:
            groups.setdefault(_wide_params(item), []).append(item)
        for key in rnd.sample(list(groups), len(groups)):
            items.extend(groups[key])
    print(f"orisha: tests shuffled (ORISHA_TEST_SHUFFLE={seed})", file=sys.stderr)
