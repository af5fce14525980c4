"""A build's ``manifest.json``: the one reader and writer of that format, and the cache root.

Strategy: a build folder is recognised by its manifest (``generator: orisha``);
every entry point (serve, build, boot, the container packager) asks here
instead of opening the file itself. The cache root (compression cache, builds
of site folders, frozen container bases) is named here once.
"""

from __future__ import annotations

import json
import os

NAME = "manifest.json"
GENERATOR = "orisha"
FORMAT = 1


def read(build_dir: str) -> dict | None:
    """The manifest of ``build_dir``, or None when it is not an Orisha build."""
    try:
        with open(os.path.join(build_dir, NAME), "rb") as f:
            m = json.load(f)
    except (OSError, ValueError):  # not there, unreadable or not JSON: not a build
        return None
    return m if isinstance(m, dict) and m.get("generator") == GENERATOR else None


def is_build(path: str) -> bool:
    return read(path) is not None


def write(build_dir: str, manifest: dict) -> None:
    """Write ``manifest`` (deterministically: sorted keys) into ``build_dir``."""
    manifest = {"format": FORMAT, "generator": GENERATOR, **manifest}
    with open(os.path.join(build_dir, NAME), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")


def update(build_dir: str, **fields) -> dict:
    """Add ``fields`` to the manifest of a build being written."""
    m = read(build_dir)
    if m is None:
        raise ValueError(f"{build_dir}: no manifest to update")
    m.update(fields)
    write(build_dir, m)
    return m


def replaceable(out: str) -> bool:
    """May a build replace ``out``? Only a missing or empty folder or an earlier build:
    a build never deletes a user's files."""
    if not os.path.exists(out):
        return True
    return os.path.isdir(out) and (not os.listdir(out) or is_build(out))


def cache_root(*parts: str) -> str:
    """``$ORISHA_CACHE``, else ``$XDG_CACHE_HOME/orisha``, else ``~/.cache/orisha``; joined with parts."""
    base = os.environ.get("ORISHA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "orisha")
    return os.path.join(base, *parts)
