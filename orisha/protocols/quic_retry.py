"""Retry tokens (RFC 9000 §8.1.2): what a client sends back to prove it owns its address.

A token is the original destination connection ID, in the clear, and a MAC that binds it to
the client's address and port, the Retry's source connection ID and the time it was made:

    version (1) | made at, ms (8) | len (1) | original DCID | HMAC-SHA256, first 16 bytes

The ID need not be secret (the client sent it in the clear); what must not be forged is the
claim that this address was answered. The Retry's source ID is not carried: the client must
send its next Initial to it (§17.2.5.2), so ``validate`` takes it from that packet's header
and the MAC fails for any other. Tokens expire after ``LIFETIME`` seconds: a client returns one
at once, and a captured one is only worth an amplification of 3× from the same address.

The key is made per ``RetryTokens`` (one per worker): datagrams are steered back to the worker
that made the token (quic_steer.py), and a restart invalidates the old ones, which costs a
client one more round trip. Only the standard library: qh3's own handler (RSA-2048, no expiry)
costs a private-key operation per token, aioquic's needs ``cryptography`` in every image.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os

from .fields import H3_RETRY_LIFETIME as LIFETIME

VERSION = 1
_MAC = 16


def _address(addr) -> bytes:
    return ipaddress.ip_address(addr[0]).packed + addr[1].to_bytes(2, "big")


class RetryTokens:
    def __init__(self, key: bytes | None = None) -> None:
        self._key = key if key is not None else os.urandom(32)

    def _mac(self, addr, rscid: bytes, body: bytes) -> bytes:
        msg = _address(addr) + bytes([len(rscid)]) + rscid + body
        return hmac.new(self._key, msg, hashlib.sha256).digest()[:_MAC]

    def create(self, addr, odcid: bytes, rscid: bytes, now: float) -> bytes:
        """The token of a Retry sent to ``addr`` from ``rscid``, for a client whose first
        Initial named ``odcid``; ``now`` is the caller's clock (seconds)."""
        body = bytes([VERSION]) + int(now * 1000).to_bytes(8, "big") + bytes([len(odcid)]) + odcid
        return body + self._mac(addr, rscid, body)

    def validate(self, addr, dcid: bytes, token: bytes, now: float) -> bytes:
        """The original destination connection ID of a token returned from ``addr`` in an
        Initial sent to ``dcid``; ValueError for a token that is not ours, bound to another
        address or ID, or expired."""
        if len(token) < 10 + _MAC or token[0] != VERSION:
            raise ValueError("not a retry token of this server")
        n = token[9]
        body, mac = token[:10 + n], token[10 + n:]
        if len(mac) != _MAC or not hmac.compare_digest(mac, self._mac(addr, dcid, body)):
            raise ValueError("retry token forged, or for another address or connection ID")
        made = int.from_bytes(token[1:9], "big") / 1000
        if not 0 <= now - made <= LIFETIME:
            raise ValueError("retry token expired")
        return body[10:]
