"""Certificates from an ACME CA (RFC 8555): obtained, stored, renewed by the supervisor.

Strategy: ``orisha serve OUT --domain D… --acme-email ME`` makes a ``Manager``
that the supervisor steps every turn (orisha/serving/supervisor.py). The talking to the
CA — blocking HTTPS through certbot's ``acme`` library — happens in a *helper*
process the manager forks per attempt, so the supervisor never waits on a CA
(it keeps reaping, reloading and answering probes) and never holds a thread
across the forks of its workers. The helper and the manager speak JSON lines
over a socketpair:

  helper → {"challenges": {"http": {token: key authorization}, "alpn": {name: [cert, key]}}}
  manager  hands them to a new generation of workers (run-time data, never a rebuild:
           the plain port's ``Upgrade`` app answers the HTTP-01 tokens, the TLS port
           presents the TLS-ALPN-01 certificates to ``acme-tls/1`` hellos), waits until
           only that generation serves, then → "go"
  helper   tells the CA to validate, finalises, writes the state → {"issued": "…"}
           or, at any step, → {"error": "one line naming the domain and the CA's problem"}

The certificate reaches the workers the same way: a new generation made by the
reload machinery (``Supervisor._renew``), the old one finishing its responses.

HTTP-01 is used when the plain port is served (``--http-port``), TLS-ALPN-01
(RFC 8737) otherwise: either port alone is enough.

Several sites (``--site`` with ``--acme-email``): one manager per site, for its
host names, behind ``Several``, which the supervisor sees as one manager (the
sites' attempts run one at a time; each certificate in ``STATE/sites/HOST/``, one
account for all); SNI picks a site's certificate (``tls.by_names``).

State (``--state DIR``, default ``$ORISHA_STATE`` or ``~/.local/share/orisha``),
every file written atomically (a temporary file, fsync, rename) with mode 0600:
``account-<directory hash>.json`` (the account key and URL, saved only once the
CA has accepted the account) and ``cert.json`` naming the current certificate's
``key-N.pem`` and ``cert-N.pem`` (written last: a crash leaves the previous set
whole). A restart reuses a stored certificate that names the same domains and is
not due for renewal: no order.

Renewal at two thirds of the lifetime; a failed attempt is retried with
exponential backoff (from a hundredth of the lifetime, at least 1 s, up to a
tenth of it, at most 6 h), one log line per attempt and counters on /metrics;
the current certificate serves meanwhile. Only the *first* issuance, with no
certificate to serve, is fatal: one line, exit status 1.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import signal
import socket
import ssl
import sys
import tempfile
import time

from ..errors import ServeError

LETS_ENCRYPT = "https://acme-v02.api.letsencrypt.org/directory"
ACME_IDENTIFIER = "1.3.6.1.5.5.7.1.31"  # id-pe-acmeIdentifier (RFC 8737 §3)
_EMAIL = re.compile(r"[^@\s:?/]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+")
_DOMAIN = re.compile(r"(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
NETWORK_TIMEOUT = 15  # seconds for one request to the CA
ORDER_TIMEOUT = 90  # seconds for the CA to validate and issue
GO_TIMEOUT = 60.0  # seconds the helper waits for the challenges to be served
# Seconds an attempt may take in all (each request and the order have their own timeouts
# above; this bounds a helper stuck anyway): then it is killed and the attempt has failed.
ATTEMPT_TIMEOUT = 300.0
FORK_RETRY = 5.0  # seconds before another try when the helper cannot be forked


def state_dir(given: str | None) -> str:
    return given or os.environ.get("ORISHA_STATE") or os.path.join(
        os.path.expanduser("~"), ".local", "share", "orisha")


def check_options(domains, email: str | None) -> list[str]:
    """The domains, lower-cased and checked; a bad option is a ServeError naming it."""
    if not email:
        raise ServeError("--domain needs --acme-email (the CA's contact for the account)")
    if not _EMAIL.fullmatch(email):
        raise ServeError(f"--acme-email {email}: not an e-mail address")
    out = []
    for d in domains:
        name = d.lower().rstrip(".")
        if not _DOMAIN.fullmatch(name) or "." not in name:
            raise ServeError(f"--domain {d}: not a domain name")
        if name not in out:
            out.append(name)
    return out


# -- state -------------------------------------------------------------------------

def write_private(path: str, data: bytes) -> None:
    """Write ``path`` atomically with mode 0600 (a temporary file beside it, then rename)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class Stored:
    """The current certificate in a state folder (``cert.json``), or None fields."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.cert = self.key = None
        self.domains: list[str] = []
        self.not_before = self.not_after = 0.0
        try:
            with open(os.path.join(folder, "cert.json")) as f:
                meta = json.load(f)
            self.cert = os.path.join(folder, meta["cert"])
            self.key = os.path.join(folder, meta["key"])
            self.domains = meta["domains"]
            from cryptography import x509
            with open(self.cert, "rb") as f:
                leaf = x509.load_pem_x509_certificates(f.read())[0]
            self.not_before = leaf.not_valid_before_utc.timestamp()
            self.not_after = leaf.not_valid_after_utc.timestamp()
        except (OSError, ValueError, KeyError, IndexError):  # none yet, or unreadable: issue
            self.cert = self.key = None

    def covers(self, domains: list[str]) -> bool:
        return self.cert is not None and sorted(self.domains) == sorted(domains)

    def renew_at(self) -> float:
        """Wall-clock time of renewal: two thirds into the lifetime."""
        return self.not_before + (self.not_after - self.not_before) * 2 / 3


def save_certificate(folder: str, domains: list[str], key_pem: bytes, chain_pem: bytes) -> None:
    """The new key and chain under fresh names, then ``cert.json`` naming them; then the
    previous set is removed. At every moment ``cert.json`` names a whole set."""
    n = int(time.time() * 1000)
    key, cert = f"key-{n}.pem", f"cert-{n}.pem"
    old = Stored(folder)
    write_private(os.path.join(folder, key), key_pem)
    write_private(os.path.join(folder, cert), chain_pem)
    write_private(os.path.join(folder, "cert.json"), json.dumps(
        {"domains": domains, "key": key, "cert": cert}).encode())
    for path in (old.key, old.cert):
        if path and os.path.basename(path) not in (key, cert):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


# -- certificates made here ---------------------------------------------------------

def _self_signed(name: str, extensions=()) -> tuple[bytes, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=7))
         .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False))
    for ext, critical in extensions:
        b = b.add_extension(ext, critical=critical)
    cert = b.sign(key, hashes.SHA256())
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def challenge_certificate(domain: str, key_authorization: str) -> tuple[bytes, bytes]:
    """RFC 8737 §3: a self-signed certificate for ``domain`` whose critical
    id-pe-acmeIdentifier extension holds the SHA-256 of the key authorization (DER
    OCTET STRING). acme 5.x no longer makes it."""
    from cryptography import x509
    digest = hashlib.sha256(key_authorization.encode()).digest()
    ext = x509.UnrecognizedExtension(x509.ObjectIdentifier(ACME_IDENTIFIER), b"\x04\x20" + digest)
    return _self_signed(domain, [(ext, True)])


def context_from_pem(cert_pem: bytes, key_pem: bytes, minimum: str, alpn=None) -> ssl.SSLContext:
    """A server context for PEM bytes (the stdlib loads certificates from files only: a
    private temporary folder, removed at once)."""
    from ..protocols import tls
    with tempfile.TemporaryDirectory(prefix="orisha-tls-") as d:
        cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
        write_private(cert, cert_pem)
        write_private(key, key_pem)
        ctx = tls.context(cert, key, minimum)
    if alpn:
        ctx.set_alpn_protocols(alpn)
        ctx.alpn = tuple(alpn)  # the same list for the compiled TLS layer (compiled_tls.pyx)
    return ctx


# -- the manager, in the supervisor ---------------------------------------------------

class Manager:
    """The supervisor's side (see the Strategy): schedules attempts, runs the helper,
    hands challenges and certificates to new generations, keeps the counters."""

    def __init__(self, domains: list[str], email: str, directory: str | None, ca: str | None,
                 state: str | None, minimum: str = "1.2", http: bool = False,
                 site: str | None = None) -> None:
        self.domains, self.email = domains, email
        self.directory = directory or LETS_ENCRYPT
        self.ca, self.minimum, self.http = ca, minimum, http
        if ca and not os.path.isfile(ca):
            raise ServeError(f"--acme-ca {ca}: no such file")
        # ``site``: one of several sites (``Several``): its certificate in a folder of its own
        # under the state folder, the account shared by all of them.
        self.accounts = state_dir(state)
        self.folder = os.path.join(self.accounts, "sites", site) if site else self.accounts
        self.stored = Stored(self.folder)
        self.tokens: dict[bytes, bytes] = {}  # HTTP-01, for the plain port's Upgrade app
        self.alpn: dict[str, ssl.SSLContext] = {}  # TLS-ALPN-01 contexts by server name
        self.placeholder = None
        self.helper: tuple[int, socket.socket] | None = None
        self.inbox = b""
        self.go_pending = self.answered = self.announce = False
        self.failures = 0  # consecutive
        self.attempts = self.failed = self.issued = 0
        # A first issuance that fails stops the server (one site: nothing to serve); one of
        # several sites (``Several``) retries instead, the others serving meanwhile.
        self.fatal = True
        now = time.monotonic()
        if self.stored.covers(domains) and self.stored.not_after > time.time():
            self.next_at = now + max(0.0, self.stored.renew_at() - time.time())
            print(f"orisha: ACME: using the stored certificate for {', '.join(domains)} "
                  f"(renewal {_when(self.stored.renew_at())})", file=sys.stderr)
        else:
            self.next_at = now  # the first issuance starts at once

    # -- what the workers get ------------------------------------------------------
    def context(self) -> ssl.SSLContext:
        """The context that presents the current certificate."""
        from ..protocols import tls
        if self.stored.covers(self.domains):
            return tls.context(self.stored.cert, self.stored.key, self.minimum)
        if self.placeholder is None:  # nothing issued yet: a throwaway self-signed certificate
            self.placeholder = context_from_pem(*_self_signed(self.domains[0]), self.minimum)
        return self.placeholder

    def protocols(self):
        """The TLS port's protocols object for a new generation (server.py's factory)."""
        from ..protocols import tls
        # by_names: the SNI is recorded even for one certificate (a server of several sites
        # with one certificate naming them all answers 421 for a Host of another site).
        return tls.Tls(tls.by_names([(self.domains, self.context())]),
                       challenges=dict(self.alpn))

    def certificates(self) -> list[tuple[list[str], str, str]]:
        """(domains, certificate file, key file) of the issued certificate, or nothing yet:
        what HTTP/3's configuration is made of (orisha/serving/server.py, each generation)."""
        if self.stored.covers(self.domains):
            return [(self.domains, self.stored.cert, self.stored.key)]
        return []

    def counters(self) -> tuple:
        return (("acme_attempts_total", "counter", "ACME orders attempted.", self.attempts),
                ("acme_failures_total", "counter", "ACME orders that failed.", self.failed),
                ("acme_issued_total", "counter", "Certificates issued by the ACME CA.",
                 self.issued),
                ("certificate_expiry_seconds", "gauge",
                 "Unix time the served certificate expires (0: none yet).",
                 int(self.stored.not_after) if self.stored.cert else 0))

    # -- the supervisor's hooks ----------------------------------------------------
    def fileno(self) -> int | None:
        return self.helper[1].fileno() if self.helper else None

    def deadline(self) -> float:
        return time.monotonic() + (0.05 if self.go_pending else 1.0) if self.helper else self.next_at

    def forked(self) -> None:
        """In a new worker: it holds no end of the helper's socket."""
        if self.helper:
            self.helper[1].close()

    def reaped(self, pid: int, status: int) -> None:
        """The helper has exited: what it said is handled on the next step; if it said
        nothing (it crashed), that is the attempt's error."""
        if not (self.helper and self.helper[0] == pid):
            return
        sock = self.helper[1]
        try:
            while data := sock.recv(1 << 20):
                self.inbox += data
        except (BlockingIOError, ConnectionResetError):  # all read, or nothing more to read
            pass
        sock.close()
        self.helper, self.go_pending = None, False
        if not self.answered and b"\n" not in self.inbox:
            self.inbox = json.dumps({"error": "the ACME helper exited with %d without an answer"
                                     % os.waitstatus_to_exitcode(status)}).encode() + b"\n"

    def step(self, sup, readable: bool, may_start: bool = True) -> None:
        """One turn of the supervisor's loop: read the helper, act on what it said, start
        an attempt that is due (``may_start``: no other site's attempt runs), let the helper
        go once its challenges are served."""
        if self.helper is not None and readable:
            try:
                self.inbox += self.helper[1].recv(1 << 20)
            except (BlockingIOError, InterruptedError):  # a spurious wake-up
                pass
        self._handle(sup)
        settled = sup.settled()
        if self.announce and settled:
            self.announce = False
            print(f"orisha: ACME: every worker serves the new certificate (generation {sup.gen})",
                  file=sys.stderr)
        if self.helper is None:
            if may_start and time.monotonic() >= self.next_at:
                self._start(sup)
        elif time.monotonic() > self.started + ATTEMPT_TIMEOUT and not self.killed:
            self.killed = True
            os.kill(self.helper[0], signal.SIGKILL)  # reaped as an attempt without an answer
        elif self.go_pending and settled:
            self.go_pending = False
            self.helper[1].sendall(b"go\n")

    # -- steps -------------------------------------------------------------------------
    def _handle(self, sup) -> None:
        while b"\n" in self.inbox:
            line, self.inbox = self.inbox.split(b"\n", 1)
            msg = json.loads(line)
            if "challenges" in msg:
                self._challenges(sup, msg["challenges"])
            elif "issued" in msg:
                self.answered = True
                self._issued(sup)
            elif "error" in msg:
                self.answered = True
                self._failed(sup, msg["error"])

    def _start(self, sup) -> None:
        try:
            ours, theirs = socket.socketpair()
        except OSError as e:  # EMFILE/ENFILE: no attempt now, the next one later
            return self._not_started(e)
        try:
            pid = os.fork()
        except OSError as e:  # EAGAIN/ENOMEM: likewise
            ours.close()
            theirs.close()
            return self._not_started(e)
        if pid == 0:
            ours.close()
            _helper_child(sup, theirs, self)
        theirs.close()
        self.attempts += 1
        ours.setblocking(False)
        self.helper, self.inbox, self.answered = (pid, ours), b"", False
        self.started, self.killed = time.monotonic(), False
        what = "renewing" if self.stored.covers(self.domains) else "requesting"
        print(f"orisha: ACME: {what} a certificate for {', '.join(self.domains)} from "
              f"{self.directory} (attempt {self.attempts})", file=sys.stderr)

    def _not_started(self, e: OSError) -> None:
        """The helper could not be made: one line, and the attempt is retried after
        FORK_RETRY seconds (not counted as the CA's failure: no order was made)."""
        self.next_at = time.monotonic() + FORK_RETRY
        print(f"orisha: ACME: cannot start the helper for {', '.join(self.domains)} "
              f"({e.strerror or e}); retrying in {FORK_RETRY:g} s", file=sys.stderr)

    def stop(self) -> None:
        """The server stops: so does an attempt in progress. Its helper is killed and
        reaped here rather than left to finish an order nobody will serve (or to outlive
        the server where no parent-death signal reaches it); the state stays whole (every
        file is written atomically, ``cert.json`` last)."""
        if self.helper is None:
            return
        pid, sock = self.helper
        self.helper, self.go_pending = None, False
        sock.close()
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)  # SIGKILL: at once
        except (ProcessLookupError, ChildProcessError):  # it had exited and been reaped
            pass

    def _challenges(self, sup, ch: dict) -> None:
        """Challenges to serve: a new generation answers them, then the helper may go. If
        that generation cannot be made (``_renew`` is False: the certificate files cannot
        be read), the workers keep what they had and the helper is told "no": the attempt
        fails like any other (one line, backoff) and the CA is never asked to validate
        challenges that nothing answers."""
        if self.helper is None:  # it has exited since: nobody to validate them for
            return
        before = self.tokens, self.alpn
        try:
            self.tokens = {t.encode(): ka.encode() for t, ka in ch.get("http", {}).items()}
            self.alpn = {name: context_from_pem(c.encode(), k.encode(), self.minimum,
                                                alpn=["acme-tls/1"])
                         for name, (c, k) in ch.get("alpn", {}).items()}
            started = sup._renew("ACME challenges to answer")
        except (ServeError, ssl.SSLError, ValueError) as e:
            print(f"orisha: ACME: cannot serve the challenges for {', '.join(self.domains)}: "
                  f"{e}", file=sys.stderr)
            started = False
        if started:
            self.go_pending = True
            return
        self.tokens, self.alpn = before
        try:
            self.helper[1].sendall(b"no\n")  # it answers with an error: ``_failed``
        except OSError:  # it has gone: reaped as an attempt without an answer
            pass

    def _issued(self, sup) -> None:
        self.stored = Stored(self.folder)
        self.tokens, self.alpn, self.failures = {}, {}, 0
        self.issued += 1
        self.next_at = time.monotonic() + max(1.0, self.stored.renew_at() - time.time())
        print(f"orisha: ACME: certificate for {', '.join(self.domains)} issued, valid until "
              f"{_when(self.stored.not_after)} (renewal {_when(self.stored.renew_at())})",
              file=sys.stderr)
        self.announce = sup._renew("new ACME certificate")

    def _failed(self, sup, why: str) -> None:
        self.failed += 1
        self.failures += 1
        self.go_pending = False
        if not self.stored.covers(self.domains):
            if self.fatal:
                sup.fail(f"cannot get a certificate for {', '.join(self.domains)}: {why}")
                self.next_at = float("inf")
                return
            delay = min(60.0 * 2 ** (self.failures - 1), 3600.0)
            self.next_at = time.monotonic() + delay
            print(f"orisha: ACME: no certificate yet for {', '.join(self.domains)} ({why}); "
                  f"the other sites serve on; next attempt in {delay:.0f} s", file=sys.stderr)
            return
        life = max(1.0, self.stored.not_after - self.stored.not_before)
        base = min(max(life / 100, 1.0), 60.0)
        delay = min(base * 2 ** (self.failures - 1), max(base, min(life / 10, 6 * 3600.0)))
        self.next_at = time.monotonic() + delay
        print(f"orisha: ACME: renewal failed ({why}); still serving the current certificate "
              f"(valid until {_when(self.stored.not_after)}); next attempt in {delay:.0f} s",
              file=sys.stderr)


