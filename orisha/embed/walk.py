"""Finding the files of a site.

Strategy: a sorted, deterministic walk of the site root. Every regular file is
taken, whatever its size. Symlinks are followed when their target stays inside
the root and skipped with a warning when it leaves it (or loops). Problems that
make a build wrong (missing root, unreadable file) raise ``BuildError`` naming
the path; the CLI prints it as one line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from ..errors import BuildError


@dataclass(frozen=True)
class SourceFile:
    rel: str        # path relative to the root, '/'-separated
    path: str       # where to read it
    mtime: int      # whole seconds, for Last-Modified


def walk(root: str, warn: Callable[[str], None]) -> list[SourceFile]:
    if not os.path.exists(root):
        raise BuildError(f"{root}: no such directory")
    if not os.path.isdir(root):
        raise BuildError(f"{root}: not a directory")
    real_root = os.path.realpath(root)
    files: list[SourceFile] = []
    seen_dirs = {real_root}

    def inside(real: str) -> bool:
        return real == real_root or real.startswith(real_root + os.sep)

    def visit(dir_path: str, rel: str) -> None:
        try:
            names = sorted(os.listdir(dir_path))
        except OSError as e:
            raise BuildError(f"{dir_path}: cannot list directory ({e.strerror})") from None
        for name in names:
            path = os.path.join(dir_path, name)
            rel_name = f"{rel}/{name}" if rel else name
            if os.path.islink(path):
                real = os.path.realpath(path)
                if not inside(real):
                    warn(f"{path}: symlink points outside the site root, skipped")
                    continue
                if not os.path.exists(real):
                    warn(f"{path}: broken symlink, skipped")
                    continue
            if os.path.isdir(path):
                real = os.path.realpath(path)
                if real in seen_dirs:
                    warn(f"{path}: directory symlink loop, skipped")
                    continue
                seen_dirs.add(real)
                visit(path, rel_name)
                seen_dirs.discard(real)
            elif os.path.isfile(path):
                if not os.access(path, os.R_OK):
                    raise BuildError(f"{path}: file is not readable")
                files.append(SourceFile(rel_name, path, int(os.stat(path).st_mtime)))
            else:
                warn(f"{path}: not a regular file, skipped")

    visit(root, "")
    if not files:
        raise BuildError(f"{root}: the site directory has no files")
    return files
