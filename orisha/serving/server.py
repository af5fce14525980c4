"""Running a build: load it, open the listeners, hand them to the supervisor.

Strategy: the parent loads the build (so the generated module and the mapped
blob are shared by every worker after fork), opens one SO_REUSEPORT listener
per worker, chooses the loop body once and hands all of it to the
``Supervisor`` (orisha/serving/supervisor.py), which forks the workers — worker i
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

from .. import loops
from . import ports
from .admin import METRICS_PATH
from ..core.hosts import Hosts
from ..core.policy import Limits
from ..loops.base import BACKLOG
from ..errors import LoopUnavailable, ServeError
from ..manifest import is_build
from .supervisor import Supervisor
from .watch import FileWatch


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


def load_sites(sites, previous=None, load=load_site):
    """A ``Hosts`` table (orisha/core/hosts.py) of ``sites``, (host names, build folder) pairs.

    ``previous``: a reload's table; a site whose build does not load keeps its previous
    build, with a line saying which, and the others move on. At start-up any failure is
    the error."""
    loaded = []
    for i, (names, out) in enumerate(sites):
        if not isinstance(out, (str, os.PathLike)):  # loaded already (the container's own)
            loaded.append((names, out))
            continue
        try:
            loaded.append((names, load(out)))
        except ServeError as e:
            if previous is None:
                raise
            print(f"orisha: reload of site {names[0]} failed, it keeps its previous build: {e}",
                  file=sys.stderr)
            loaded.append((names, previous.sites[i]))
    return Hosts(loaded)


def _site_loader(sites, first, loader=load_site):
    """What a SIGHUP runs: every site again, each falling back to what it served."""
    last = [first]

    def load():
        last[0] = load_sites(sites, last[0], loader)
        return last[0]
    return load


LOOPBACK = ("127.0.0.1", "::1")  # --host's default: both loopback families (RFC 6761 §6.3:
# `localhost` may resolve to either, and browsers try ::1 first)
PORT_TRIES = 8  # port 0 on several addresses: fresh ports tried when one is taken elsewhere


class PortError(ServeError):
    """A listener that could not be bound; ``errno`` says why (EADDRINUSE: taken)."""

    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(message)
        self.errno = code


def hosts_of(host) -> tuple[str, ...]:
    """``--host``'s addresses: one string (commas allowed: ``127.0.0.1,::1``) or several;
    an IPv6 address may be bracketed as in a URL (``[::1]``)."""
    items = (host,) if isinstance(host, str) else tuple(host)
    hosts = [h.strip() for item in items for h in item.split(",")]
    hosts = [h[1:-1] if h[:1] == "[" and h[-1:] == "]" else h for h in hosts]
    if not hosts or not all(hosts):
        raise ServeError(f"--host: an empty address in {', '.join(map(repr, items)) or 'nothing'}")
    return tuple(dict.fromkeys(hosts))  # one address given twice is bound once


def _resolve(host: str, port: int, kind: int):
    try:
        infos = socket.getaddrinfo(host, port, type=kind, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise PortError(f"{host}: cannot resolve ({e.strerror})", errno.EADDRNOTAVAIL) from None
    return infos[0][0], infos[0][4]


def _v6only(s: socket.socket, on: bool) -> None:
    # Beside other addresses an IPv6 wildcard takes IPv6 only, so `--host 0.0.0.0 --host ::`
    # binds both (nginx's ipv6only=on); alone, `::` stays dual-stack as the kernel makes it.
    if on and s.family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)


def listeners(host: str, port: int, count: int, share: bool = True,
              v6only: bool = False) -> list[socket.socket]:
    """``count`` listeners on one port; ``share``: SO_REUSEPORT, so the workers of every
    generation accept from it. The admin port is not shared: a clash is an error, not a
    port whose connections the kernel deals out between two servers."""
    family, addr = _resolve(host, port, socket.SOCK_STREAM)
    with ports.Claim(port):  # held from the probe until the group listens
        return _group(host, port, family, addr, count, share, v6only)


def _group(host: str, port: int, family: int, addr, count: int, share: bool,
           v6only: bool) -> list[socket.socket]:
    """The listeners, once the probe found the port free (orisha/serving/ports.py)."""
    taken = ports.probe(family, addr, v6only=v6only) if port else None
    if taken is not None:
        raise PortError(_taken(host, port, taken), taken.errno)
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, int(share))
            _v6only(s, v6only)
            s.bind(addr)
            s.listen(BACKLOG)
            s.setblocking(False)
            addr = s.getsockname()  # port 0: the others join the port the first one got
    except OSError as e:
        for s in socks:
            s.close()
        raise PortError(_taken(host, port, e), e.errno) from None
    return socks


def _taken(host: str, port: int, e: OSError) -> str:
    if e.errno != errno.EADDRINUSE:
        return f"{host}:{port}: {e.strerror}"
    who = ports.holder(port, host=host)
    return f"{host}:{port}: port {port} is already in use" + (f" by {who}" if who else "")


def datagram_sockets(host: str, port: int, count: int, v6only: bool = False) -> list[socket.socket]:
    """``count`` UDP sockets on the TCP port's number (HTTP/3), SO_REUSEPORT: the kernel
    hashes each datagram's 4-tuple onto one of them, so one worker sees all of a
    connection's datagrams while the set of sockets stays the same."""
    family, addr = _resolve(host, port, socket.SOCK_DGRAM)
    with ports.Claim(port):  # as the TCP port's: a held UDP port is not joined either
        taken = ports.probe(family, addr, socket.SOCK_DGRAM, v6only=v6only)
        if taken is not None:
            raise PortError(_taken_udp(host, port, taken), taken.errno)
        return _datagram_group(host, port, family, addr, count, v6only)


