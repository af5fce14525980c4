"""The ``orisha`` command: build a site, serve a build.

Strategy: a thin click layer. Every expected failure (a bad path, a port in
use, a folder that is not a build) is an exception carrying one line, printed
as ``orisha: error: …`` with exit status 1 — never a traceback.
"""

from __future__ import annotations

import sys

import click

from . import manifest
from .core.policy import DICTIONARIES_KEPT, LIMITS, RANGES, Limits, Range
# The build step (and brotli, zstandard, multiprocessing) is imported only by the commands
# that build: a serving process stays small, and its workers share less heap to copy.
from .errors import OrishaError
from .serving.options import CHOICE, RANGED, SERVE, SWITCH
from .targets import BUILD_CHOICES as LOOPS
from .targets import TARGETS, UNIKERNEL, booted, chosen


def _fail(message: str) -> None:
    click.echo(f"orisha: error: {message}", err=True)
    sys.exit(1)


class _Command(click.Command):
    """Every expected failure is an ``OrishaError``: printed as one line, exit status 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except OrishaError as e:
            _fail(str(e))


class _Group(click.Group):
    command_class = _Command


class _OneLine(click.UsageError):
    """A bad option value: one line (``orisha: error: --port 80000: out of range …``),
    exit status 2 as for every usage error, no usage text around it."""

    def show(self, file=None) -> None:
        click.echo(f"orisha: error: {self.message}", err=True)


class _Ranged(click.ParamType):
    """A numeric option read by its ``Range`` (orisha/core/policy.py), the one place the
    valid values are written: click, the container's argparse and the kernel read it."""

    def __init__(self, r: Range) -> None:
        self.range = r
        self.name = r.kind.__name__

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # a default
            return value
        flag = param.opts[0] if param is not None else "value"
        try:
            return self.range.parse(str(value), flag)
        except ValueError as e:
            raise _OneLine(str(e), ctx) from None


def _ranged(name: str, **kwargs):
    """A click option whose values are checked against ``RANGES[name]``."""
    r = RANGES[name]
    help_text = kwargs.pop("help", "")
    return click.option(f"--{name}", type=_Ranged(r), help=f"{help_text} ({r.text()})".strip(),
                        **kwargs)


def _cache_controls(values: tuple[str, ...]) -> list[tuple[str, str]]:
    out = []
    for v in values:
        pattern, sep, value = v.partition("=")
        if not sep or not pattern or not value:
            _fail(f"--cache-control {v!r}: expected GLOB=VALUE, e.g. 'assets/*=public, max-age=600'")
        out.append((pattern, value))
    return out


def loop_bodies() -> str:
    """Which body each compiled-capable loop would run, which core, which TLS layer and which
    HTTP/2 layer, and whether HTTP/3 can be served (it needs its compiled module), e.g.
    "epoll compiled, io-uring pure, core compiled, tls compiled, h2 compiled, h3 compiled"."""
    from .compiled import pure
    from .core import connection
    from .loops import COMPILED, MODULES, module
    from .protocols import h2, tls  # tls: its layer is chosen once, at its import
    core = "pure" if connection.__file__.endswith(".py") else "compiled"
    frames = "pure" if h2.__file__.endswith(".py") else "compiled"
    quic = "off"
    if not pure():
        try:
            import importlib
            importlib.import_module(".protocols.compiled_h3", __package__)  # ngtcp2's libraries
            quic = "compiled"
        except ImportError:
            pass
    return ", ".join([f"{name} {'pure' if module(name) == MODULES[name] else 'compiled'}"
                      for name in COMPILED] + [f"core {core}", f"tls {tls.LAYER}", f"h2 {frames}",
                                               f"h3 {quic}"])


@click.group(cls=_Group)
@click.version_option(package_name="orisha",  # says which loop bodies are compiled
                      message=f"%(prog)s, version %(version)s ({loop_bodies()})")
def main() -> None:
    """Orisha: a static site compiled into complete HTTP responses."""


