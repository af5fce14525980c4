"""Running a build: load it, open the listeners, hand them to the supervisor.

Strategy: the parent loads the build (so the generated module and the mapped
blob are shared by every worker after fork), opens one SO_REUSEPORT listener
per worker, chooses the loop body once and hands all of it to the
``Supervisor`` (orisha/supervisor.py), which forks the workers — worker i
serves listener i — and keeps them running through deaths, reloads and stops.
The parent keeps the listeners open until a stop: when a worker dies,
connections queued on its listener wait for the replacement instead of being
refused. SIGTERM or SIGINT: workers stop accepting (the port then refuses),
finish what is in flight and exit; the parent exits 0 when they are gone.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import socket
import sys

from . import loops
from .admin import METRICS_PATH
from .core.policy import Limits
from .loops.base import BACKLOG
from .errors import LoopUnavailable, ServeError
from .manifest import is_build
from .supervisor import Supervisor


def load_site(build_dir: str):
    """Import a build's generated module and return its ``Site``."""
    if not is_build(build_dir):
        raise ServeError(f"{build_dir}: not an Orisha build (run `orisha build SITE -o {build_dir}`)")
    path = os.path.join(build_dir, "site.py")
    spec = importlib.util.spec_from_file_location("orisha_site", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except (OSError, ValueError, SyntaxError) as e:
        raise ServeError(f"{path}: cannot load the build ({e})") from None
    return module.SITE


def listeners(host: str, port: int, count: int, share: bool = True) -> list[socket.socket]:
    """``count`` listeners on one port; ``share``: SO_REUSEPORT, so the workers of every
    generation accept from it. The admin port is not shared: a clash is an error, not a
    port whose connections the kernel deals out between two servers."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ServeError(f"{host}: cannot resolve ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, int(share))
            s.bind(addr)
            s.listen(BACKLOG)
            s.setblocking(False)
            addr = s.getsockname()  # port 0: the others join the port the first one got
    except OSError as e:
        for s in socks:
            s.close()
        what = "address already in use" if e.errno == errno.EADDRINUSE else e.strerror
        raise ServeError(f"{host}:{port}: {what}") from None
    return socks


def datagram_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` UDP sockets on the TCP port's number (HTTP/3), SO_REUSEPORT: the kernel
    hashes each datagram's 4-tuple onto one of them, so one worker sees all of a
    connection's datagrams while the set of sockets stays the same."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ServeError(f"{host}: cannot resolve ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(family, socket.SOCK_DGRAM)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(addr)
            s.setblocking(False)
    except OSError as e:
        for s in socks:
            s.close()
        what = "address already in use" if e.errno == errno.EADDRINUSE else e.strerror
        raise ServeError(f"{host}:{port}/udp: {what} (--no-http3 serves without it)") from None
    return socks


def _access_log(path: str):
    """A writer for access-log batches: appended to PATH, or to stdout for '-'."""
    try:
        fd = 1 if path == "-" else os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        raise ServeError(f"{path}: cannot open the access log ({e.strerror})") from None

    def write(data: bytes) -> None:  # O_APPEND: each worker's batch lands whole in a file
        view = memoryview(data)
        while view:  # a pipe (stdout) may take part of a large batch
            view = view[os.write(fd, view):]
    return write


def run(build_dir, host: str = "127.0.0.1", port: int = 8080, workers: int | None = None,
        loop: str | None = None, limits: Limits | None = None, announce=print,
        access_log: str | None = None, admin_port: int | None = None,
        admin_host: str = "127.0.0.1", tls_cert: str | None = None, tls_key: str | None = None,
        tls_min: str = "1.2", http3: bool = True) -> int:
    """Serve ``build_dir`` (a build folder, or an already-loaded ``Site``: the container).

    SIGHUP reloads a build folder with zero downtime: a new generation of
    workers starts on the same listeners, then the old one stops gracefully.
    ``admin_port``: health probes and metrics (orisha/admin.py) on ``admin_host``.
    ``tls_cert``/``tls_key``: the port speaks TLS (HTTP/2 by ALPN, orisha/protocols/tls.py);
    a reload reads them anew. Without them: cleartext HTTP/1.1 and h2c.
    ``http3`` (with TLS): HTTP/3 over QUIC on the same port number over UDP
    (orisha/protocols/h3.py), advertised by Alt-Svc on the TCP port's responses.
    """
    protocols = _protocols(tls_cert, tls_key, tls_min)
    protocols()  # a bad certificate or key fails here, before any port is taken
    reloadable = isinstance(build_dir, (str, os.PathLike))
    site = load_site(build_dir) if reloadable else build_dir
    name, loop_cls = _loop(loop or site.loop, bool(tls_cert and http3))
    workers = workers or os.cpu_count() or 1
    log = _access_log(access_log) if access_log else None
    if admin_port and admin_port == port:
        raise ServeError(f"--admin-port {admin_port} is the serving port too; give it another port")
    admin = listeners(admin_host, admin_port, 1, share=False)[0] if admin_port is not None else None
    limits = limits or Limits()
    socks, udp, quic, alt_svc = [], [], None, b""
    try:
        socks = listeners(host, port, workers)
        if tls_cert and http3:
            bound = socks[0].getsockname()[1]
            quic = _quic(tls_cert, tls_key, limits)
            udp = datagram_sockets(host, bound, workers)
            alt_svc = _advertise(bound)
    except ServeError:
        for s in socks + ([admin] if admin else []):
            s.close()
        raise
    sup = Supervisor(site, socks, loop_cls, limits, log=log, admin=admin,
                     load=(lambda: load_site(build_dir)) if reloadable else None,
                     name=str(build_dir) if reloadable else "", protocols=protocols,
                     udp=udp, quic=quic, alt_svc=alt_svc)
    sup.start()
    announce(_serving_line(socks[0].getsockname(), admin, name, workers, site,
                           "https" if tls_cert else "http"))
    if udp:
        print(f"orisha: HTTP/3 on udp port {socks[0].getsockname()[1]}", file=sys.stderr)
    sys.stdout.flush()
    return sup.serve()


def _loop(wanted: str, datagrams: bool = False):
    """(name, loop body class) for the loop asked for or recorded in the build; ``datagrams``:
    a body with the datagram side (HTTP/3)."""
    name, note = loops.resolve(wanted)
    if note:
        print(f"orisha: {note}", file=sys.stderr)
    try:
        return name, loops.load(name, datagrams)
    except LoopUnavailable as e:
        raise ServeError(str(e)) from None


def _protocols(cert: str | None, key: str | None, minimum: str):
    """What makes each worker generation's protocols object (orisha/protocols/)."""
    if cert is None and key is None:
        from .protocols.front import Plain  # HTTP/1.1, and h2c for clients that know
        return Plain
    if not (cert and key):
        raise ServeError("--tls-cert and --tls-key go together")
    from .protocols import tls  # ssl is imported only by a server that speaks TLS
    print(f"orisha: {tls.probe_ktls()}; TLS in user space over memory BIOs", file=sys.stderr)
    return lambda: tls.Tls(tls.context(cert, key, minimum))


def _quic(cert: str, key: str, limits: Limits):
    """What makes each worker generation's QUIC configuration (HTTP/3), and checks it once."""
    try:
        from .protocols import h3  # aioquic is imported only by a server that speaks HTTP/3
    except ImportError as e:
        raise ServeError(f"HTTP/3 needs aioquic (pip install 'orisha[h3]'), or --no-http3: {e}") \
            from None
    make = lambda: h3.configuration(cert, key, limits.idle_timeout)  # noqa: E731
    make()
    return make


def _advertise(port: int) -> bytes:
    """Alt-Svc (RFC 7838) for the TLS port's responses, known only now (the port): the
    HTTP/1.1 line the core splices beside Date, and the HTTP/2 field after h2's date."""
    from .protocols import hpack_blocks
    value = b'h3=":%d"; ma=86400' % port
    hpack_blocks.advertise(b"alt-svc", value)  # before the fork: every worker's h2 has it
    return b"Alt-Svc: " + value + b"\r\n"


def _url(addr, scheme: str = "http") -> str:
    host = f"[{addr[0]}]" if ":" in addr[0] else addr[0]
    return f"{scheme}://{host}:{addr[1]}"


def _serving_line(bound, admin, name: str, workers: int, site, scheme: str = "http") -> str:
    extra = f", admin {_url(admin.getsockname())}{METRICS_PATH}" if admin else ""
    return (f"orisha: serving {_url(bound, scheme)}/ (loop {name}, {workers} "
            f"worker{'s' if workers > 1 else ''}, pid {os.getpid()}{extra}): {site.summary}")
