"""``orisha build SITE --target unikernel``: the ordinary build, plus the booted image.

Strategy: the unikernel target wraps the build step (orisha/embed/build.py) rather than
being called from inside it. Its own options are checked first — the certificate and key
built into the image (``certs.check``), and Basic auth refused (the image has no bcrypt)
— then the build runs with ``loop="unikernel"`` and hands its documents (``Built``) to
``kernel.write``, which lays them out as the C core's site image and links the kernel into
the same temporary folder, so OUT is replaced only when both are complete.
"""

from __future__ import annotations

from ...embed.build import Result, build as build_server
from ...errors import BuildError
from . import certs, kernel


def build(site: str, out: str, *, tls: tuple[str, str] | None = None,
          basic_auth: list[str] | tuple = (), loop: str = "unikernel", **options) -> Result:
    """Build ``site`` into ``out`` with ``OUT/orisha.img`` (the kernel and the site)."""
    if basic_auth:
        raise BuildError("--basic-auth: not with --target unikernel (the booted image has no "
                         "bcrypt to check passwords); serve the build hosted or as a container")
    checked = certs.check(*tls) if tls else None  # before anything is built

    def link(tmp: str, built) -> None:
        kernel.write(tmp, built.docs, built.table, built.not_found, built.fallback,
                     built.runtime, checked, built.assets)
    return build_server(site, out, loop=loop, also=link, **options)
