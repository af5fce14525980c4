"""Optional compiled extensions; everything else is in pyproject.toml.

Strategy: the pure-Python modules are the specification and the fallback.
When Cython and a C compiler are there, ``pip install`` also builds:

  orisha.loops.compiled_epoll      the epoll loop body in C (compiled_epoll.pyx)
  orisha.loops.compiled_io_uring   the io_uring loop body in C against liburing's own
                                   Cython declarations (needs the liburing package)
  orisha.core.connection           the request core: connection.py itself, compiled with
                                   the types in connection.pxd (one source; the .py is the
                                   fallback, chosen by orisha/core/__init__.py when
                                   ORISHA_PURE is set or the sources changed since the build)

Without Cython, without a compiler (``CC=false``), or when one extension fails
to compile, the build still succeeds with the pure modules only:
``orisha.loops.load`` imports a compiled loop only where its module exists, and
``ORISHA_PURE=1`` makes it ignore them (tests/test_compiled.py checks both).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

EXTRA = ["-O2"]


def _liburing_dirs() -> list[str] | None:
    """liburing's headers as its Python package ships them (``lib/*.pxd`` include
    ``../include/liburing.h``), or None when the package is not installed."""
    spec = importlib.util.find_spec("liburing")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = list(spec.submodule_search_locations)[0]
    return [os.path.join(root, "include"), os.path.join(root, "lib")]


def extensions() -> list:
    if os.environ.get("ORISHA_PURE") or not sys.platform.startswith("linux"):
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("orisha: Cython not installed: pure-Python build", file=sys.stderr)
        return []
    exts = [Extension("orisha.loops.compiled_epoll", ["orisha/loops/compiled_epoll.pyx"],
                      extra_compile_args=EXTRA),
            Extension("orisha.core.connection", ["orisha/core/connection.py"],
                      extra_compile_args=EXTRA)]
    uring = _liburing_dirs()
    if uring:
        exts.append(Extension("orisha.loops.compiled_io_uring", ["orisha/loops/compiled_io_uring.pyx"],
                              include_dirs=uring, extra_compile_args=EXTRA))
    _stamp_core_sources()
    # annotation_typing off: the .py's annotations document, the .pxd types.
    return cythonize(exts, language_level=3, quiet=True,
                     compiler_directives={"boundscheck": False, "wraparound": False,
                                          "annotation_typing": False})


def _stamp_core_sources() -> None:
    """Record which sources the compiled core is built from (orisha/core/__init__.py
    compares them at import, so an edit without a rebuild runs the .py, not stale C)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        from orisha import compiled
    finally:
        sys.path.pop(0)
    with open(compiled.STAMP, "w") as f:
        f.write(compiled.sources_digest() + "\n")


class OptionalBuildExt(build_ext):
    """Build what compiles; a missing or broken compiler leaves the pure modules."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # no compiler at all (CC=false, none installed): pure build
            print(f"orisha: compiled extensions skipped ({e}); pure-Python build", file=sys.stderr)

    def copy_file(self, src, dst, *args, **kwargs):
        """In-place builds (editable installs) replace a compiled module by rename: a server
        running the old one keeps its file mapped instead of seeing it truncated (SIGBUS)."""
        if not str(dst).endswith(".so"):
            return super().copy_file(src, dst, *args, **kwargs)
        shutil.copyfile(src, f"{dst}.new")
        os.replace(f"{dst}.new", dst)
        return dst, 1

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:  # one extension failing must not fail the install
            print(f"orisha: {ext.name} not compiled ({e}); its pure module is used",
                  file=sys.stderr)


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
