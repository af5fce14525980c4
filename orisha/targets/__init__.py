"""Deployment targets beyond the hosted server: each keeps its build-time and run-time code together.

- ``container``: ``build`` freezes Orisha into one static executable with the build
  appended; ``runtime`` is that executable's entry point.
- ``unikernel``: ``build`` wraps the build step and adds the image, which ``layout`` lays
  out for the C core and ``kernel`` links with the kernel; ``boot`` runs it under QEMU;
  ``policy_header`` writes the C core's policy header.

Strategy: a target wraps the build (orisha/embed/build.py knows no target). ``build``
below is the one place a build is routed to its target, by ``--target`` and ``--loop``;
each target is imported only when chosen.
"""

from __future__ import annotations

from .. import manifest
from ..errors import BuildError
from ..loops import MODULES

UNIKERNEL = "unikernel"  # the target (and the loop name) of the booted image
TARGETS = ("server", "container", UNIKERNEL)
# What ``orisha build --loop`` accepts: the hosted loops, auto, and the booted image.
BUILD_CHOICES = (*MODULES, "auto", UNIKERNEL)


def chosen(target: str, loop: str) -> tuple[str, str, str | None]:
    """(target, loop, a note for stderr or None) of ``orisha build --target --loop``:
    ``--loop unikernel`` is ``--target unikernel`` (which the note says); the image has no
    loop body to choose. ValueError for a combination that means nothing."""
    if loop == UNIKERNEL:
        if target == "container":
            raise ValueError("--loop unikernel: the image is --target unikernel, not with "
                             "--target container")
        note = "--loop unikernel is --target unikernel" if target == "server" else None
        return UNIKERNEL, UNIKERNEL, note
    if target == UNIKERNEL and loop != "auto":
        raise ValueError(f"--loop {loop}: a unikernel image has no loop body to choose "
                         "(--target unikernel)")
    return target, UNIKERNEL if target == UNIKERNEL else loop, None


def build(site: str, out: str, *, target: str = "server", loop: str = "auto",
          tls: tuple[str, str] | None = None, **options):
    """Build ``site`` into ``out`` for ``target`` (``TARGETS``) and ``loop`` (a unikernel
    image's is ``unikernel``, the name its manifest records)."""
    if loop not in BUILD_CHOICES:
        raise BuildError(f"--loop {loop}: unknown loop (choose from {', '.join(BUILD_CHOICES)})")
    if target == UNIKERNEL:
        loop = UNIKERNEL
    if target == "container":
        from .container.build import build as builder
    elif loop == UNIKERNEL:
        from .unikernel.build import build as builder
        options["tls"] = tls
    else:
        from ..embed.build import build as builder
    if tls and loop != UNIKERNEL:
        raise BuildError("--tls-cert/--tls-key: built into --target unikernel images only "
                         "(the hosted server takes them at `orisha serve`)")
    return builder(site, out, loop=loop, **options)


def booted(out: str) -> bool:
    """Whether the build in ``out`` is served by booting it (``orisha serve`` of an image)."""
    return manifest.read(out).get("loop") == UNIKERNEL
