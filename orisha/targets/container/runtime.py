"""The container executable's entry point: serve the build appended to this very file.

Strategy: ``orisha build SITE --target container`` (orisha/targets/container/build.py)
freezes this module, Orisha's run-time code and the build's loop into one static
executable (PyInstaller + staticx) and appends the build to its end::

    [static ELF][zero pad][site.blob, page-aligned][site code (.pyc)][site.py][manifest][trailer]

The trailer (last ``TRAILER.size`` bytes: magic and the offset and size of each
part) lets start-up find the parts with two reads. The generated module is
exec'd from its byte-compiled form (its source when the Python differs) and its
blob is mapped straight out of the executable: nothing is unpacked. staticx runs
the program from a copy in a temporary folder and names the original in
``$STATICX_PROG_PATH``; without staticx (tests, a plain PyInstaller build) the
executable is ``sys.executable``.

Only the run-time path is imported here: never click, the build step or the
compressors, so start-up stays a few tens of milliseconds of Python.
"""

from __future__ import annotations

import os
import struct
import sys

MAGIC = b"ORISHA\x00\x01"
# magic, then (offset, size) of: blob, code (.pyc bytes), source, manifest.json
TRAILER = struct.Struct("<8s8Q")
PARTS = ("blob", "code", "source", "manifest")