@main.command()
@click.argument("site", type=click.Path(file_okay=False))
@click.option("-o", "--out", required=True, type=click.Path(), help="Output directory.")
@click.option("--fallback", metavar="FILE", help="Document served with 200 for unknown paths (SPA mode).")
@click.option("--fallback-all", is_flag=True,
              help="With --fallback: serve it for every unknown path, not only for navigations "
                   "(by default a missing asset — a path ending in .js, .css, .png… of a type the "
                   "site serves, or a request whose Sec-Fetch-Dest is not a document — gets 404).")
@click.option("--not-found", metavar="FILE", help="Document served with 404 for unknown paths.")
@click.option("--cache-control", "cache_control", multiple=True, metavar="GLOB=VALUE",
              help="Cache-Control for paths matching GLOB (repeatable, first match wins).")
@click.option("--loop", type=click.Choice(LOOPS), default="auto", show_default=True,
              help="Loop body the built server will use.")
@click.option("--no-cache", is_flag=True, help="Do not read or write the compression cache.")
@click.option("--target", type=click.Choice(TARGETS), default="server",
              show_default=True,
              help="container: also OUT/orisha, one static executable serving the site "
                   "(and what the top-level Dockerfile needs); unikernel: also OUT/orisha.img, "
                   "the site booted as its own OS image (orisha boot; --loop unikernel is "
                   "another name for it).")
@click.option("--symlinks", type=click.Choice(["follow", "inside"]), default="follow",
              show_default=True,
              help="follow: serve what every symlink points at; inside: only targets inside "
                   "SITE (for trees you do not trust).")
@click.option("--header", "headers", multiple=True, metavar="GLOB:NAME=VALUE",
              help="Add a header to files matching GLOB (repeatable; like a _headers file).")
@click.option("--redirect", "redirects", multiple=True, metavar='"FROM TO [STATUS]"',
              help="A _redirects rule, as one string (repeatable; before the site's _redirects).")
@click.option("--autoindex", is_flag=True,
              help="Generate a listing (like nginx's autoindex) for folders without index.html.")
@click.option("--basic-auth", "basic_auth", multiple=True, metavar="GLOB=HTPASSWD",
              help="Paths matching GLOB (as in _headers: '/private/*') need a user and password "
                   "of HTPASSWD, an Apache htpasswd file of bcrypt entries (htpasswd -B); "
                   "repeatable, first match wins. Not with --target unikernel.")
@click.option("--no-early-hints", "no_early_hints", is_flag=True,
              help="Do not turn a page's stylesheets, head scripts and preloads into a Link "
                   "field and a 103 Early Hints (sent over HTTP/2).")
@click.option("--strict-links", is_flag=True,
              help="A broken internal link (href, src, srcset, CSS url() the site does not "
                   "answer) is an error: exit 1, nothing written. By default: one warning each.")
@click.option("--dictionaries", "keep", type=_Ranged(RANGES["dictionaries"]),
              default=DICTIONARIES_KEPT, show_default=True, metavar="K", help="Compression dictionaries (RFC 9842): JS, CSS, wasm, JSON and "
              "pages announce Use-As-Dictionary, and a returning browser holding a version from "
              "one of the last K builds into OUT gets a dcz delta from it.")
@click.option("--no-dictionaries", is_flag=True,
              help="No Use-As-Dictionary, no dcz deltas, no history kept in OUT.")
@click.option("--tls-cert", metavar="FILE", help="With --target unikernel: PEM certificate (chain "
              "allowed) built into the image, which then serves TLS on port 443.")
