"""The ``orisha`` command: build a site, serve a build.

Strategy: a thin click layer. Every expected failure (a bad path, a port in
use, a folder that is not a build) is an exception carrying one line, printed
as ``orisha: error: …`` with exit status 1 — never a traceback.
"""

from __future__ import annotations

import hashlib
import os
import sys

import click

from .core.connection import Limits
from .embed.build import LOOPS, build as run_build
from .embed.walk import BuildError
from .server import ServeError, is_build, run


def _fail(message: str) -> None:
    click.echo(f"orisha: error: {message}", err=True)
    sys.exit(1)


def _cache_controls(values: tuple[str, ...]) -> list[tuple[str, str]]:
    out = []
    for v in values:
        pattern, sep, value = v.partition("=")
        if not sep or not pattern or not value:
            _fail(f"--cache-control {v!r}: expected GLOB=VALUE, e.g. 'assets/*=public, max-age=600'")
        out.append((pattern, value))
    return out


def _summary(r) -> str:
    ident = r.bytes["identity"] or 1
    parts = [f"{c} {r.bytes[c]:,} ({r.bytes[c] / ident:.0%})" for c in ("gzip", "br", "zstd")
             if r.bytes[c]]
    return (f"built {r.out}: {r.files} files, {r.bytes['identity']:,} bytes"
            + (f"; {', '.join(parts)} of identity" if parts else "") + f" in {r.seconds:.1f}s")


@click.group()
@click.version_option(package_name="orisha")
def main() -> None:
    """Orisha: a static site compiled into complete HTTP responses."""


@main.command()
@click.argument("site", type=click.Path(file_okay=False))
@click.option("-o", "--out", required=True, type=click.Path(), help="Output directory.")
@click.option("--fallback", metavar="FILE", help="Document served with 200 for unknown paths (SPA mode).")
@click.option("--not-found", metavar="FILE", help="Document served with 404 for unknown paths.")
@click.option("--cache-control", "cache_control", multiple=True, metavar="GLOB=VALUE",
              help="Cache-Control for paths matching GLOB (repeatable, first match wins).")
@click.option("--loop", type=click.Choice(LOOPS), default="auto", show_default=True,
              help="Loop body the built server will use.")
@click.option("--no-cache", is_flag=True, help="Do not read or write the compression cache.")
def build(site, out, fallback, not_found, cache_control, loop, no_cache) -> None:
    """Compile SITE into responses in OUT."""
    try:
        r = run_build(site, out, fallback=fallback, not_found=not_found,
                      cache_control=_cache_controls(cache_control), loop=loop,
                      cache=None if no_cache else "", progress=sys.stdout.isatty())
    except BuildError as e:
        _fail(str(e))
    click.echo(_summary(r))


def _limit_options(f):
    d = Limits()
    for name, kind, help_ in reversed([
        ("max-connections", int, "Open connections per worker; more get 503."),
        ("head-limit", int, "Request head bytes (431 above)."),
        ("target-limit", int, "Request-target bytes (414 above)."),
        ("body-limit", int, "Request body bytes read and discarded (413 above)."),
        ("idle-timeout", float, "Seconds an idle keep-alive connection stays open."),
        ("head-timeout", float, "Seconds to receive a started request head."),
        ("send-timeout", float, "Seconds a client may take nothing before it is dropped."),
        ("pipeline", int, "Pipelined requests answered per round."),
    ]):
        attr = {"max-connections": "connections", "head-limit": "head", "target-limit": "target",
                "body-limit": "body"}.get(name, name.replace("-", "_"))
        f = click.option(f"--{name}", attr, type=kind, default=getattr(d, attr),
                         show_default=True, help=help_)(f)
    return f


@main.command()
@click.argument("path", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=int)
@click.option("--workers", type=int, help="Worker processes [default: one per core].")
@click.option("--loop", type=click.Choice(LOOPS[:-1]), help="Override the loop recorded in the build.")
@click.option("--fallback", metavar="FILE", help="When PATH is a site: SPA fallback document.")
@click.option("--not-found", metavar="FILE", help="When PATH is a site: 404 document.")
@_limit_options
def serve(path, host, port, workers, loop, fallback, not_found, **limits) -> None:
    """Serve a build (or a site directory, built first into a cache folder)."""
    try:
        if not is_build(path):
            path = build_into_cache(path, fallback=fallback, not_found=not_found)
        sys.exit(run(path, host=host, port=port, workers=workers, loop=loop,
                     limits=Limits(**limits)))
    except (BuildError, ServeError) as e:
        _fail(str(e))


def build_into_cache(site: str, **options) -> str:
    """Build a site directory into a per-site cache folder and return it."""
    if not os.path.isdir(site):
        raise BuildError(f"{site}: neither an Orisha build nor a site directory")
    key = hashlib.blake2b(os.path.realpath(site).encode(), digest_size=8).hexdigest()
    base = os.environ.get("ORISHA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "orisha")
    out = os.path.join(base, "builds", key)
    r = run_build(site, out, progress=sys.stdout.isatty(), **options)
    click.echo(_summary(r))
    return out


if __name__ == "__main__":
    main()
