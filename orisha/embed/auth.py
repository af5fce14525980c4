"""``--basic-auth GLOB=HTPASSWD``: which paths a password protects, read at build time.

Strategy: each option names a path pattern in ``_headers`` syntax (``/private/*``,
``:name``) and an Apache ``htpasswd`` file of bcrypt entries (``htpasswd -B``); any
other hash (MD5 ``$apr1$``, ``{SHA}``, crypt, plain text) is a one-line build error,
as is a file that cannot be read or has no user. The build marks every route whose
path — or whose file's own path, so a rewrite cannot expose it — matches an area
(first match wins) and gives the site the patterns for paths it does not route;
the request core checks credentials (``orisha.core.site.Auth``, policy in
``core/policy.py``). The booted image has no bcrypt: the build refuses the option there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..core.policy import AUTH_HASHES
from ..errors import BuildError
from . import rules

# A bcrypt hash: prefix, two-digit cost, 53 characters of its base64 alphabet.
_BCRYPT = re.compile(r"\$2[aby]\$[0-9]{2}\$[./A-Za-z0-9]{53}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass
class Area:
    """One protected area: its pattern (the realm too), the regex over decoded paths, and
    its users with their bcrypt hashes."""
    glob: str
    regex: re.Pattern
    users: dict[bytes, bytes] = field(repr=False)
    where: str = ""

    def matches(self, path: str) -> bool:
        return self.regex.fullmatch(path) is not None


def parse_option(value: str) -> Area:
    """``GLOB=HTPASSWD``, the file read and checked."""
    where = f"--basic-auth {value!r}"
    glob, sep, path = value.partition("=")
    if not sep or not glob or not path:
        raise BuildError(f"{where}: expected GLOB=HTPASSWD, e.g. '/private/*=site.htpasswd'")
    if not glob.startswith("/") or _CONTROL.search(glob):
        raise BuildError(f"{where}: {glob!r}: the pattern must be a URL path starting with /")
    return Area(glob, rules.path_regex(glob, where), read_htpasswd(path), where)


def read_htpasswd(path: str) -> dict[bytes, bytes]:
    """user → bcrypt hash, from an Apache htpasswd file (``user:hash`` lines)."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except OSError as e:
        raise BuildError(f"{path}: cannot read the htpasswd file ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise BuildError(f"{path}: not UTF-8 text (byte {e.start})") from None
    users: dict[bytes, bytes] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, hashed = line.partition(":")
        if not sep or not user:
            raise BuildError(f"{path}:{n}: expected user:hash")
        if not hashed.startswith(AUTH_HASHES) or not _BCRYPT.fullmatch(hashed):
            raise BuildError(f"{path}:{n}: {user}: not a bcrypt hash (make it with htpasswd -B)")
        if user.encode() in users:
            raise BuildError(f"{path}:{n}: {user} appears twice")
        users[user.encode()] = hashed.encode()
    if not users:
        raise BuildError(f"{path}: no user in the htpasswd file")
    return users


def area_for(areas: list[Area], path: str, rel: str | None) -> int | None:
    """The index of the first area that protects a route: its path, or the path of the
    file it serves (``rel``), matches."""
    for i, a in enumerate(areas):
        if a.matches(path) or (rel is not None and a.matches("/" + rel)):
            return i
    return None
