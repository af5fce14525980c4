"""Loop bodies: the only code that waits for I/O.

Strategy: each module here implements the contract in ``orisha/loops/base.py``
on one platform facility. The choice is made once, by name, here — nowhere
else — and only the chosen module (and its library) is ever imported. ``auto``
is resolved by probing the platform without importing any loop library.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import select
import signal
import sys
import time

from ..compiled import pure
from ..errors import LoopUnavailable

MODULES = {
    "epoll": "orisha.loops.epoll",
    "kqueue": "orisha.loops.kqueue",
    "asyncio": "orisha.loops.asyncio",
    "io-uring": "orisha.loops.io_uring",
}


# Compiled bodies of the same loops, built by setup.py where Cython and a C compiler are
# there. ``load`` prefers them; ORISHA_PURE=1 (or a pure install) leaves the modules above.
COMPILED = {
    "epoll": "orisha.loops.compiled_epoll",
    "io-uring": "orisha.loops.compiled_io_uring",
}

# Compiled bodies that take the datagram side of base.py (HTTP/3); for the others ``load``
# with ``datagrams`` returns the pure module, which does (a start-up line says so).
COMPILED_DATAGRAMS = frozenset(("epoll", "io-uring"))

# The third-party packages each loop imports (a packager bundles these with the module).
LIBRARIES = {"epoll": (), "io-uring": ("liburing", "dynamic_import"), "kqueue": (),
             "asyncio": ("uvloop",)}
# Loops that can run in a Linux container (kqueue needs a BSD kernel).
LINUX = ("epoll", "io-uring", "asyncio")


_PROBED: dict[str, str | None] = {}


def io_uring_problem() -> str | None:
    """Why io_uring cannot be used here, or None. The answer is kept for the process.

    The parent never imports liburing: the probe runs in a forked child, because
    the kernel may refuse io_uring_setup (ENOSYS, EPERM from seccomp or sysctl 1)
    and some liburing wheels die with SIGILL on CPUs without AVX-512 — a crash a
    process cannot catch in itself. A fork (not ``sys.executable -c``) works the
    same in the frozen container executable, where there is no interpreter to run.
    """
    if "io-uring" not in _PROBED:
        _PROBED["io-uring"] = _probe_io_uring()
    return _PROBED["io-uring"]


def _probe_io_uring() -> str | None:
    if not sys.platform.startswith("linux"):
        return "not Linux"
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            if f.read().strip() == "2":
                return "disabled by sysctl kernel.io_uring_disabled=2"
    except OSError:  # older kernels have no such switch: io_uring is on if it exists
        pass
    if importlib.util.find_spec("liburing") is None:
        return "the liburing package is not installed"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: reports a problem on the pipe and never returns
        os.close(r)
        code = 0
        try:
            with liburing_import_lock():
                import liburing as L
            if not hasattr(L, "io_uring"):
                raise ImportError(f"liburing {L.__version__} lacks the 2024.x API "
                                  "(pip install liburing==2024.5.3)")
            ring = L.io_uring()
            L.io_uring_queue_init(8, ring)
            L.io_uring_queue_exit(ring)
        except BaseException as e:  # any failure is the answer; the child must not return
            os.write(w, str(e).encode()[:500] or type(e).__name__.encode())
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        message = f.read().decode(errors="replace")
    status = os.waitpid(pid, 0)[1]
    if os.WIFSIGNALED(status):
        return f"the liburing probe was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    if os.waitstatus_to_exitcode(status):
        return message or f"the liburing probe exited with {os.waitstatus_to_exitcode(status)}"
    return None


LOCK_WAIT = 10.0  # seconds: an import takes milliseconds; past this, import unguarded


@contextlib.contextmanager
def liburing_import_lock():
    """Hold an exclusive lock on liburing's ``__init__.py`` while it is first imported.

    liburing's ``__init__`` runs ``dynamic_import.importer``, which keeps a cache of the
    package's names in ``liburing/__pycache__/__init__.importer-311.pyc`` — and, in
    dynamic_import 2024.5.2, never manages to read it back (``load_cache`` unpacks six
    values into four names, and its bare ``except`` turns that into "stale"), so every
    import removes the file and writes it again. Two processes importing at the same
    instant (two servers started at boot) race on it: one's ``remove`` finds the file
    gone (FileNotFoundError), or it reads the other's half-written cache. A ``flock``
    on the package's own ``__init__.py`` (opened read-only: it works on a root-owned
    install too) serializes the imports of every Orisha process on the machine.
    Nothing to lock (a frozen executable, where ``__init__`` is no file): no lock.
    """
    import fcntl
    spec = importlib.util.find_spec("liburing")  # finds without running its __init__
    try:
        fd = os.open(spec.origin, os.O_RDONLY) if spec and spec.origin else -1
    except OSError:  # not a file (frozen into an archive): nothing shares a cache there
        fd = -1
    try:
        deadline = time.monotonic() + LOCK_WAIT
        while fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # another process is importing it right now
                if time.monotonic() > deadline:
                    break
                time.sleep(0.002)
        yield
    finally:
        if fd >= 0:
            os.close(fd)  # releases the lock


def resolve(name: str) -> tuple[str, str | None]:
    """The loop to use for ``name`` and, for ``auto``, a note on why it was chosen."""
    if name != "auto":
        return name, None
    if hasattr(select, "kqueue"):
        return "kqueue", None
    problem = io_uring_problem()
    if problem is None:
        return "io-uring", None
    return "epoll", f"io_uring unavailable ({problem}); using epoll"


def module(name: str) -> str:
    """The module ``load`` imports for loop ``name``: its compiled body when built, else the .py."""
    compiled = COMPILED.get(name)
    if compiled and not pure() and importlib.util.find_spec(compiled) is not None \
            and compiled_core_loaded():
        return compiled
    return MODULES[name]


def compiled_core_loaded() -> bool:
    """True when the compiled core runs: the compiled bodies call its connections at C level
    (orisha/loops/seam.pxd), so with the .py core (stale, or not built) the pure body runs."""
    from ..core import connection
    return not connection.__file__.endswith(".py")


def build(loop_cls) -> str:
    """"compiled" or "pure": which body a class ``load`` returned is (for the start-up line)."""
    return "compiled" if loop_cls.__module__ in COMPILED.values() else "pure"


def load(name: str, datagrams: bool = False):
    """Import the chosen loop body's module and return its ``Loop`` class; ``datagrams``:
    one that serves the datagram side too (HTTP/3)."""
    if name not in MODULES:
        raise LoopUnavailable(f"unknown loop {name!r} (choose from {', '.join(MODULES)})")
    module_name = module(name)
    if datagrams and module_name != MODULES[name] and name not in COMPILED_DATAGRAMS:
        print(f"orisha: the compiled {name} body has no datagram side (HTTP/3); using the "
              "pure one", file=sys.stderr)
        module_name = MODULES[name]
    if name == "io-uring":
        problem = io_uring_problem()
        if problem:
            raise LoopUnavailable(f"--loop io-uring: {problem}")
    if name == "kqueue" and not hasattr(select, "kqueue"):
        raise LoopUnavailable("--loop kqueue: this platform has no kqueue (macOS and the BSDs do)")
    if name == "epoll" and not hasattr(select, "epoll"):
        raise LoopUnavailable("--loop epoll: this platform has no epoll (Linux does)")
    try:
        with liburing_import_lock() if name == "io-uring" else contextlib.nullcontext():
            return importlib.import_module(module_name).Loop
    except ImportError as e:
        if module_name == MODULES[name]:
            raise LoopUnavailable(f"--loop {name}: {e}") from None
    # A compiled body that does not load (built against another liburing or Python):
    # the pure module is the documented fallback.
    try:
        return importlib.import_module(MODULES[name]).Loop
    except ImportError as e:
        raise LoopUnavailable(f"--loop {name}: {e}") from None
