"""Orisha: a static site compiled into complete HTTP responses.

The Python API mirrors the three declarations of a small program::

    import orisha
    site = orisha.static("site", root="sites/demo", fallback="200.html")
    orisha.serve(site, port=3000)
"""

from __future__ import annotations

from .compiled import choose as _choose_builds

__all__ = ["static", "serve", "StaticSite"]

_choose_builds()  # the compiled core or its .py, before anything imports it (compiled.py)


class StaticSite:
    """A declared site. (A plain class: ``dataclasses`` would pull ``inspect`` into every
    start-up, the container's included.)"""

    __slots__ = ("name", "root", "fallback", "not_found")

    def __init__(self, name: str, root: str, fallback: str | None = None,
                 not_found: str | None = None) -> None:
        self.name, self.root, self.fallback, self.not_found = name, root, fallback, not_found

    def __repr__(self) -> str:
        return f"StaticSite({self.name!r}, root={self.root!r}, fallback={self.fallback!r})"


def static(name: str, root: str, fallback: str | None = None,
           not_found: str | None = None) -> StaticSite:
    """Declare a static site rooted at ``root``."""
    return StaticSite(name, root, fallback, not_found)


def serve(site: StaticSite, port: int = 8080, host: str = "127.0.0.1",
          workers: int | None = None, loop: str | None = None) -> int:
    """Build ``site`` (into a cache folder) and serve it until SIGTERM/SIGINT."""
    from .embed.build import into_cache, summary
    from .serving.server import run
    r = into_cache(site.root, fallback=site.fallback, not_found=site.not_found)
    print(summary(r), flush=True)
    out = r.out
    return run(out, host=host, port=port, workers=workers, loop=loop)
