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


def test_no_function_in_orisha_is_longer_than_60_lines():
    long = []
    for path in _python_files():
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    long.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({lines} lines)")
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