class Several:
    """Several sites' certificates, one ``Manager`` per site (Caddy's way: a site whose
    names do not validate yet holds up no other site's certificate, a new site is one new
    order, and no visitor of one site reads the others' names in its certificate). SNI
    picks among them (``tls.by_names``). The supervisor sees one manager: the sites'
    attempts run one at a time, in --site order when several are due, so there is one
    helper and one generation of challenges at a time, and the account is shared."""

    def __init__(self, managers: list[Manager]) -> None:
        self.managers = managers
        for m in managers:
            m.fatal = len(managers) == 1

    @property
    def tokens(self) -> dict[bytes, bytes]:
        return {t: ka for m in self.managers for t, ka in m.tokens.items()}

    def protocols(self):
        from ..protocols import tls
        return tls.Tls(tls.by_names([(m.domains, m.context()) for m in self.managers]),
                       challenges={n: c for m in self.managers for n, c in m.alpn.items()})

    def certificates(self) -> list[tuple[list[str], str, str]]:
        """Every site's issued certificate, in --site order (SNI chooses among them)."""
        return [c for m in self.managers for c in m.certificates()]

    def counters(self) -> tuple:
        total = [sum(m.counters()[k][3] for m in self.managers) for k in range(3)]
        expiry = [m.counters()[3][3] for m in self.managers]
        rows = [row[:3] + (v,) for row, v in zip(self.managers[0].counters(), total)]
        # The soonest expiry (0 while a site has none yet): what an alert watches.
        return (*rows, self.managers[0].counters()[3][:3] + (min(expiry),))

    def _running(self) -> Manager | None:
        return next((m for m in self.managers if m.helper is not None), None)

    def fileno(self) -> int | None:
        m = self._running()
        return m.fileno() if m else None

    def deadline(self) -> float:
        m = self._running()  # the others wait for it, due or not
        return m.deadline() if m else min(m.deadline() for m in self.managers)

    def forked(self) -> None:
        for m in self.managers:
            m.forked()

    def reaped(self, pid: int, status: int) -> None:
        for m in self.managers:
            m.reaped(pid, status)

    def stop(self) -> None:
        for m in self.managers:
            m.stop()

    def step(self, sup, readable: bool) -> None:
        running = self._running()
        for m in self.managers:
            m.step(sup, readable and m is running, may_start=self._running() is None)


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