@click.option("--tls-key", metavar="FILE", help="With --target unikernel: PEM private key of --tls-cert.")
def build(site, out, fallback, fallback_all, not_found, cache_control, loop, no_cache, target,
          symlinks, headers, redirects, autoindex, basic_auth, no_early_hints, strict_links,
          keep, no_dictionaries, tls_cert, tls_key) -> None:
    """Compile SITE into responses in OUT."""
    if fallback_all and not fallback:
        raise click.UsageError("--fallback-all goes with --fallback FILE")
    if bool(tls_cert) != bool(tls_key):
        raise click.UsageError("--tls-cert and --tls-key go together")
    try:
        target, loop, note = chosen(target, loop)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if note:
        click.echo(f"orisha: {note}", err=True)
    if tls_cert and target != UNIKERNEL:
        raise click.UsageError("--tls-cert/--tls-key: built into --target unikernel images only "
                               "(the hosted server takes them at `orisha serve`)")
    from .targets import build as builder
    r = builder(site, out, target=target, loop=loop, fallback=fallback, not_found=not_found,
                cache_control=_cache_controls(cache_control),
                cache=None if no_cache else "", progress=sys.stdout.isatty(),
                symlinks=symlinks, headers=headers, redirects=redirects, autoindex=autoindex,
                fallback_all=fallback_all, strict_links=strict_links, basic_auth=basic_auth,
                early_hints=not no_early_hints, keep=0 if no_dictionaries else keep,
                tls=(tls_cert, tls_key) if tls_cert else None)
    from .embed.build import summary
    click.echo(summary(r))


def _limit_options(f):
    """One click option per limit in ``orisha.core.policy.LIMITS``."""
    for limit in reversed(LIMITS):
        f = click.option(f"--{limit.flag}", limit.attr, type=_Ranged(limit.range),
                         default=limit.default, show_default=True,
                         help=f"{limit.help} ({limit.range.text()})")(f)
    return f


def _serve_options(f):
    """One click option per ``orisha.serving.options.SERVE``: the table the container's
    executable reads too."""
    for o in reversed(SERVE):
        text, kw = o.help, {"metavar": o.metavar}
        if o.values == RANGED:
            kw["type"] = _Ranged(RANGES[o.flag])
            text += f" ({RANGES[o.flag].text()})"
        elif o.values == CHOICE:
            kw["type"] = click.Choice(o.choices)
        if o.values == SWITCH:
            kw = {"is_flag": True, "flag_value": not o.default, "default": o.default}
        else:
            kw["multiple"] = o.many
            if o.default is not None:
                kw.update(default=o.default, show_default=True)
        if o.default_text:
            text += f"  [default: {o.default_text}]"
        f = click.option(f"--{o.flag}", o.attr, help=text, **kw)(f)
    return f


@main.command()
@click.argument("path", type=click.Path(), required=False)
@_serve_options
@_limit_options
def serve(path, sites, hosts, port, workers, loop, fallback, not_found, access_log, admin_port,
          admin_host, tls_cert, tls_key, tls_min, http_port, hsts, domains, acme_email,
          acme_directory, acme_ca, state, http3, quic_retry, **limits) -> None:
    """Serve a build (or a site directory, built first into a cache folder)."""
    from .serving.server import LOOPBACK, hosts_of
    host = hosts_of(hosts) if hosts else LOOPBACK  # both loopback families (::1 where it exists)
    acme_sites = bool(sites) and bool(acme_email) and not tls_cert  # each site's names
    if port is None:  # a CA validates TLS-ALPN-01 on 443 (RFC 8737 §3), HTTP-01 on 80
        port = 443 if domains or acme_sites else 8080
    pairs = _sites(path, sites, fallback, not_found)
    path = pairs[0][1]
    if len(pairs) == 1:
        if acme_sites:  # one site: its names are the one certificate's
            from .serving.server import check_site_names
            check_site_names(pairs, domains)
            domains = pairs[0][0]
        pairs = None  # one site, as ever: no host table, no lookup
    elif any(booted(out) for _, out in pairs):
        raise click.UsageError("--site: a unikernel image serves one site (boot each image)")
    if loop is None and booted(path):
        from .targets.unikernel.boot import boot as run_boot  # an image is served by booting it
        if len(host) > 1 and hosts:  # the image's forward has one address (boot's default)
            raise click.UsageError("--host: a unikernel image is forwarded from one address")
        sys.exit(run_boot(path, host=host[0], port=port, limits=Limits(**limits)))
    from .serving.server import run
    sys.exit(run(path, host=host, port=port, workers=workers, loop=loop,
                 limits=Limits(**limits), access_log=access_log, admin_port=admin_port,
                 admin_host=admin_host, tls_cert=tls_cert, tls_key=tls_key, tls_min=tls_min,
                 sites=pairs, http_port=http_port, hsts=hsts, domains=domains,
                 acme_email=acme_email, acme_directory=acme_directory, acme_ca=acme_ca,
                 state=state, http3=http3, quic_retry=quic_retry))


