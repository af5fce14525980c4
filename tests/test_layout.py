"""The shape of the code base: one source of truth for policy, functions that fit on a screen.

These are checks a reviewer would otherwise do by hand (../shared/STYLE.md):
the method list and the default limits are typed in exactly one file
(orisha/core/policy.py) — the CLI, the container, the kernel command line and
the C core take them from there — and no function in orisha/ grows past ~60 lines.
"""

from __future__ import annotations

import ast
import os
import re

from conftest import ROOT

ORISHA = os.path.join(ROOT, "orisha")
POLICY = os.path.join(ORISHA, "core", "policy.py")
C_SOURCES = os.path.join(ROOT, "unikernel", "src")


def _python_files():
    for dirpath, dirs, names in os.walk(ORISHA):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for n in sorted(names):
            if n.endswith(".py"):
                yield os.path.join(dirpath, n)


def _cython_files():
    for dirpath, dirs, names in os.walk(ORISHA):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for n in sorted(names):
            if n.endswith((".pyx", ".pxd")):
                yield os.path.join(dirpath, n)


# A Cython function: ``def``, ``cpdef`` or ``cdef`` (not a class, struct or extern block)
# with a parameter list, its signature (over one or more lines) ending in a colon.
_CDEF = re.compile(r"^(\s*)(?:async\s+def|def|cpdef|cdef(?!\s+(?:class|struct|enum|extern|union)\b))\b")


