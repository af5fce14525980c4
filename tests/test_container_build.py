"""What the container build leaves out of the frozen executable (orisha/targets/container/
build.py) is never what the server needs: checked here without Docker; the image itself is
tests/test_container.py's."""

import importlib
import os
import re
import subprocess
import sys
import textwrap

import pytest

from orisha.targets.container import build

LOOPS = os.path.join(os.path.dirname(build.PACKAGE), "orisha", "loops")


def test_the_image_runs_the_compiled_io_uring_body_on_the_liburing_modules_it_keeps(tmp_path):
    """A copy of liburing holding only LIBURING_KEEP's modules (and the lib/ and include/
    folders) gives every name loops/__init__.py's probe takes from it and loads the compiled
    body (whose cimports import modules as it starts); the pure body, which needs more, is
    not bundled at all, so ORISHA_PURE=1 there is a clear "--loop io-uring: No module" error,
    never an AttributeError mid-request. Fails when either starts using a module left out."""
    pytest.importorskip("liburing")
    from orisha.loops import COMPILED, MODULES
    if importlib.util.find_spec(COMPILED["io-uring"]) is None:
        pytest.skip("the compiled io_uring body is not built here (the image bundles liburing whole)")
    mods, _ = build.loop_modules("auto")
    assert COMPILED["io-uring"] in mods and MODULES["io-uring"] not in mods, mods
    src = open(os.path.join(LOOPS, "__init__.py")).read()
    names = sorted(set(re.findall(r"\bL\.([A-Za-z_][A-Za-z0-9_]*)", src)))
    assert "io_uring_queue_init" in names
    spec = importlib.util.find_spec("liburing")
    pkg, dst = os.path.dirname(spec.origin), tmp_path / "liburing"
    dst.mkdir()
    for n in os.listdir(pkg):
        stem = n.split(".")[0]
        if n in ("lib", "include", "__init__.py") or (n.endswith(".so") and stem in build.LIBURING_KEEP):
            os.symlink(os.path.join(pkg, n), dst / n)
    probe = textwrap.dedent(f"""
        import liburing as L
        assert L.__file__.startswith({str(tmp_path)!r}), L.__file__
        for n in {names!r}:
            getattr(L, n)
        ring = L.io_uring()
        L.io_uring_queue_init(8, ring)
        L.io_uring_queue_exit(ring)
        import {COMPILED["io-uring"]}
    """)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                       timeout=60, cwd=os.path.dirname(build.PACKAGE))
    assert r.returncode == 0, r.stderr[-2000:]


def test_nothing_left_out_as_unused_is_imported_by_the_server():
    """A process that imported everything the image's server does (HTTP/3 and ACME too, as
    server.py does lazily) has loaded none of the modules the build leaves out as unused."""
    probe = textwrap.dedent(f"""
        import sys
        import orisha.serving.server, orisha.serving.supervisor, orisha.protocols.compiled_h3, orisha.serving.acme
        import orisha.targets.container.runtime, orisha.loops.epoll
        import requests, acme.client
        unused = {build.UNUSED!r}
        print(" ".join(sorted(m for m in sys.modules for x in unused
                              if m == x or m.startswith(x + "."))))
    """)
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=60, cwd=os.path.dirname(build.PACKAGE))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == [], r.stdout


def test_an_edit_to_the_hand_written_c_freezes_the_executable_again(tmp_path, monkeypatch):
    """The frozen executable's cache key covers h3_quic.c and h3_quic.h (compiled_h3's C
    half) as it covers the .pyx files: an edit to either alone is a new key, not a stale
    executable reused."""
    import shutil
    copy = tmp_path / "orisha"
    shutil.copytree(build.PACKAGE, copy, ignore=shutil.ignore_patterns(
        "__pycache__", "*.so", "embed", "unikernel"))
    monkeypatch.setattr(build, "PACKAGE", str(copy))
    before = build._key(["m"], [])
    for name in ("h3_quic.c", "h3_quic.h"):
        path = copy / "protocols" / name
        path.write_bytes(path.read_bytes() + b"\n/* edited */\n")
        after = build._key(["m"], [])
        assert after != before, name
        before = after

