"""The options of ``orisha serve``, written once.

Strategy: ``SERVE`` is the table; ``orisha serve`` (click, orisha/cli.py) and the container's
executable (argparse, orisha/targets/container/runtime.py, which never imports click) both
make their options from it, so a flag, its values, its meaning and its range are typed
here only. Each ``Option`` says how its values are read: text, a range of
``orisha.core.policy.RANGES`` (the one place valid numbers are written), a choice, or a
switch; whether it repeats; ``orisha serve``'s default; and for the container the
environment variable that sets it (``env``: an image is configured by its environment) and
the default without it (``image``: an image listens on every address). The limits are
``orisha.core.policy.LIMITS``, read the same way by both. ``--fallback`` and
``--not-found`` are ``orisha serve``'s only (they build a site, and the container holds a
build: ``container=False``); the container's own two (``--health``, ``--info``) are its commands, not
serve options.
"""

from __future__ import annotations

from typing import NamedTuple

from ..loops import MODULES

TEXT, RANGED, CHOICE, SWITCH = "text", "ranged", "choice", "switch"


class Option(NamedTuple):
    flag: str                 # without the dashes; RANGES[flag] for a RANGED one
    help: str
    values: str = TEXT
    metavar: str | None = None
    dest: str | None = None   # the parameter's name, else the flag's (dashes as underscores)
    choices: tuple = ()
    many: bool = False        # repeatable (and, in $ENV, comma- or space-separated)
    default: object = None    # orisha serve's (a switch: the value without it; given, the other)
    default_text: str = ""    # orisha serve's default, said in the help when it is not one value
    env: str = ""             # the container's environment variable, if any; a switch's
                              # names the value (HTTP3=0: --no-http3)
    container: bool = True    # False: orisha serve's alone
    image: object = None      # the container's default when $ENV is unset
    image_help: str = ""      # the container's help, where it says more than ``help``

    @property
    def attr(self) -> str:
        return self.dest or self.flag.replace("-", "_")

    def env_default(self, environ) -> object:
        """The container's default: $ENV (a switch: set unless 0, no, false or off; a
        repeated option: its items, comma- or space-separated), else ``image``."""
        raw = environ.get(self.env) if self.env else None
        if raw is None or (raw == "" and self.values != TEXT):
            return self.image
        if self.values == RANGED and self.image is None and raw.strip() == "0":
            return None  # off by default, and 0 says so (ADMIN_PORT=0: no admin port)
        if self.values == SWITCH:
            return raw.lower() not in ("0", "no", "false", "off")
        if self.many:
            return raw.replace(",", " ").split() or self.image
        return raw


SERVE = (
    Option("site", "Serve several sites: PATH (a build or a site) for Host HOST (a,b: several "
           "names; *.example.org: every name under it). Repeat it; the first answers unknown "
           "hosts. Instead of PATH.", metavar="HOST=PATH", dest="sites", many=True,
           image_help="Several sites: HOST (a,b: several names; *.example.org) "
           "alone names the build in this executable; HOST=PATH adds a build folder mounted "
           "into the container (`orisha build SITE -o PATH`). Repeat it; the first answers "
           "unknown hosts."),
    Option("host", "Listen on ADDRESS (TCP, and UDP for HTTP/3); repeat it, or a,b, for several.",
           metavar="ADDRESS", dest="hosts", many=True, default_text="127.0.0.1 and ::1",
           env="HOST", image=["0.0.0.0"]),
    Option("port", "Port to listen on.", RANGED, default_text="8080; 443 with --domain",
           env="PORT", image="8080"),
    Option("workers", "Worker processes.", RANGED, default_text="one per core", env="WORKERS"),
    Option("loop", "Override the loop recorded in the build.", CHOICE,
           choices=(*MODULES, "auto"), env="LOOP"),
    Option("fallback", "When PATH is a site: SPA fallback document.", metavar="FILE",
           container=False),
    Option("not-found", "When PATH is a site: 404 document.", metavar="FILE", container=False),
    Option("access-log", "Append a common-log-format access log to PATH ('-': stdout). Off by "
           "default.", metavar="PATH", env="ACCESS_LOG"),
    Option("admin-port", "Serve /healthz, /readyz and Prometheus /metrics on PORT. Off by "
           "default.", RANGED, metavar="PORT", env="ADMIN_PORT",
           image_help="Serve /healthz, /readyz and /metrics on PORT (the image sets 9090; off "
           "without it)."),
    Option("admin-host", "Address of the admin port (0.0.0.0: where a kubelet or a load "
           "balancer probes).", metavar="HOST", default="127.0.0.1", env="ADMIN_HOST",
           image="0.0.0.0", image_help="Address of the admin port (0.0.0.0: the kubelet probes "
           "the pod's address)."),
    Option("tls-cert", "PEM certificate (chain allowed): the port speaks TLS, HTTP/2 and "
           "HTTP/1.1 by ALPN, and HTTP/3 on the same port number over UDP. A changed file is "
           "read again. Repeat it (with --tls-key) for several: SNI picks the one whose names "
           "match.", metavar="FILE", many=True, env="TLS_CERT"),
    Option("tls-key", "PEM private key of --tls-cert.", metavar="FILE", many=True, env="TLS_KEY"),
    Option("tls-min", "Oldest TLS version accepted.", CHOICE, choices=("1.2", "1.3"),
           default="1.2", env="TLS_MIN", image="1.2"),
    Option("http-port", "With TLS: also listen on PORT (plain HTTP), answering every request "
           "with a 308 to https (and ACME HTTP-01).", RANGED, metavar="PORT", env="HTTP_PORT"),
    Option("hsts", "With TLS: Strict-Transport-Security: max-age=SECONDS on every response.",
           RANGED, metavar="SECONDS", env="HSTS"),
    Option("domain", "Certificates from ACME (instead of --tls-cert): one certificate naming "
           "every --domain (repeatable). With --site, not needed: the sites' names are the "
           "domains.", metavar="NAME", dest="domains", many=True, env="DOMAINS"),
    Option("acme-email", "Contact address of the ACME account. With --site (and no "
           "--tls-cert): a certificate from ACME for each site's names.", metavar="ME",
           env="ACME_EMAIL"),
    Option("acme-directory", "ACME directory.", metavar="URL",
           default_text="Let's Encrypt's production directory", env="ACME_DIRECTORY"),
    Option("acme-ca", "CA bundle to trust for the ACME directory's own HTTPS (private CAs, "
           "tests).", metavar="FILE", env="ACME_CA"),
    Option("state", "ACME state: account key, certificate and key.", metavar="DIR",
           default_text="$ORISHA_STATE or ~/.local/share/orisha", env="STATE",
           image_help="ACME state (account, certificate, key): a volume."),
    Option("no-http3", "With TLS: no HTTP/3 on the same port over UDP.", SWITCH, dest="http3",
           default=True, env="HTTP3", image=True, image_help="With TLS: no HTTP/3 (QUIC on the "
           "same port number over UDP, on by default: publish the UDP port too); HTTP3=0 too."),
    Option("quic-retry", "HTTP/3: every new client first proves its address with a Retry (RFC "
           "9000 §8.1.2).", SWITCH, default=False, default_text="only during a flood of "
           "handshakes", env="QUIC_RETRY", image=False),
)