class Embedded:
    """Where the parts of the appended build are in the executable."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size < TRAILER.size:
                raise ValueError(f"{path}: no Orisha build appended (file too small)")
            f.seek(size - TRAILER.size)
            magic, *fields = TRAILER.unpack(f.read(TRAILER.size))
            if magic != MAGIC:
                raise ValueError(f"{path}: no Orisha build appended (run `orisha build SITE "
                                 "--target container -o OUT`)")
            self.spans = {name: (fields[2 * i], fields[2 * i + 1]) for i, name in enumerate(PARTS)}
            for name, (off, n) in self.spans.items():
                if off + n > size - TRAILER.size:
                    raise ValueError(f"{path}: the appended build is truncated ({name})")
            self.code = self._read(f, "code")
            self.manifest = self._read(f, "manifest")

    def _read(self, f, name: str) -> bytes:
        off, n = self.spans[name]
        f.seek(off)
        return f.read(n)

    def source(self) -> bytes:
        with open(self.path, "rb") as f:
            return self._read(f, "source")


def executable() -> str:
    """The file the build is appended to (the original, not staticx's temporary copy)."""
    return os.environ.get("STATICX_PROG_PATH") or sys.executable


def load_site(path: str | None = None):
    """Run the appended build's generated module and return its ``Site``."""
    import marshal
    import types
    from importlib.util import MAGIC_NUMBER
    emb = Embedded(path or executable())
    module = types.ModuleType("orisha_site")
    # The generated source was rewritten at build time to map its blob from ``__file__``
    # at the blob's offset (orisha.blob.open_blob with ``offset``).
    module.__file__ = emb.path
    if emb.code[:4] == MAGIC_NUMBER:
        code = marshal.loads(memoryview(emb.code)[16:])
    else:  # a different Python than the one that built the executable: compile the source
        code = compile(emb.source(), "site.py", "exec", dont_inherit=True)
    exec(code, module.__dict__)
    return module.SITE


def parser():
    """`orisha serve`'s options (orisha/serving/options.py, each set by its environment
    variable too) and the limits, as argparse reads them; then --health and --info."""
    import argparse

    from ...core.policy import LIMITS, RANGES
    from ...serving.options import CHOICE, RANGED, SERVE, SWITCH

    def ranged(r, flag):  # the range of orisha/core/policy.py, as `orisha serve` checks it
        def parse(text):
            try:
                return r.parse(text, flag)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
        return parse
    p = argparse.ArgumentParser(
        prog="orisha", description="Serve the static site built into this executable.")
    for o in SERVE:
        if not o.container:  # orisha serve's alone (it builds a site; this holds a build)
            continue
        default = o.env_default(os.environ)
        said = (f"default {' '.join(default) if o.many else default}"
                if default and o.values != SWITCH else "")
        said = ", ".join(x for x in (f"${o.env}" if o.env else "", said) if x)
        kw = {"dest": o.attr, "default": default,
              "help": f"{o.image_help or o.help}" + (f" [{said}]" if said else "")}
        if o.values == SWITCH:
            kw.update(action="store_const", const=not o.default)
        else:
            kw["metavar"] = o.metavar
            if o.many:
                kw["action"] = _many()
            if o.values == RANGED:
                kw["type"] = ranged(RANGES[o.flag], f"--{o.flag}")
            elif o.values == CHOICE:
                kw["choices"] = o.choices
        p.add_argument(f"--{o.flag}", **kw)
    for limit in LIMITS:
        p.add_argument(f"--{limit.flag}", dest=limit.attr, default=limit.default,
                       type=ranged(limit.range, f"--{limit.flag}"),
                       help=f"{limit.help} [default {limit.default}, {limit.range.text()}]")
    p.add_argument("--health", nargs="?", const="", metavar="URL",
                   help="Probe URL (default http://127.0.0.1:$ADMIN_PORT/readyz) and exit 0 "
                        "on a 2xx, else 1: a HEALTHCHECK for an image without a shell or curl.")
    p.add_argument("--info", action="store_true",
                   help="Print the embedded build's manifest and exit.")
    return p


def _many():
    import argparse

    class Many(argparse.Action):
        """A repeated option: each use adds a value; the first replaces $ENV's."""

        def __call__(self, parser, namespace, value, option_string=None):
            items = getattr(namespace, self.dest, None)
            if items is None or items is self.default:
                items = []
            setattr(namespace, self.dest, [*items, value])
    return Many


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    from ...core.policy import LIMITS, Limits
    from ...errors import OrishaError
    from ...serving.server import run
    if args.health is not None:
        return health(args.health, args.admin_port)
    try:
        if args.info:
            sys.stdout.write(Embedded(executable()).manifest.decode())
            return 0
        site = load_site()
    except (OSError, ValueError, SyntaxError) as e:
        print(f"orisha: error: cannot load the embedded build: {e}", file=sys.stderr)
        return 1
    limits = Limits(**{limit.attr: getattr(args, limit.attr) for limit in LIMITS})
    try:
        code = run(site, host=args.hosts, port=args.port, workers=args.workers, loop=args.loop,
                   limits=limits, access_log=args.access_log, admin_port=args.admin_port,
                   admin_host=args.admin_host, tls_cert=args.tls_cert or None,
                   tls_key=args.tls_key or None, tls_min=args.tls_min,
                   sites=sites(args.sites, site), http_port=args.http_port, hsts=args.hsts,
                   domains=args.domains or (), acme_email=args.acme_email,
                   acme_directory=args.acme_directory, acme_ca=args.acme_ca, state=args.state,
                   http3=args.http3, quic_retry=args.quic_retry)
    except OrishaError as e:
        print(f"orisha: error: {e}", file=sys.stderr)
        return 1
    drain(args.port, limits.grace)
    return code


def sites(specs: list[str] | None, embedded) -> list | None:
    """``--site`` values as ``server.run``'s (host names, build) pairs; None for one site."""
    if not specs:
        return None
    from ...errors import ServeError
    pairs = []
    for spec in specs:
        names, sep, path = spec.partition("=")
        hosts = tuple(n.strip() for n in names.split(",") if n.strip())
        if not hosts or (sep and not path):
            raise ServeError(f"--site {spec!r}: expected HOST or HOST=PATH")
        pairs.append((hosts, path if sep else embedded))
    return pairs


def stop_seconds(grace: float) -> float:
    """The longest SIGTERM → exit may take: the workers finish in-flight responses
    (``grace``), one that has not is SIGKILLed ``KILL_AFTER`` later, then ``drain``
    waits for the peers (``grace`` again). An orchestrator's grace must cover it."""
    from ...serving.pool import KILL_AFTER
    return grace + KILL_AFTER + grace


def health(url: str, admin_port: int | None) -> int:
    """``--health [URL]``: the probe ``orisha health URL`` runs, without loading the site."""
    from ...serving.admin import READY_PATH, check
    if not url:
        if not admin_port:
            print("orisha: error: --health needs a URL or $ADMIN_PORT", file=sys.stderr)
            return 1
        url = f"http://127.0.0.1:{admin_port}{READY_PATH}"
    ok, line = check(url)
    print(f"orisha: {line}" if ok else f"orisha: unhealthy: {line}",
          file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


# /proc/net/tcp states of a connection whose peer may still be receiving: ESTABLISHED,
# FIN_WAIT1, FIN_WAIT2, CLOSE_WAIT, LAST_ACK, CLOSING.
_OPEN = {"01", "04", "05", "08", "09", "0B"}


def _open_connections(port: int) -> int:
    """Connections on ``port`` (this network namespace) not yet closed by their peer."""
    n = 0
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] in _OPEN:
                n += 1
    return n


def drain(port: int, grace: float) -> None:
    """Wait (up to ``grace`` s) until the peers of the served port have closed.

    A worker that finished its responses has handed the last bytes to the kernel,
    closed and exited, but its peer may not have them yet. In a container that
    data dies with the network namespace when the program exits — and docker's
    port proxy acknowledges bytes before its client has them, so an empty send
    queue proves nothing. A peer's close does: docker-proxy closes towards the
    container only once its client has closed. So exit waits for the connections
    of the served port (read from /proc/net/tcp) to be closed from the other end."""
    import time
    deadline = time.monotonic() + grace
    while port and _open_connections(port) and time.monotonic() < deadline:
        time.sleep(0.02)


if __name__ == "__main__":
    sys.exit(main())
