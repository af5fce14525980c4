"""Loop bodies: the only code that waits for I/O.

Strategy: each module here implements the contract in ``orisha/loops/base.py``
on one platform facility. The choice is made once, by name, here — nowhere
else — and only the chosen module (and its library) is ever imported. ``auto``
is resolved by probing the platform without importing any loop library.
"""

from __future__ import annotations

import importlib
import importlib.util
import select
import sys

MODULES = {
    "epoll": "orisha.loops.epoll",
    "kqueue": "orisha.loops.kqueue",
    "asyncio": "orisha.loops.asyncio",
    "io-uring": "orisha.loops.io_uring",
}


# The third-party packages each loop imports (a packager bundles these with the module).
LIBRARIES = {"epoll": (), "io-uring": ("liburing", "dynamic_import"), "kqueue": (),
             "asyncio": ("uvloop",)}
# Loops that can run in a Linux container (kqueue needs a BSD kernel).
LINUX = ("epoll", "io-uring", "asyncio")

# What ``orisha build --loop`` accepts: the hosted loops, auto, and the booted image.
BUILD_CHOICES = (*MODULES, "auto", "unikernel")


class LoopUnavailable(Exception):
    """The loop cannot run here; the message says why."""


def io_uring_problem() -> str | None:
    """Why io_uring cannot be used here, or None. Does not import liburing."""
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
    # Probe in a child process: the kernel may refuse io_uring_setup (ENOSYS, EPERM from
    # seccomp or sysctl 1), and some liburing wheels die with SIGILL on CPUs without
    # AVX-512 — a crash a process cannot catch in itself. The parent never imports liburing.
    import signal
    import subprocess
    probe = ("import liburing as L\n"
             "if not hasattr(L, 'io_uring'): raise SystemExit("
             "'liburing ' + L.__version__ + ' lacks the 2024.x API (pip install liburing==2024.5.3)')\n"
             "r = L.io_uring(); L.io_uring_queue_init(8, r); L.io_uring_queue_exit(r)\n")
    try:
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"probe failed to run ({e})"
    if r.returncode < 0:
        return f"the liburing probe was killed by {signal.Signals(-r.returncode).name}"
    if r.returncode:
        lines = r.stderr.strip().splitlines()
        return lines[-1] if lines else f"the liburing probe exited with {r.returncode}"
    return None


def resolve(name: str) -> tuple[str, str | None]:
    """The loop to use for ``name`` and, for ``auto``, a note on why it was chosen."""
    if name != "auto":
        return name, None
    if hasattr(select, "kqueue"):
        return "kqueue", None
    if "io-uring" in MODULES:
        problem = io_uring_problem()
        if problem is None:
            return "io-uring", None
        return "epoll", f"io_uring unavailable ({problem}); using epoll"
    return "epoll", None


def load(name: str):
    """Import the chosen loop body's module and return its ``Loop`` class."""
    try:
        module = MODULES[name]
    except KeyError:
        raise LoopUnavailable(f"unknown loop {name!r} (choose from {', '.join(MODULES)})") from None
    if name == "io-uring":
        problem = io_uring_problem()
        if problem:
            raise LoopUnavailable(f"--loop io-uring: {problem}")
    if name == "kqueue" and not hasattr(select, "kqueue"):
        raise LoopUnavailable("--loop kqueue: this platform has no kqueue (macOS and the BSDs do)")
    if name == "epoll" and not hasattr(select, "epoll"):
        raise LoopUnavailable("--loop epoll: this platform has no epoll (Linux does)")
    try:
        return importlib.import_module(module).Loop
    except ImportError as e:
        raise LoopUnavailable(f"--loop {name}: {e}") from None
