"""Optional compiled extensions; everything else is in pyproject.toml.

Strategy: the pure-Python modules are the specification and the fallback.
When Cython and a C compiler are there, ``pip install`` also builds:

  orisha.loops.compiled_epoll      the epoll loop body in C (compiled_epoll.pyx)
  orisha.loops.compiled_udp        the compiled bodies' datagram pump: recvmmsg with UDP
                                   GRO, sendmmsg (compiled_udp.pyx; udp.py is its fallback)
  orisha.protocols.compiled_tls    TLS with OpenSSL called from C (compiled_tls.pyx; needs
                                   OpenSSL's headers, libssl-dev), the twin of tls.py
  orisha.loops.compiled_io_uring   the io_uring loop body in C against liburing's own
                                   Cython declarations (needs the liburing package)
  orisha.core.connection           the request core: connection.py itself, compiled with
                                   the types in connection.pxd (one source; the .py is the
                                   fallback, chosen by orisha/core/__init__.py when
                                   ORISHA_PURE is set or the sources changed since the build)
  orisha.protocols.h2              the HTTP/2 frame layer: h2.py itself with h2.pxd, chosen
                                   the same way (its own stamp, h2.sources)
  orisha.protocols.compiled_h3     HTTP/3 on ngtcp2 and GnuTLS (compiled_h3.pyx over the
                                   plain C of h3_quic.c; needs ngtcp2 1.x and nghttp3)

Without Cython, without a compiler (``CC=false``), or when one extension fails
to compile, the build still succeeds with the pure modules only:
``orisha.loops.load`` imports a compiled loop only where its module exists, and
``ORISHA_PURE=1`` makes it ignore them (tests/test_compiled.py checks both). One
line on stderr says which build it was (``orisha: compiled build: ...`` or
``orisha: pure-Python build (...)``).

A wheel (not an editable install) also carries what the other targets read from
the repository: ``unikernel/`` (C sources, port headers, mbedTLS configuration,
Makefile and fetch scripts) copied to ``orisha/targets/unikernel/tree/``, and the
container's ``Dockerfile`` to ``orisha/targets/container/Dockerfile`` — the
repository's copies stay the one source, the wheel gets them at build time
(``BuildPy``). The compiled core's stamp goes beside the built module.

HTTP/3's libraries: ``compiled_h3`` links ngtcp2, its GnuTLS crypto helper and nghttp3
statically, from the archives of bookworm-backports' -dev packages (``H3_ARCHIVES``), so the
module (and a wheel, and the container's frozen executable) needs only GnuTLS at run time,
which every Debian 12 has: ``pipx install`` of the wheel serves HTTP/3 on a machine without
that suite. Debian builds those archives as position-independent executables' objects (PIE,
not PIC): their calls between their own global symbols are PC-relative, which a shared object
may take only when those symbols are not exported, so the link hides every symbol of the
archives (``--exclude-libs,ALL``); the module's own symbols are exported as before. Their
one reference to libc's data, ``stderr`` (debug printers), binds to a hidden copy of the
module's own (``compiled_h3.pyx``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

# -g0: no debug info (the interpreter's CFLAGS often carry -g): a third less compile time for
# the core's generated C, and release-sized modules.
EXTRA = ["-O2", "-g0"]
JOBS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
HERE = os.path.dirname(os.path.abspath(__file__))
# What the wheel copies from the repository: (source, destination inside the package).
PACKAGED = (("unikernel", os.path.join("orisha", "targets", "unikernel", "tree")),
            ("Dockerfile", os.path.join("orisha", "targets", "container", "Dockerfile")),
            # not generated C (which exclude-package-data keeps out): the image's /init
            (os.path.join("orisha", "targets", "container", "init.c"),) * 2)
# unikernel/ entries the image build does not read (build output, fetched sources, tools).
UNPACKAGED = ("build", ".cache", "tools", "__pycache__", "*.o")
_SKIPPED: list[str] = []  # why a module was not compiled, for the one summary line
HINTS = {"orisha.protocols.compiled_tls": ": OpenSSL's headers? Debian's libssl-dev has them",
         "orisha.protocols.compiled_h3": ": ngtcp2 1.x and nghttp3? bookworm-backports' "
                                         "libngtcp2-dev, libngtcp2-crypto-gnutls-dev and "
                                         "libnghttp3-dev"}
# HTTP/3 on ngtcp2 (compiled_h3): the static archives it takes in (Debian's -dev packages
# from bookworm-backports), in link order; GnuTLS is the one shared library it adds.
H3_ARCHIVES = ("libngtcp2_crypto_gnutls.a", "libngtcp2.a", "libnghttp3.a")
H3_HEADERS = (os.path.join("ngtcp2", "ngtcp2.h"),
              os.path.join("ngtcp2", "ngtcp2_crypto_gnutls.h"),
              os.path.join("nghttp3", "nghttp3.h"))


def _h3_extension():
    """The compiled HTTP/3 endpoint, or None without ngtcp2 1.x's and nghttp3's headers and
    static archives (``ORISHA_H3_INCLUDE``, ``ORISHA_H3_LIBDIR``: where else to find them)."""
    include = os.environ.get("ORISHA_H3_INCLUDE", "/usr/include")
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    libdir = os.environ.get("ORISHA_H3_LIBDIR", os.path.join("/usr/lib", multiarch))
    missing = [h for h in H3_HEADERS if not os.path.exists(os.path.join(include, h))] + [
        a for a in H3_ARCHIVES if not os.path.exists(os.path.join(libdir, a))]
    if missing:
        _SKIPPED.append(f"orisha.protocols.compiled_h3 (no {', '.join(missing)}"
                        + HINTS["orisha.protocols.compiled_h3"] + ")")
        return None
    return Extension("orisha.protocols.compiled_h3",
                     ["orisha/protocols/compiled_h3.pyx", "orisha/protocols/h3_quic.c"],
                     include_dirs=["orisha/protocols", include], libraries=["gnutls"],
                     extra_objects=[os.path.join(libdir, a) for a in H3_ARCHIVES],
                     extra_compile_args=EXTRA, extra_link_args=["-Wl,--exclude-libs,ALL"])


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
        why = "ORISHA_PURE is set" if os.environ.get("ORISHA_PURE") else "the bodies are Linux's"
        print(f"orisha: pure-Python build ({why})", file=sys.stderr)
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("orisha: pure-Python build (Cython not installed)", file=sys.stderr)
        return []
    exts = [Extension("orisha.loops.compiled_epoll", ["orisha/loops/compiled_epoll.pyx"],
                      extra_compile_args=EXTRA),
            Extension("orisha.loops.compiled_udp", ["orisha/loops/compiled_udp.pyx"],
                      extra_compile_args=EXTRA),
            Extension("orisha.core.connection", ["orisha/core/connection.py"],
                      extra_compile_args=EXTRA),
            Extension("orisha.protocols.h2", ["orisha/protocols/h2.py"],
                      extra_compile_args=EXTRA),
            # OpenSSL's C API against the libssl the stdlib links (Debian: libssl-dev's
            # headers); a machine without them fails this one module, which is skipped.
            Extension("orisha.protocols.compiled_tls", ["orisha/protocols/compiled_tls.pyx"],
                      libraries=["ssl", "crypto"], extra_compile_args=EXTRA)]
    h3 = _h3_extension()
    if h3 is not None:
        exts.append(h3)
    uring = _liburing_dirs()
    if uring:
        exts.append(Extension("orisha.loops.compiled_io_uring", ["orisha/loops/compiled_io_uring.pyx"],
                              include_dirs=uring, extra_compile_args=EXTRA))
    else:  # liburing==2024.5.3 has wheels up to Python 3.11 only (pyproject.toml)
        _SKIPPED.append("orisha.loops.compiled_io_uring (liburing not installed)")
    # annotation_typing off: the .py's annotations document, the .pxd types.
    # Every core at once: Cython's C generation per module (nthreads) here, and the C
    # compiles in build_ext (``OptionalBuildExt.finalize_options``): the core's and h2's
    # generated C take most of an install's time.
    return cythonize(exts, language_level=3, quiet=True, nthreads=JOBS,
                     compiler_directives={"boundscheck": False, "wraparound": False,
                                          "annotation_typing": False})


def _stamp_core_sources(directory: str, module: str = "orisha.core.connection") -> None:
    """Record beside a module compiled from its .py (the core, the HTTP/2 layer) which
    sources it was built from (orisha/compiled.py compares them at import in a checkout, so
    an edit without a rebuild runs the .py, not stale C; the wheel carries the stamp with
    the module)."""
    sys.path.insert(0, HERE)
    try:
        from orisha import compiled
    finally:
        sys.path.pop(0)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, os.path.basename(compiled.stamp(module))), "w") as f:
        f.write(compiled.sources_digest(module) + "\n")


# Modules compiled from their own .py, each with a stamp beside it (orisha/compiled.py).
FROM_PY = {"connection.": "orisha.core.connection", "h2.": "orisha.protocols.h2"}


class OptionalBuildExt(build_ext):
    """Build what compiles; a missing or broken compiler leaves the pure modules."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:  # build_ext -j N: the extensions compile side by side
            self.parallel = JOBS

    def run(self) -> None:
        self.built: list[str] = []
        try:
            super().run()
        except Exception as e:  # no compiler at all (CC=false, none installed): pure build
            print(f"orisha: pure-Python build (compiled extensions skipped: {e})", file=sys.stderr)
            return
        if not self.built:
            print("orisha: pure-Python build (no extension compiled)", file=sys.stderr)
            return
        skipped = f"; not compiled: {', '.join(_SKIPPED)}" if _SKIPPED else ""
        print(f"orisha: compiled build: {', '.join(self.built)}{skipped}", file=sys.stderr)

    def copy_extensions_to_source(self) -> None:
        """An in-place build (an editable install) copies the modules that compiled: one that
        failed has no file to copy, and copying it raised, so every module after it in the
        list (the io_uring body after HTTP/3's) was lost too and the install said pure."""
        every = self.extensions
        self.extensions = [e for e in every if e.name in self.built]
        try:
            super().copy_extensions_to_source()
        finally:
            self.extensions = every

    def copy_file(self, src, dst, *args, **kwargs):
        """In-place builds (editable installs) replace a compiled module by rename: a server
        running the old one keeps its file mapped instead of seeing it truncated (SIGBUS)."""
        if not str(dst).endswith(".so"):
            return super().copy_file(src, dst, *args, **kwargs)
        shutil.copyfile(src, f"{dst}.new")
        os.replace(f"{dst}.new", dst)
        for prefix, module in FROM_PY.items():  # compiled from a .py: its stamp goes along
            if os.path.basename(dst).startswith(prefix):
                _stamp_core_sources(os.path.dirname(dst), module)
        return dst, 1

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:  # one extension failing must not fail the install
            print(f"orisha: {ext.name} not compiled ({e}); its pure module is used",
                  file=sys.stderr)
            _SKIPPED.append(f"{ext.name} (compiler failed{HINTS.get(ext.name, '')})")
            return
        self.built.append(ext.name)
        if ext.name in FROM_PY.values():  # in place (editable) or in build_lib (wheel)
            _stamp_core_sources(os.path.dirname(self.get_ext_fullpath(ext.name)), ext.name)


class BuildPy(build_py):
    """The wheel's copies of the repository's unikernel/ and Dockerfile (see the Strategy).
    An editable install reads the repository's own, so it copies nothing; a source tree
    without them (tests/test_compiled.py installs a trimmed copy) builds a wheel without
    those targets' files."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for src, dest in PACKAGED:
            src, dest = os.path.join(HERE, src), os.path.join(self.build_lib, dest)
            if os.path.isdir(src):
                shutil.rmtree(dest, ignore_errors=True)
                shutil.copytree(src, dest, ignore=shutil.ignore_patterns(*UNPACKAGED))
            elif os.path.isfile(src):
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                shutil.copy2(src, dest)


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt, "build_py": BuildPy})
