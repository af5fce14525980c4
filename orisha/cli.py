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
# The build step (and brotli, zstandard, multiprocessing) is imported only by the commands
# that build: a serving process stays small, and its workers share less heap to copy.
from .embed.walk import BuildError
from .loops import BUILD_CHOICES as LOOPS
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
@click.option("--target", type=click.Choice(["server", "container"]), default="server",
              show_default=True,
              help="container: also OUT/orisha, one static executable serving the site "
                   "(and what the top-level Dockerfile needs).")
def build(site, out, fallback, not_found, cache_control, loop, no_cache, target) -> None:
    """Compile SITE into responses in OUT."""
    from .embed.build import build as run_build
    builder = run_build
    if target == "container":
        from .embed.container import build as builder
    try:
        r = builder(site, out, fallback=fallback, not_found=not_found,
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
@click.option("--access-log", metavar="PATH", help="Append a common-log-format access log to PATH ('-': stdout). Off by default.")
@click.option("--admin-port", type=int, metavar="PORT",
              help="Serve Prometheus counters at http://127.0.0.1:PORT/metrics. Off by default.")
@_limit_options
def serve(path, host, port, workers, loop, fallback, not_found, access_log, admin_port, **limits) -> None:
    """Serve a build (or a site directory, built first into a cache folder)."""
    try:
        if not is_build(path):
            path = build_into_cache(path, fallback=fallback, not_found=not_found)
        if loop is None and _is_image(path):  # a unikernel build is served by booting it
            from .boot import BootError, boot as run_boot
            try:
                sys.exit(run_boot(path, host=host, port=port, limits=Limits(**limits)))
            except BootError as e:
                _fail(str(e))
        sys.exit(run(path, host=host, port=port, workers=workers, loop=loop,
                     limits=Limits(**limits), access_log=access_log, admin_port=admin_port))
    except (BuildError, ServeError) as e:
        _fail(str(e))


@main.command()
@click.argument("path", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Host address QEMU forwards to the guest's port 80.")
@click.option("--port", default=8080, show_default=True, type=int, help="0 picks a free port.")
@click.option("--workers", type=int, help="Ignored: the unikernel runs one vCPU.")
@click.option("--accel", type=click.Choice(["auto", "kvm", "tcg"]), default="auto", show_default=True,
              help="QEMU accelerator; auto is KVM when /dev/kvm is usable.")
@click.option("--memory", type=int, metavar="MB", help="Guest RAM [default: image size + 16 MiB, at least 64].")
@_limit_options
def boot(path, host, port, workers, accel, memory, **limits) -> None:
    """Boot a unikernel build (orisha build --loop unikernel) under QEMU."""
    from .boot import BootError, boot as run_boot
    try:
        sys.exit(run_boot(path, host=host, port=port, accel=accel, memory=memory,
                          limits=Limits(**limits)))
    except BootError as e:
        _fail(str(e))


def _is_image(path: str) -> bool:
    import json
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            return json.load(f).get("loop") == "unikernel"
    except (OSError, ValueError):  # checked by is_build already; not an image then
        return False


def build_into_cache(site: str, **options) -> str:
    """Build a site directory into a per-site cache folder and return it."""
    if not os.path.isdir(site):
        raise BuildError(f"{site}: neither an Orisha build nor a site directory")
    key = hashlib.blake2b(os.path.realpath(site).encode(), digest_size=8).hexdigest()
    base = os.environ.get("ORISHA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "orisha")
    out = os.path.join(base, "builds", key)
    from .embed.build import build as run_build
    r = run_build(site, out, progress=sys.stdout.isatty(), **options)
    click.echo(_summary(r))
    return out


if __name__ == "__main__":
    main()
