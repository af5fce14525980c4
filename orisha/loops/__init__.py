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
}


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
    import ctypes
    import errno
    import os
    # io_uring_setup(1, params) on a zeroed 120-byte params struct: the kernel's answer
    # (ENOSYS: too old; EPERM: seccomp or sysctl 1) is what liburing would meet.
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)
    fd = libc.syscall(425, 1, params)
    if fd < 0:
        err = ctypes.get_errno()
        return f"io_uring_setup failed: {errno.errorcode.get(err, err)} ({os.strerror(err)})"
    os.close(fd)
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
