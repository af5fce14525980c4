"""Finding the files of a site.

Strategy: a sorted, deterministic walk of the site root. Every regular file is
taken, whatever its size. Symlinks are followed wherever they point (the
author built the tree: Debian's HTML documentation links its scripts into
/usr/share/javascript, and nginx, Caddy and static-web-server serve them);
``symlinks="inside"`` keeps only links whose target stays inside the root, for
trees nobody vouches for. A broken or unreadable link, a link leaving the root
under ``inside`` and a directory link back into its own ancestors (a cycle)
are skipped with a one-line warning each, so the walk always ends. Problems
that make a build wrong (missing root, unreadable regular file) raise
``BuildError`` naming the path; the CLI prints it as one line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from ..errors import BuildError

SYMLINKS = ("follow", "inside")


@dataclass(frozen=True)
class SourceFile:
    rel: str        # path relative to the root, '/'-separated
    path: str       # where to read it
    mtime: int      # whole seconds, for Last-Modified


def walk(root: str, warn: Callable[[str], None], symlinks: str = "follow") -> list[SourceFile]:
    if symlinks not in SYMLINKS:
        raise BuildError(f"--symlinks {symlinks}: choose {' or '.join(SYMLINKS)}")
    if not os.path.exists(root):
        raise BuildError(f"{root}: no such directory")
    if not os.path.isdir(root):
        raise BuildError(f"{root}: not a directory")
    real_root = os.path.realpath(root)
    files: list[SourceFile] = []

    def inside(real: str) -> bool:
        return real == real_root or real.startswith(real_root + os.sep)

    def link_ok(path: str) -> bool:
        real = os.path.realpath(path)
        if not os.path.exists(real):
            warn(f"{path}: broken symlink, skipped")
        elif symlinks == "inside" and not inside(real):
            warn(f"{path}: symlink points outside the site root ({real}), skipped (--symlinks inside)")
        elif not os.access(real, os.R_OK | (os.X_OK if os.path.isdir(real) else 0)):
            warn(f"{path}: symlink target {real} is not readable, skipped")
        else:
            return True
        return False

    def visit(dir_path: str, rel: str, ancestors: frozenset) -> None:
        try:
            names = sorted(os.listdir(dir_path))
        except OSError as e:
            raise BuildError(f"{dir_path}: cannot list directory ({e.strerror})") from None
        for name in names:
            path = os.path.join(dir_path, name)
            rel_name = f"{rel}/{name}" if rel else name
            if os.path.islink(path) and not link_ok(path):
                continue
            if os.path.isdir(path):
                real = os.path.realpath(path)
                if real in ancestors:  # a cycle: this directory contains itself
                    warn(f"{path}: directory symlink loop, skipped")
                    continue
                visit(path, rel_name, ancestors | {real})
            elif os.path.isfile(path):
                if not os.access(path, os.R_OK):
                    raise BuildError(f"{path}: file is not readable")
                files.append(SourceFile(rel_name, path, int(os.stat(path).st_mtime)))
            else:
                warn(f"{path}: not a regular file, skipped")

    visit(root, "", frozenset((real_root,)))
    if not files:
        raise BuildError(f"{root}: the site directory has no files")
    return files
