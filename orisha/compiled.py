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


def pure() -> bool:
    """True when ORISHA_PURE asks for the pure-Python modules even where compiled ones exist."""
    return os.environ.get("ORISHA_PURE", "") not in ("", "0")


def sources_digest() -> str:
    import hashlib  # only where a compiled core and its sources are both there
    h = hashlib.sha256()
    for name in CORE_SOURCES:
        with open(os.path.join(CORE, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def compiled_core() -> str | None:
    """The compiled core's file, if setup.py built one."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(CORE, "connection" + suffix)
        if os.path.exists(path):
            return path
    return None


def installed() -> bool:
    """True when an installer put this package where it is (pip, pipx: its ``.dist-info``
    lies beside it), False in a checkout (an editable install's dist-info is elsewhere)."""
    parent = os.path.dirname(PACKAGE)
    try:
        return any(n.startswith("orisha-") and n.endswith(".dist-info") for n in os.listdir(parent))
    except OSError:  # a zip or frozen import: nothing to compare against anyway
        return True


def _stale() -> bool:
    try:
        with open(STAMP) as f:
            return f.read().strip() != sources_digest()
    except OSError:
        return True


class _PureCore:
    """A meta-path finder that gives the .py for ``orisha.core.connection`` (when imported)."""

    def __init__(self, source: str) -> None:
        self.source = source

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_file_location(name, self.source) if name == CORE_MODULE else None


def choose() -> None:
    source = os.path.join(CORE, "connection.py")
    if compiled_core() is None or not os.path.exists(source):
        return  # nothing compiled, or a frozen app that bundled only the compiled module
    if not pure():
        if installed() or not _stale():
            return
        print("orisha: the compiled core is older than orisha/core/connection.py; using the .py "
              "(pip install -e . rebuilds it)", file=sys.stderr)
    sys.meta_path.insert(0, _PureCore(source))
