"""The unikernel target's kernel: its sources, its build and its link with a site image.

Strategy: ``write`` encodes the site image (``layout.encode``), then ``link`` runs
``unikernel/build.sh``, which links the blob into ``OUT/orisha.img`` with the kernel's
objects and the headers generated from the build (``policy_header``: the image's record
layouts and the core's policy; ``h2_tables``), and the manifest records the image.

Where the kernel is built: its sources are ``unikernel_dir()`` (an installed
wheel's copy, read-only as site-packages often is, or the checkout's); the
objects and the fetched lwIP and mbedTLS trees go to the user's cache
(``manifest.cache_root``), never beside the sources.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess

from ... import manifest
from ...embed.assemble import Document
from ...errors import BuildError
from . import h2_tables, policy_header
from .layout import encode

IMAGE = "orisha.img"
BLOB = "site.img"
HERE = os.path.dirname(os.path.abspath(__file__))


def unikernel_dir() -> str:
    """The kernel's sources: ``$ORISHA_UNIKERNEL`` when set (an explicit choice, e.g. a
    modified tree), else the copy setup.py puts in a wheel beside this module, else the
    checkout's ``unikernel/`` (an editable install)."""
    explicit = os.environ.get("ORISHA_UNIKERNEL")
    if explicit:
        return explicit
    packaged = os.path.join(HERE, "tree")
    if os.path.isfile(os.path.join(packaged, "build.sh")):
        return packaged
    return os.path.normpath(os.path.join(HERE, "..", "..", "..", "unikernel"))


def build_dirs(src: str) -> tuple[str, str]:
    """(object folder, fetched-sources folder) in the cache. Objects are per source tree
    (make's timestamps keep one tree's up to date; two installs never share them); the
    fetched lwIP and mbedTLS trees do not depend on Orisha's sources and are shared."""
    key = hashlib.blake2b(os.path.realpath(src).encode(), digest_size=8).hexdigest()
    return manifest.cache_root("unikernel", "build", key), manifest.cache_root("unikernel", "sources")


# unikernel/ entries the build does not read (setup.py's UNPACKAGED leaves them out of a wheel).
_NOT_SOURCES = ("build", ".cache", "tools", "__pycache__")
DIGEST = ".sources"  # in an object folder: the digest of the tree its objects were built from


def tree_files(src: str) -> list[str]:
    """The kernel tree's source files, relative to it, in a fixed order."""
    files = []
    for dirpath, dirs, names in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d not in _NOT_SOURCES)
        files += [os.path.relpath(os.path.join(dirpath, n), src) for n in sorted(names)
                  if not n.endswith(".o")]
    return files


def tree_digest(src: str, files: list[str]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for rel in files:
        with open(os.path.join(src, rel), "rb") as f:
            h.update(rel.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _seed(objdir: str, digest: str) -> None:
    """A new object folder starts as a copy of one built from byte-identical sources (the
    checkout's and an installed wheel's tree, or a reinstall in a new venv), so make
    compiles only what differs (the site, a certificate) instead of lwIP and mbedTLS."""
    if os.path.exists(os.path.join(objdir, DIGEST)) or os.path.isdir(os.path.join(objdir, "obj")):
        return
    parent = os.path.dirname(objdir)
    for name in sorted(os.listdir(parent)):
        donor = os.path.join(parent, name)
        if donor == objdir or _read(os.path.join(donor, DIGEST)) != digest:
            continue
        with open(os.path.join(donor, ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)  # not while the donor is being built
            if _read(os.path.join(donor, DIGEST)) == digest:
                shutil.copytree(donor, objdir, dirs_exist_ok=True, symlinks=True,
                                ignore=shutil.ignore_patterns(".lock"))  # copy2: mtimes kept
                return


def link(blob_path: str, image_path: str, tls: tuple[str, str] | None = None) -> None:
    """Run unikernel/build.sh: the kernel with the blob embedded, as one ELF for QEMU -kernel
    (with ``tls``, checked (cert, key) paths, one that also serves TLS on 443)."""
    src = unikernel_dir()
    script = os.path.join(src, "build.sh")
    if not os.path.isfile(script):
        raise BuildError(f"{src}: unikernel sources not found (set ORISHA_UNIKERNEL)")
    # One shared object directory (the kernel objects do not depend on the site), so
    # concurrent builds take turns; the lock also keeps them off each other's site.bin.
    objdir, fetched = build_dirs(src)
    os.makedirs(objdir, exist_ok=True)
    env = dict(os.environ, BUILD=objdir, ORISHA_FETCHED=fetched, JOBS=os.environ.get("JOBS", "2"),
               TLS_CERT=tls[0] if tls else "", TLS_KEY=tls[1] if tls else "")
    files = tree_files(src)
    digest = tree_digest(src, files)
    stamp = os.path.join(objdir, DIGEST)
    with open(os.path.join(objdir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _seed(objdir, digest)
        # Objects built from these very bytes: the tree's files count as old for make (an
        # install writes them with new mtimes); else make's timestamps decide, as for an edit.
        if _read(stamp) == digest:
            env["ORISHA_OLD"] = " ".join(f for f in files if " " not in f)
        if os.path.exists(stamp):
            os.unlink(stamp)  # a failed build leaves objects of unknown sources
        policy_header.write(os.path.join(objdir, "gen"))  # the Makefile's $(GEN)
        h2_tables.write(os.path.join(objdir, "gen"))
        try:
            # sh: an installer may not keep the script's mode bits
            r = subprocess.run(["sh", script, blob_path, image_path], capture_output=True,
                               text=True, env=env)
        except OSError as e:
            raise BuildError(f"{script}: cannot run ({e.strerror})") from None
        if r.returncode == 0 and os.path.isfile(image_path):
            with open(stamp, "w") as f:
                f.write(digest + "\n")
    if r.returncode != 0 or not os.path.isfile(image_path):
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        why = next((ln for ln in lines if "error" in ln.lower()), lines[-1] if lines else "")
        raise BuildError(f"unikernel build failed (exit {r.returncode}): {why.strip()}")


def write(out: str, docs: list[Document], table: dict[bytes, tuple], not_found: Document,
          fallback: str | None, runtime: list = (), tls: tuple[str, str] | None = None,
          assets: frozenset | None = None) -> None:
    """Write OUT/site.img and OUT/orisha.img, and record them in OUT's manifest."""
    blob = encode(docs, table, not_found, fallback, runtime, assets)
    blob_path = os.path.join(out, BLOB)
    with open(blob_path, "wb") as f:
        f.write(blob)
    image_path = os.path.join(out, IMAGE)
    link(blob_path, image_path, tls)
    os.chmod(image_path, 0o644)
    size = os.path.getsize(image_path)
    manifest.update(out, image=IMAGE, image_bytes=size, site_image_bytes=len(blob),
                    kernel_bytes=size - len(blob), tls=bool(tls))