def _taken_udp(host: str, port: int, e: OSError) -> str:
    if e.errno != errno.EADDRINUSE:
        return f"{host}:{port}/udp: {e.strerror} (--no-http3 serves without it)"
    who = ports.holder(port, udp=True, host=host)
    return (f"{host}:{port}/udp: port {port}/udp is already in use" + (f" by {who}" if who else "")
            + " (--no-http3 serves without HTTP/3)")


def _datagram_group(host: str, port: int, family: int, addr, count: int,
                    v6only: bool) -> list[socket.socket]:
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(family, socket.SOCK_DGRAM)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            _v6only(s, v6only)
            s.bind(addr)
            s.setblocking(False)
    except OSError as e:
        for s in socks:
            s.close()
        what = "address already in use" if e.errno == errno.EADDRINUSE else e.strerror
        raise PortError(f"{host}:{port}/udp: {what} (--no-http3 serves without it)", e.errno) from None
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


def run(build_dir, host: str | tuple = "127.0.0.1", port: int = 8080, workers: int | None = None,
        loop: str | None = None, limits: Limits | None = None, announce=print,
        access_log: str | None = None, admin_port: int | None = None,
        admin_host: str = "127.0.0.1", tls_cert: str | None = None, tls_key: str | None = None,
        tls_min: str = "1.2", sites=None, http_port: int | None = None, hsts: int | None = None,
        domains=(), acme_email: str | None = None, acme_directory: str | None = None,
        acme_ca: str | None = None, state: str | None = None, http3: bool = True,
        quic_retry=False) -> int:
    """Serve ``build_dir`` (a build folder, or an already-loaded ``Site``: the container).

    ``host``: one address or several (``hosts_of``); ``workers`` in all, spread over them
    (each address at least one: the supervisor forks one worker per listener).
    SIGHUP reloads a build folder with zero downtime: a new generation of
    workers starts on the same listeners, then the old one stops gracefully.
    ``admin_port``: health probes and metrics (orisha/serving/admin.py) on ``admin_host``.
    ``tls_cert``/``tls_key``: the port speaks TLS (HTTP/2 by ALPN, orisha/protocols/tls.py);
    a reload reads them anew, and so does a change to either file (polled each second).
    Without them: cleartext HTTP/1.1 and h2c. Both may be sequences of as many files: SNI
    picks the certificate (``tls.by_sni``). ``sites``: several sites, (host names, build
    folder) pairs, instead of ``build_dir``; Host (HTTP/2: :authority) chooses one, the
    first answers unknown hosts. ``domains``: certificates from ACME (orisha/serving/acme.py);
    with ``sites``, ``acme_email`` alone gets each site a certificate for its names.
    ``http_port`` (TLS only): the plain port, which redirects to https and answers ACME
    HTTP-01; ``hsts``: Strict-Transport-Security max-age on TLS answers. ``http3`` (TLS):
    HTTP/3 on the port's number over UDP (compiled_h3; Alt-Svc); ``quic_retry``: Retry them all.
    """
    acme = _acme(domains, tls_cert, acme_email, acme_directory, acme_ca, state, tls_min,
                 http_port is not None, sites)
    protocols = acme.protocols if acme else _protocols(tls_cert, tls_key, tls_min)
    protocols()  # a bad certificate or key fails here, before any port is taken
    tls_on = bool(tls_cert or acme)
    if (http_port is not None or hsts is not None) and not tls_on:
        raise ServeError("--http-port and --hsts go with TLS (--tls-cert/--tls-key or --domain)")
    site, load, build_dir, reloadable = _sites_to_serve(build_dir, sites, hsts)
    site, load = _h2_taken(site), (lambda again=load: _h2_taken(again())) if load else None
    http3 = http3 and tls_on
    name, loop_cls = _loop(loop or site.loop, http3)
    log = _access_log(access_log) if access_log else None
    if admin_port and admin_port == port:
        raise ServeError(f"--admin-port {admin_port} is the serving port too; give it another port")
    admin = listeners(admin_host, admin_port, 1, share=False)[0] if admin_port is not None else None
    limits = limits or Limits()
    hosts, workers = _spread(host, workers)
    socks, plain, udp, quic, alt_svc = _ports(hosts, port, http_port, workers, limits, admin,
                                              _quic_pairs(acme, _seq(tls_cert), _seq(tls_key)) if http3
                                              else None, quic_retry)
    https_port = socks[0].getsockname()[1]
    sup = Supervisor(site, socks, loop_cls, limits, log=log, admin=admin,
                     load=load, name=str(build_dir) if reloadable else "", protocols=protocols,
                     plain=plain, plain_app=_plain_app(https_port, acme) if plain else None,
                     watch=FileWatch([*_seq(tls_cert), *_seq(tls_key)]) if tls_cert else None,
                     acme=acme, udp=udp, quic=quic, alt_svc=alt_svc)
    sup.start()
    udp_line = "HTTP/3 on udp " + " and ".join(_addr(s.getsockname()) for s in udp[::workers])
    announce(_serving_line(socks[::workers], admin, name, workers, site,
                           "https" if tls_on else "http", plain[::workers], udp and udp_line))
    if udp and sup.quic is None:
        print(f"orisha: {udp_line} (answered once ACME has a certificate)", file=sys.stderr)
    sys.stdout.flush()
    return sup.serve()


