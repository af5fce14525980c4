"""The certificate and key a TLS kernel is built with, checked before anything is built.

Strategy: the kernel parses them once at boot and PANICs on a bad one, far from
the person who gave the files; so the build checks them first with the stdlib's
``ssl`` module (the same ``load_cert_chain`` the hosted server uses) and turns
each failure into one line naming the file. What mbedTLS in the kernel cannot
read is refused here too: encrypted keys (the kernel has no one to ask for a
passphrase) and key types other than RSA and ECDSA on P-256/P-384 (the curves
compiled in, unikernel/mbedtls/orisha_config.h).
"""

from __future__ import annotations

import base64
import os
import re
import ssl

from ...errors import BuildError

_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----\r?\n.+?-----END CERTIFICATE-----", re.S)
_KEY = re.compile(rb"-----BEGIN (RSA |EC |ENCRYPTED )?PRIVATE KEY-----")
# DER of the OIDs a PKCS#8 key names its algorithm and curve with (RFC 5480, 8410).
_EC_KEY, _RSA_KEY = bytes.fromhex("2a8648ce3d0201"), bytes.fromhex("2a864886f70d010101")
_CURVES = (bytes.fromhex("2a8648ce3d030107"), bytes.fromhex("2b81040022"))  # P-256, P-384


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise BuildError(f"{path}: cannot read the TLS {what} ({e.strerror})") from None


def _check_cert(path: str, pem: bytes) -> None:
    blocks = _CERT.findall(pem)
    if not blocks:
        raise BuildError(f"{path}: no PEM certificate (-----BEGIN CERTIFICATE-----) in --tls-cert")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    for i, block in enumerate(blocks):
        try:
            ctx.load_verify_locations(cadata=block.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError) as e:  # a block that is not a certificate
            raise BuildError(f"{path}: certificate {i + 1} cannot be read "
                             f"({getattr(e, 'reason', None) or e})") from None


def _key_type(path: str, pem: bytes) -> None:
    m = _KEY.search(pem)
    if not m:
        raise BuildError(f"{path}: no PEM private key (-----BEGIN PRIVATE KEY-----) in --tls-key")
    if m.group(1) == b"ENCRYPTED ":
        raise BuildError(f"{path}: the key is encrypted; the kernel cannot ask for a passphrase "
                         "(decrypt it: openssl pkey -in KEY -out PLAIN)")
    if m.group(1) in (b"RSA ", b"EC "):
        return  # PKCS#1 RSA, or SEC 1 EC (its curve is checked by the kernel's parse too)
    body = pem[m.end():].split(b"-----END", 1)[0]
    try:
        der = base64.b64decode(body, validate=False)
    except ValueError:
        raise BuildError(f"{path}: the private key's base64 cannot be read") from None
    head = der[:40]
    if _RSA_KEY in head:
        return
    if _EC_KEY in head and any(c in der[:60] for c in _CURVES):
        return
    raise BuildError(f"{path}: the kernel's TLS takes RSA keys and ECDSA keys on P-256 or P-384 "
                     "(this one is another kind)")


def check(cert: str, key: str) -> tuple[str, str]:
    """The absolute paths of CERT and KEY once they pass; a BuildError naming the bad file."""
    cert_pem, key_pem = _read(cert, "certificate"), _read(key, "key")
    _check_cert(cert, cert_pem)
    _key_type(key, key_pem)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as e:
        reason = getattr(e, "reason", None) or str(e)
        # OpenSSL 3 puts a key of another type than the certificate's in another slot
        # and then finds that certificate's slot without a key: the same mistake.
        if "MISMATCH" in reason.upper() or "NO_CERTIFICATE_ASSIGNED" in reason.upper():
            raise BuildError(f"{key}: the key does not match the certificate in {cert}") from None
        raise BuildError(f"{key}: the private key cannot be read ({reason})") from None
    return os.path.abspath(cert), os.path.abspath(key)