def _cython_functions(text: str):
    """(line, name, lines) of each function with a body in a .pyx or .pxd source: from its
    first line to its last line indented deeper than it (comments and blank lines past the
    last statement not counted). The ``ast`` module cannot read Cython."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        m = _CDEF.match(line)
        if not m or "(" not in line:
            continue
        j, sig = i, line
        while not re.search(r":\s*(#.*)?$", sig) and j + 1 < len(lines) \
                and sig.count("(") > sig.count(")"):
            j += 1
            sig += lines[j]
        if not re.search(r":\s*(#.*)?$", sig):
            continue  # a declaration (a .pxd's, or a cdef variable): no body
        indent, last = len(m.group(1)), j
        for k in range(j + 1, len(lines)):
            code = lines[k].strip()
            if code and not code.startswith("#"):
                if len(lines[k]) - len(lines[k].lstrip()) <= indent:
                    break
                last = k
        yield i + 1, re.search(r"(\w+)\s*\(", sig).group(1), last - i + 1


def test_cython_functions_are_measured():
    """The reader above, on a piece of Cython whose lengths are known."""
    text = ("cdef class A:\n    cdef int x\n    cdef int f(self, int a,\n               int b) nogil:\n"
            "        return a\n\n        # a comment\n    def g(self):\n        pass\n"
            "cpdef bytes h(double now)\n")
    assert list(_cython_functions(text)) == [(3, "f", 3), (8, "g", 2)]


def test_no_function_in_orisha_is_longer_than_60_lines():
    """Python by its syntax tree, and the compiled sources (.pyx, .pxd) by their indents."""
    long = []
    for path in _python_files():
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    long.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    for path in _cython_files():
        for line, name, lines in _cython_functions(open(path, encoding="utf-8").read()):
            if lines > 60:
                long.append(f"{os.path.relpath(path, ROOT)}:{line} {name} ({lines} lines)")
    assert not long, long


def test_no_class_in_orisha_is_longer_than_250_lines():
    """One class per concern (issue 34: the supervisor was 343 lines of six). The compiled
    protocol state machines are the exception: a module with a .pxd beside it (the core's
    Connection, HTTP/2's H2Connection) is compiled whole, where a class split in two costs
    a call through Python objects on every frame."""
    long = []
    for path in _python_files():
        if os.path.exists(path[:-3] + ".pxd"):
            continue
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 250:
                long.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} "
                            f"({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long


def test_every_python_folder_is_a_package():
    for dirpath, dirs, names in os.walk(ORISHA):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        assert "__init__.py" in names, f"{os.path.relpath(dirpath, ROOT)} has no __init__.py"


def _literals(path: str) -> list:
    tree = ast.parse(open(path, encoding="utf-8").read())
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]


def test_methods_and_default_limits_are_typed_once():
    """Known methods, and a limit's name next to its default value, appear only in core/policy.py."""
    from orisha.core.policy import KNOWN_METHODS, LIMITS
    methods = set(KNOWN_METHODS) | {m.decode() for m in KNOWN_METHODS}
    pairs = [re.compile(rf"\b(?:{re.escape(limit.attr)}|{re.escape(limit.flag)})\b[^\n]{{0,24}}?"
                        rf"[=:,(]\s*{re.escape(repr(limit.default))}(?![\w.])")
             for limit in LIMITS]
    for path in _python_files():
        if path == POLICY:
            continue
        found = set(_literals(path)) & methods
        assert not found, f"{path} types methods {found}"
        text = open(path, encoding="utf-8").read()
        for pattern in pairs:
            m = pattern.search(text)
            assert m is None, f"{path}: a default limit typed again: {m.group()}"


def test_the_c_core_types_no_policy():
    """Methods, default limits and option names reach the C core from the generated header."""
    for name in sorted(os.listdir(C_SOURCES)):
        if not name.endswith((".c", ".h")):
            continue
        text = open(os.path.join(C_SOURCES, name), encoding="utf-8").read()
        code = re.sub(r"/\*.*?\*/|//[^\n]*", "", text, flags=re.S)  # comments may name them
        for word in ("POST", "OPTIONS", "TRACE", "CONNECT"):
            assert f'"{word}' not in code, f"unikernel/src/{name} types the method {word}"
        for option in ("idle_timeout", "head_timeout", "send_timeout"):
            assert f'"{option}"' not in code, f"unikernel/src/{name} types the option {option}"
        assert not re.search(r"=\s*8192\b|=\s*15000\b|=\s*10000\b", code), \
            f"unikernel/src/{name} types a default limit"


def _imports(text: str, package: str) -> list[str]:
    """Every module ``text`` (a module of ``package``) imports, at the top or inside a
    function, made absolute."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[:len(parts) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out += [mod] + [f"{mod}.{a.name}" for a in node.names]
    return out


def test_the_build_step_knows_no_target():
    """Targets wrap the build (orisha/targets/__init__.py routes it): nothing in embed/
    imports targets/, not even lazily inside a function."""
    embed = os.path.join(ORISHA, "embed")
    found = [f"{os.path.relpath(p, ROOT)}: {m}" for p in _python_files()
             if p.startswith(embed + os.sep)
             for m in _imports(open(p, encoding="utf-8").read(), "orisha.embed")
             if m == "orisha.targets" or m.startswith("orisha.targets.")]
    assert not found, found
    # the check sees a lazy relative import of a target (embed/build.py had one)
    assert "orisha.targets.unikernel.image" in _imports(
        "def f():\n    from ..targets.unikernel import image\n", "orisha.embed")


def test_no_loop_is_chosen_outside_the_places_that_choose_it():
    """``loop == "unikernel"`` and the like: only orisha/loops/__init__.py (the loop
    bodies) and orisha/targets/ (the targets) compare a loop's name."""
    compare = re.compile(r"""\bloop\b\)?\s*[!=]=|[!=]=\s*["'](?:epoll|io-uring|kqueue|asyncio|unikernel)["']""")
    allowed = (os.path.join(ORISHA, "loops", "__init__.py"), os.path.join(ORISHA, "targets"))
    found = [f"{os.path.relpath(p, ROOT)}:{i}" for p in _python_files()
             if not p.startswith(allowed) for i, line in enumerate(open(p, encoding="utf-8"), 1)
             if compare.search(line)]
    assert not found, found
