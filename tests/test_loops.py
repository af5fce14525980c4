"""The seam: the loop is chosen once, and only the chosen loop is ever loaded."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from conftest import DEMO, LOOPS, ROOT, orisha, orisha_cmd
from httpraw import Conn

# Each loop's pure module and, where setup.py built it, its compiled body (loops.COMPILED).
ALL = {"epoll": {"orisha.loops.epoll", "orisha.loops.compiled_epoll"}, "kqueue": {"orisha.loops.kqueue"},
       "asyncio": {"orisha.loops.asyncio", "uvloop", "asyncio"},
       "io-uring": {"orisha.loops.io_uring", "orisha.loops.compiled_io_uring", "liburing"}}


def imported_modules(args: list[str], tmp_path, double: bool = False) -> tuple[set[str], str]:
    """Run a server, make one request, stop it; return the modules it had loaded.

    The server's parent process (which imports the loop before forking the
    workers) writes ``sys.modules`` to a file when it exits.
    """
    dump = tmp_path / "modules.json"
    prelude = (f"import atexit, json, sys; atexit.register(lambda: open({str(dump)!r}, 'w')"
               ".write(json.dumps(sorted(sys.modules)))); ")
    p = subprocess.Popen([*orisha_cmd(["kqueue"] if double else [], prelude), *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT)
    line = p.stdout.readline()
    m = re.search(r":(\d+)/", line)
    assert m, p.stderr.read()
    assert Conn(int(m.group(1))).request("/").status == 200
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=20)
    assert p.returncode == 0, err
    return set(json.loads(dump.read_text())), line


@pytest.mark.parametrize("loop", LOOPS)
def test_build_records_the_loop_and_only_it_is_loaded(tmp_path, loop):
    out = str(tmp_path / "o")
    assert orisha("build", DEMO, "-o", out, "--loop", loop).returncode == 0
    mods, line = imported_modules(["serve", out, "--port", "0", "--workers", "1"], tmp_path,
                                  double=loop == "kqueue")
    assert f"(loop {loop}," in line
    assert ALL[loop] & mods, f"{loop} was not imported"
    for other, names in ALL.items():
        if other != loop:
            assert not (names - ALL[loop]) & mods, f"{other} was imported for {loop}"


def test_serve_loop_overrides_the_build(tmp_path):
    out = str(tmp_path / "o")
    assert orisha("build", DEMO, "-o", out, "--loop", "epoll").returncode == 0
    mods, line = imported_modules(["serve", out, "--port", "0", "--workers", "1", "--loop", "asyncio"],
                                  tmp_path)
    assert "(loop asyncio," in line and "orisha.loops.asyncio" in mods and "orisha.loops.epoll" not in mods


def test_unknown_loop_is_a_one_line_error(tmp_path):
    r = orisha("build", DEMO, "-o", str(tmp_path / "o"), "--loop", "select")
    assert r.returncode != 0 and "Traceback" not in r.stderr


def _serve_with(prelude: str, loop: str, tmp_path):
    out = str(tmp_path / "o")
    assert orisha("build", DEMO, "-o", out, "--loop", loop).returncode == 0
    return subprocess.Popen([sys.executable, "-c", prelude + "from orisha.cli import main; main()",
                             "serve", out, "--port", "0", "--workers", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


HIDE_LIBURING = "import sys; sys.modules['liburing'] = None; "  # as if the package were missing


def test_auto_falls_back_to_epoll_and_says_why(tmp_path):
    p = _serve_with(HIDE_LIBURING, "auto", tmp_path)
    line = p.stdout.readline()
    try:
        assert "(loop epoll," in line
        port = int(re.search(r":(\d+)/", line).group(1))
        assert Conn(port).request("/").status == 200
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=20)
    assert "io_uring unavailable (the liburing package is not installed); using epoll" in err


def test_explicit_io_uring_fails_in_one_line(tmp_path):
    p = _serve_with(HIDE_LIBURING, "io-uring", tmp_path)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 1 and out == ""
    assert err.strip() == "orisha: error: --loop io-uring: the liburing package is not installed"


@pytest.mark.serial  # kernel.io_uring_disabled is host-wide: an io_uring server started meanwhile fails
def test_io_uring_disabled_by_sysctl(tmp_path):
    knob = "/proc/sys/kernel/io_uring_disabled"
    if not os.path.exists(knob):
        pytest.skip("this kernel has no kernel.io_uring_disabled switch (added in Linux 6.6)")
    old = open(knob).read().strip()
    try:
        with open(knob, "w") as f:
            f.write("2")
        p = _serve_with("", "io-uring", tmp_path)
        _, err = p.communicate(timeout=30)
        assert p.returncode == 1 and "kernel.io_uring_disabled=2" in err and len(err.splitlines()) == 1
        p = _serve_with("", "auto", tmp_path)
        line = p.stdout.readline()
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=20)
        assert "(loop epoll," in line and "io_uring unavailable" in err
    finally:
        with open(knob, "w") as f:
            f.write(old)


def test_io_uring_single_shot_accept_for_kernels_before_5_19(tmp_path):
    # As on a kernel that answered EINVAL to multishot accept: one accept per submission.
    # ORISHA_PURE: this is the pure body's path (tests/test_compiled.py covers the compiled one).
    prelude = ("import os; os.environ['ORISHA_PURE'] = '1'\n"
               "import orisha.loops.io_uring as U; _init = U.Loop.__init__\n"
               "def init(self, *a):\n    _init(self, *a); self.multishot = False\n"
               "U.Loop.__init__ = init\n")
    p = _serve_with(prelude, "io-uring", tmp_path)
    line = p.stdout.readline()
    try:
        port = int(re.search(r":(\d+)/", line).group(1))
        for _ in range(20):  # each new connection needs the accept re-armed
            assert Conn(port).request("/").status == 200
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=20)
    assert p.returncode == 0
