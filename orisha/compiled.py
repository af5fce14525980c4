"""Which build of the compiled-capable modules a process runs: compiled or pure.

setup.py compiles ``orisha/core/connection.py`` itself (with the types in
``connection.pxd``) when Cython and a C compiler are there; the extension module
then shadows the .py in the import system. ``choose()``, called when the
``orisha`` package is imported (before anything below it), makes
``orisha.core.connection`` the .py instead when ``ORISHA_PURE`` asks for the
pure modules, or when the sources beside the extension are not the ones it was
built from (an edit without a rebuild would otherwise run stale C) — then with a
one-line warning. That comparison is for a checkout (an editable install, or the
tree itself on ``sys.path``), where sources are edited; an installed wheel's
module and sources come from one archive written by the installer, so there it
is trusted as it is (``installed()``: a ``*.dist-info`` beside the package).
The loop bodies' choice is ``orisha.loops.module``.

The HTTP/2 frame layer is built the same way (``orisha/protocols/h2.py`` with
``h2.pxd``, its stamp ``h2.sources``) and chosen by the same rule, each module
on its own stamp (``COMPILED``).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

PACKAGE = os.path.dirname(os.path.abspath(__file__))
CORE = os.path.join(PACKAGE, "core")
CORE_MODULE = "orisha.core.connection"
CORE_SOURCES = ("connection.py", "connection.pxd")  # what the extension is built from
STAMP = os.path.join(CORE, "connection.sources")     # their sha256, written by setup.py
H2_MODULE = "orisha.protocols.h2"
# Every module compiled from its own .py: name → (folder, base name, what it is for the warning).
COMPILED = {CORE_MODULE: (CORE, "connection", "core"),
            H2_MODULE: (os.path.join(PACKAGE, "protocols"), "h2", "HTTP/2 layer")}


def pure() -> bool:
    """True when ORISHA_PURE asks for the pure-Python modules even where compiled ones exist."""
    return os.environ.get("ORISHA_PURE", "") not in ("", "0")


def sources_digest(module: str = CORE_MODULE) -> str:
    import hashlib  # only where a compiled module and its sources are both there
    folder, base, _ = COMPILED[module]
    h = hashlib.sha256()
    for name in (base + ".py", base + ".pxd"):
        with open(os.path.join(folder, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def stamp(module: str = CORE_MODULE) -> str:
    folder, base, _ = COMPILED[module]
    return os.path.join(folder, base + ".sources")


def compiled_file(module: str) -> str | None:
    """The extension module setup.py built from ``module``'s .py, if it did."""
    folder, base, _ = COMPILED[module]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(folder, base + suffix)
        if os.path.exists(path):
            return path
    return None


def compiled_core() -> str | None:
    """The compiled core's file, if setup.py built one."""
    return compiled_file(CORE_MODULE)


def installed() -> bool:
    """True when an installer put this package where it is (pip, pipx: its ``.dist-info``
    lies beside it), False in a checkout (an editable install's dist-info is elsewhere)."""
    parent = os.path.dirname(PACKAGE)
    try:
        return any(n.startswith("orisha-") and n.endswith(".dist-info") for n in os.listdir(parent))
    except OSError:  # a zip or frozen import: nothing to compare against anyway
        return True


def _stale(module: str = CORE_MODULE) -> bool:
    try:
        with open(stamp(module)) as f:
            return f.read().strip() != sources_digest(module)
    except OSError:
        return True


class _PureCore:
    """A meta-path finder that gives the .py for the modules in ``sources`` (when imported)."""

    def __init__(self, sources: dict) -> None:
        self.sources = sources

    def find_spec(self, name, path=None, target=None):
        source = self.sources.get(name)
        return importlib.util.spec_from_file_location(name, source) if source else None


def choose() -> None:
    sources = {}
    for module, (folder, base, what) in COMPILED.items():
        source = os.path.join(folder, base + ".py")
        if compiled_file(module) is None or not os.path.exists(source):
            continue  # nothing compiled, or a frozen app that bundled only the compiled module
        if not pure():
            if installed() or not _stale(module):
                continue
            rel = os.path.relpath(source, os.path.dirname(PACKAGE))
            print(f"orisha: the compiled {what} is older than {rel}; using the .py "
                  "(pip install -e . rebuilds it)", file=sys.stderr)
        sources[module] = source
    if sources:
        sys.meta_path.insert(0, _PureCore(sources))