def _spread(host, workers: int | None) -> tuple[tuple, int]:
    """(the addresses to bind, workers per address): ``workers`` (default one per core) in
    all, spread over the addresses, each at least one."""
    hosts = _present(hosts_of(host), LOOPBACK[1:] if host is LOOPBACK else ())
    return hosts, -(-(workers or os.cpu_count() or 1) // len(hosts))


def _present(hosts: tuple, optional: tuple) -> tuple:
    """``hosts`` without the ``optional`` ones this machine has no address for (the default's
    ::1 where there is no IPv6): each is bound once to a throwaway port to see."""
    out = []
    for h in hosts:
        if h in optional:
            try:
                family, addr = _resolve(h, 0, socket.SOCK_STREAM)
                with socket.socket(family, socket.SOCK_STREAM) as s:
                    s.bind(addr)
            except (OSError, PortError):  # EADDRNOTAVAIL, EAFNOSUPPORT: not here
                continue
        out.append(h)
    return tuple(out)


def _ports(hosts: tuple, port: int, http_port: int | None, workers: int, limits: Limits,
           admin, quic_files, quic_retry: bool = False):
    """The serving listeners of every address of ``hosts`` (``workers`` per address, one
    port number for all), the plain port's beside them (``http_port``), and with
    ``quic_files`` (what lists the (names, certificate, key) to serve: ``_quic_pairs``)
    HTTP/3's UDP sockets, its QUIC configuration maker and Alt-Svc. Whatever was opened is
    closed (the admin socket too) if one fails."""
    try:
        quic = _quic(quic_files, limits, quic_retry) if quic_files else None
        tries = PORT_TRIES if len(hosts) > 1 and 0 in (port, http_port) else 1
        for attempt in range(tries):
            try:
                socks, plain, udp = _open(hosts, port, http_port, workers, quic is not None)
                break
            except PortError as e:  # port 0: the one the first address got is taken on another
                if e.errno != errno.EADDRINUSE or attempt == tries - 1:
                    raise
    except ServeError:
        if admin is not None:
            admin.close()
        raise
    alt_svc = _advertise(socks[0].getsockname()[1]) if quic else b""
    return socks, plain, udp, quic, alt_svc


def _open(hosts: tuple, port: int, http_port: int | None, workers: int, datagrams: bool):
    """(TLS or plain listeners, plain-port listeners, UDP sockets): each list ``workers``
    per address, address by address, so worker i serves socks[i] and udp[i]."""
    opened: list[socket.socket] = []
    socks, plain, udp = [], [], []
    v6only = len(hosts) > 1
    try:
        for h in hosts:
            group = listeners(h, port, workers, v6only=v6only)
            opened += group
            socks += group
            port = group[0].getsockname()[1]  # port 0: every address gets the first's number
            if http_port is not None:
                group = listeners(h, http_port, workers, v6only=v6only)
                opened += group
                plain += group
                http_port = group[0].getsockname()[1]
            if datagrams:
                group = datagram_sockets(h, port, workers, v6only)
                opened += group
                udp += group
    except ServeError:
        for s in opened:
            s.close()
        raise
    return socks, plain, udp


def _sites_to_serve(build_dir, sites, hsts: int | None):
    """(site or host table, what a reload runs, the name of what is served, reloadable)."""
    loader = _with_hsts(load_site, hsts)
    if sites is not None:
        # a site loaded already (the container's own) gets HSTS once here, never per reload
        once = {id(out): _with_hsts(lambda s: s, hsts)(out) for _, out in sites
                if not isinstance(out, (str, os.PathLike))}  # one site may serve several names
        sites = [(names, once.get(id(out), out)) for names, out in sites]
        site = load_sites(sites, load=loader)
        return (site, _site_loader(sites, site, loader),
                ", ".join(names[0] for names, _ in sites), True)
    if isinstance(build_dir, (str, os.PathLike)):
        return loader(build_dir), (lambda: loader(build_dir)), build_dir, True
    return _with_hsts(lambda s: s, hsts)(build_dir), None, build_dir, False


def _quic_pairs(acme, certs: tuple, keys: tuple):
    """What lists HTTP/3's certificates, (DNS names, certificate file, key file), for each
    generation: the --tls-cert files under their leaves' names (SNI chooses among them as
    on the TCP port), or the ones ACME has issued so far (``certificates()``: read anew at
    each renewal, when ``Supervisor._renew`` makes the configuration again)."""
    if acme:
        return acme.certificates
    from ..protocols import tls

    def files():
        pairs = []
        for c, k in zip(certs, keys):
            try:
                pairs.append((tls.names(c), c, k))
            except OSError as e:  # ssl.SSLError too: changed since the TCP side read it
                raise ServeError(f"{c}: cannot read the certificate's names ({e})") from None
        return pairs
    return files


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


def _seq(files) -> tuple:
    """One file name or a sequence of them (--tls-cert/--tls-key may repeat)."""
    return (files,) if isinstance(files, str) else tuple(files or ())


def tls_layer() -> str:
    """Which TLS layer serves (orisha/protocols/tls.py, the end): for the start-up lines."""
    from ..protocols import tls
    return ("tls compiled: OpenSSL called from C" if tls.LAYER == "compiled"
            else "tls pure: ssl.SSLObject")


def _protocols(cert: str | None, key: str | None, minimum: str):
    """What makes each worker generation's protocols object (orisha/protocols/)."""
    certs, keys = _seq(cert), _seq(key)
    if not certs and not keys:
        from ..protocols.front import Plain  # HTTP/1.1, and h2c for clients that know
        return Plain
    if len(certs) != len(keys) or not all(certs) or not all(keys):
        raise ServeError("--tls-cert and --tls-key go together (one key per certificate)")
    from ..protocols import tls  # ssl is imported only by a server that speaks TLS
    print(f"orisha: {tls.probe_ktls()}; TLS in user space over in-memory BIOs ({tls_layer()})",
          file=sys.stderr)
    return lambda: tls.Tls(tls.by_sni([(c, tls.context(c, k, minimum))
                                       for c, k in zip(certs, keys)]))


def _acme(domains, tls_cert, email, directory, ca, state, minimum: str, http: bool,
          sites=None):
    """The ACME manager (orisha/serving/acme.py) for ``--domain``, or for ``--site`` with
    ``--acme-email`` (each site's names, one certificate per site: ``acme.Several``), or None."""
    if sites is not None and email and not tls_cert:
        check_site_names(sites, domains)
        return _acme_sites(sites, email, directory, ca, state, minimum, http)
    if not domains:
        if email or directory or ca:
            raise ServeError("--acme-email/--acme-directory/--acme-ca go with --domain"
                             + (" (or --site)" if sites is None else ""))
        return None
    if tls_cert:
        raise ServeError("--domain (certificates from ACME) or --tls-cert, not both")
    acme = _acme_module()
    return acme.Manager(acme.check_options(domains, email), email, directory, ca, state,
                        minimum, http)


def _acme_module():
    try:
        from . import acme
    except ImportError as e:  # the optional extra is not installed
        raise ServeError(f"--domain needs the acme extra: pip install 'orisha[acme]' ({e})") from None
    return acme


def check_site_names(sites, domains=()) -> None:
    """``--site`` with ACME: the sites' names are the domains, and none is a wildcard."""
    if domains:  # one source of truth for the names, as Caddy's site addresses are
        raise ServeError("--domain with --site: the sites' host names are the domains "
                         "(drop --domain; --acme-email gets each site its certificate)")
    for names, _ in sites:
        wild = next((n for n in names if n.startswith("*")), None)
        if wild:
            raise ServeError(f"--site {','.join(names)}: {wild} cannot get an ACME certificate "
                             "(a wildcard needs DNS-01, RFC 8555 §8.4; HTTP-01 and TLS-ALPN-01 "
                             "validate one name each): list the site's host names")


def _acme_sites(sites, email, directory, ca, state, minimum: str, http: bool):
    """One ACME manager per site, for its host names (``check_site_names``)."""
    acme = _acme_module()
    groups = [acme.check_options(names, email) for names, _ in sites]
    taken: dict[str, str] = {}
    for names in groups:
        for n in names:
            if n in taken:
                raise ServeError(f"--site: {n} is a host of two sites ({taken[n]}, {names[0]})")
            taken[n] = names[0]
    return acme.Several([acme.Manager(names, email, directory, ca, state, minimum, http,
                                      site=names[0]) for names in groups])


def _with_hsts(load, seconds: int | None):
    """``load`` followed by HSTS in every head (orisha/core/upgrade.py), at load time."""
    if seconds is None:
        return load

    def loaded(arg):
        from ..core.upgrade import hsts
        from ..protocols.hpack_blocks import block
        from ..protocols.qpack_blocks import section
        return hsts(load(arg), seconds, encode=block, section=section)
    return loaded


def _h2_taken(site):
    """``site`` with HTTP/2's tables of its builds' blocks made (``h2.take``), here in the
    supervisor, so that every worker of its generation forks with them."""
    from ..protocols.h2 import take
    take(site)
    return site


def _plain_app(https_port: int, acme):
    """What makes a plain-port worker's app: the redirect to https, with this generation's
    HTTP-01 tokens (read from the ACME manager when the worker is forked)."""
    from ..core.upgrade import Upgrade

    def make(site, limits, publish=None, log=None):
        return Upgrade(site, limits, publish=publish, log=log, https_port=https_port,
                       tokens=dict(acme.tokens) if acme else {})
    return make


def _quic(pairs, limits: Limits, retry: bool = False):
    """What makes each worker generation's QUIC configuration (HTTP/3; None while ACME has
    no certificate), and checks it once; None when this install cannot speak HTTP/3 (said in
    one line: the server goes on without the UDP port and without Alt-Svc). HTTP/3 is the
    compiled module over ngtcp2 (compiled_h3)."""
    from .. import compiled
    why = "ORISHA_PURE asks for the pure-Python modules" if compiled.pure() else None
    if why is None:
        try:
            from ..protocols import compiled_h3 as h3
        except ImportError as e:  # a pure install, or ngtcp2's libraries gone since
            why = str(e)
    if why is not None:
        print("orisha: HTTP/3 off: it needs the compiled module orisha.protocols.compiled_h3 "
              f"(built with ngtcp2 1.x, nghttp3 and GnuTLS when orisha was installed; {why}); "
              "serving HTTP/1.1, HTTPS and HTTP/2", file=sys.stderr)
        return None
    tickets = h3.tickets()  # before the fork: every worker of every generation resumes them
    def make():
        return h3.configurations(pairs(), limits.idle_timeout, tickets, retry)
    make.endpoint = h3.Endpoint  # the engine's, also while ACME has no certificate (None)
    make()
    return make


def _advertise(port: int) -> bytes:
    """Alt-Svc (RFC 7838) for the TLS port's responses, known only now (the port): the
    HTTP/1.1 line the core splices beside Date, and the HTTP/2 field after h2's date."""
    from ..protocols import hpack_blocks
    value = b'h3=":%d"; ma=86400' % port
    hpack_blocks.advertise(b"alt-svc", value)  # before the fork: every worker's h2 has it
    return b"Alt-Svc: " + value + b"\r\n"


def _addr(addr) -> str:
    return f"[{addr[0]}]:{addr[1]}" if ":" in addr[0] else f"{addr[0]}:{addr[1]}"


def _url(addr, scheme: str = "http") -> str:
    return f"{scheme}://{_addr(addr)}"


def _serving_line(bound, admin, name: str, workers: int, site, scheme: str = "http",
                  plain=(), udp: str = "") -> str:
    """The start-up line: each TCP listener's URL (one per address: ``bound``, sockets),
    and ``udp``, what HTTP/3 listens on."""
    extra = f", admin {_url(admin.getsockname())}{METRICS_PATH}" if admin else ""
    extra += f", {udp}" if udp else ""
    urls = " and ".join(f"{_url(s.getsockname(), scheme)}/" for s in bound)
    each = " per address" if len(bound) > 1 else ""
    line = (f"orisha: serving {urls} (loop {name}, {workers} "
            f"worker{'s' if workers > 1 else ''}{each}, pid {os.getpid()}{extra}): {site.summary}")
    if plain:  # the plain port beside the TLS one (--http-port)
        line += f" (and {' and '.join(_url(s.getsockname()) + '/' for s in plain)}: redirects to https)"
    return line