def _sites(path, sites, fallback, not_found) -> list[tuple[tuple[str, ...], str]]:
    """``--site HOST=PATH`` (or the one PATH) as (host names, build folder) pairs."""
    if bool(path) == bool(sites):
        raise click.UsageError("give PATH or --site HOST=PATH (several), not both" if path
                               else "missing PATH (or --site HOST=PATH)")
    pairs = []
    for spec in sites or (f"*={path}",):
        names, sep, out = spec.partition("=")
        hosts = tuple(n.strip() for n in names.split(",") if n.strip())
        if not sep or not out or not hosts:
            raise click.UsageError(f"--site {spec!r}: expected HOST=PATH (e.g. example.org=_site)")
        if not manifest.is_build(out):
            out = build_into_cache(out, fallback=fallback, not_found=not_found)
        pairs.append((hosts, out))
    return pairs


@main.command()
@click.argument("path", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Host address QEMU forwards to the guest's port 80 (443 for an image built with TLS).")
@_ranged("port", default=8080, show_default=True, help="0 picks a free port.")
@click.option("--accel", type=click.Choice(["auto", "kvm", "tcg"]), default="auto", show_default=True,
              help="QEMU accelerator; auto is KVM when /dev/kvm is usable.")
@_ranged("memory", metavar="MB",
              help="Guest RAM [default: the image's end, bss included, + 1 MiB].")
@_ranged("http-port", metavar="PORT", help="For an image built with --tls-cert "
              "(whose TLS port --port reaches): also forward PORT to its plain port 80 (0: a free port).")
@_ranged("cpus", default=1, show_default=True,
         help="vCPUs (QEMU -smp; the kernel reads the count from its command line).")
@click.option("--tap", metavar="NAME", help="Attach the guest to tap device NAME instead of "
              "user networking (multi_queue for --cpus > 1: a queue pair per vCPU); it answers "
              "on its own address, ports 80 and 443 (--port does not apply).")
@click.option("--address", metavar="A.B.C.D/NN", help="With --tap: the guest's static address "
              "(no DHCP) [default: DHCP on the tap's side].")
@click.option("--gateway", metavar="A.B.C.D", help="With --address: the guest's default gateway.")
@_limit_options
def boot(path, host, port, accel, memory, http_port, cpus, tap, address, gateway, **limits) -> None:
    """Boot a unikernel build (orisha build --target unikernel) under QEMU."""
    from .targets.unikernel.boot import boot as run_boot
    sys.exit(run_boot(path, host=host, port=port, accel=accel, memory=memory,
                      limits=Limits(**limits), http_port=http_port, cpus=cpus, tap=tap,
                      address=address, gateway=gateway))


@main.command()
@click.argument("url")
@_ranged("timeout", default=3.0, show_default=True, help="Seconds to wait.")
def health(url, timeout) -> None:
    """Exit 0 if URL answers 2xx (e.g. http://127.0.0.1:9090/readyz), else 1 and why."""
    from .serving.admin import check
    ok, line = check(url, timeout)
    click.echo(f"orisha: {line}" if ok else f"orisha: unhealthy: {line}", err=not ok)
    sys.exit(0 if ok else 1)


def build_into_cache(site: str, **options) -> str:
    """Build a site directory into its cache folder, say so, and return the folder."""
    from .embed.build import into_cache, summary
    r = into_cache(site, progress=sys.stdout.isatty(), **options)
    click.echo(summary(r))
    return r.out


if __name__ == "__main__":
    main()