# -- the helper process ---------------------------------------------------------------

def _helper_child(sup, sock: socket.socket, m: Manager) -> None:
    """The forked helper: never returns."""
    code = 0
    try:
        sup.forked_helper()
        sock.setblocking(True)
        try:
            _issue(m, sock)
        except _Problem as e:  # one line, whatever the CA's detail holds
            sock.sendall(json.dumps({"error": " ".join(str(e).split())}).encode() + b"\n")
            code = 1
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 2
    finally:
        sys.stderr.flush()
        os._exit(code)


class _Problem(Exception):
    """One line for the log: the step, the domain and the CA's problem document."""


def _problem(e) -> str:
    """An ACME error as the CA's problem document says it (type and detail)."""
    typ = getattr(e, "typ", None)
    detail = getattr(e, "detail", None)
    if typ or detail:
        return f"{detail or ''} ({typ})" if typ else str(detail)
    return str(e) or e.__class__.__name__


def _issue(m: Manager, sock: socket.socket) -> None:
    """The helper's whole attempt: account, order, challenges, certificate (the Strategy)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    session = _Session(m)
    cert_key = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    order = session.order(cert_key)
    answers, http, alpn = session.challenges(order)
    if answers:
        sock.sendall(json.dumps({"challenges": {"http": http, "alpn": alpn}}).encode() + b"\n")
        sock.settimeout(GO_TIMEOUT)
        try:
            if sock.recv(16) != b"go\n":
                raise _Problem("the server could not put the challenges in place")
        except socket.timeout:
            raise _Problem("the challenges were not in place within %d s" % GO_TIMEOUT) from None
        session.answer(answers)
    done = session.finish(order)
    save_certificate(m.folder, m.domains, cert_key, done.fullchain_pem.encode())
    sock.sendall(b'{"issued": true}\n')


class _Session:
    """One attempt's conversation with the CA through certbot's ``acme`` library; every
    failure becomes a ``_Problem`` naming the step and the CA's problem document."""

    def __init__(self, m: Manager) -> None:
        import josepy as jose
        from acme import client
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        self.m = m
        self.what = ", ".join(m.domains)
        self.account_file = os.path.join(m.accounts, "account-%s.json" % hashlib.sha256(
            m.directory.encode()).hexdigest()[:12])
        try:
            with open(self.account_file) as f:
                self.account = json.load(f)
            key = serialization.load_pem_private_key(self.account["key"].encode(), None)
        except (OSError, ValueError, KeyError):  # none yet (or unreadable): a new account
            self.account = None
            key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.key = key
        self.jwk = jose.JWKRSA(key=key)
        self.net = client.ClientNetwork(self.jwk, user_agent="orisha", verify_ssl=m.ca or True,
                                        timeout=NETWORK_TIMEOUT)
        self.directory = self.step("the directory", client.ClientV2.get_directory,
                                   m.directory, self.net)
        self.acme = client.ClientV2(self.directory, self.net)

    def step(self, what: str, fn, *args, **kw):
        import requests
        from acme import errors, messages
        try:
            return fn(*args, **kw)
        except requests.exceptions.RequestException as e:
            raise _Problem(f"{what}: cannot reach the CA at {self.m.directory} "
                           f"({e.__class__.__name__}: {_root(e)})") from None
        except errors.ValidationError as e:
            raise _Problem("; ".join(
                f"{a.body.identifier.value}: validation failed: "
                + "; ".join(_problem(c.error) for c in a.body.challenges if c.error)
                for a in e.failed_authzrs)) from None
        except (messages.Error, errors.Error, ValueError) as e:
            raise _Problem(f"{what}: {_problem(e)}") from None

    def register(self) -> None:
        """A new account; saved only once the CA has accepted it."""
        from acme import messages
        from cryptography.hazmat.primitives import serialization
        reg = messages.NewRegistration.from_data(email=self.m.email, terms_of_service_agreed=True)
        regr = self.step(f"the account for {self.m.email}", self.acme.new_account, reg)
        write_private(self.account_file, json.dumps({"uri": regr.uri, "key": self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()).decode()}).encode())

    def order(self, cert_key: bytes):
        from acme import crypto_util, messages
        if self.account:
            self.net.account = messages.RegistrationResource(uri=self.account["uri"],
                                                             body=messages.Registration())
        else:
            self.register()
        csr = crypto_util.make_csr(cert_key, self.m.domains)
        what = f"the order for {self.what}"
        try:
            return self.step(what, self.acme.new_order, csr)
        except _Problem as e:
            if not (self.account and "accountDoesNotExist" in str(e)):
                raise
        self.net.account = None  # a CA that lost the account (a test CA restarted, an
        self.register()          # account deactivated): a new one, once
        return self.step(what, self.acme.new_order, csr)

    def challenges(self, order):
        """(challenges to answer, HTTP-01 token → key authorization, name → TLS-ALPN-01
        certificate and key)."""
        import josepy as jose
        from acme import messages
        kind = "http-01" if self.m.http else "tls-alpn-01"
        thumb = jose.b64encode(self.jwk.thumbprint(hash_function=_sha256())).decode()
        answers, http, alpn = [], {}, {}
        for authz in order.authorizations:
            name = authz.body.identifier.value
            if authz.body.status == messages.STATUS_VALID:
                continue  # validated recently (authorization reuse)
            challb = next((c for c in authz.body.challenges
                           if c.chall.to_partial_json().get("type") == kind), None)
            if challb is None:
                raise _Problem(f"{name}: the CA offers no {kind} challenge")
            ka = f"{challb.chall.to_partial_json()['token']}.{thumb}"
            if kind == "http-01":
                http[ka.split('.')[0]] = ka
            else:
                alpn[name] = [x.decode() for x in challenge_certificate(name, ka)]
            answers.append(challb)
        return answers, http, alpn

    def answer(self, answers) -> None:
        for challb in answers:  # RFC 8555 §7.5.1; not ``answer_challenge``, which insists on
            # a Link "up" header that RFC 8555 does not require (Pebble 2.4 sends none)
            self.step("the challenge", self.net.post, challb.uri, _Empty(),
                      new_nonce_url=self.directory.newNonce)

    def finish(self, order):
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=ORDER_TIMEOUT)
        return self.step(f"the order for {self.what}", self.acme.poll_and_finalize, order,
                         deadline)


def _root(e: BaseException) -> str:
    while e.__context__ is not None and e.__context__ is not e:
        e = e.__context__
    return str(e).split("\n")[0][:200]


def _sha256():
    from cryptography.hazmat.primitives import hashes
    return hashes.SHA256


def _empty_response():
    from acme import challenges

    class Empty(challenges.ChallengeResponse):
        """RFC 8555 §7.5.1: the client posts an empty object to ask for validation."""
        typ = "empty"

        def to_partial_json(self):
            return {}

        def __bool__(self) -> bool:  # the library sends a falsy object as POST-as-GET
            return True
    return Empty


def _Empty():
    return _empty_response()()
