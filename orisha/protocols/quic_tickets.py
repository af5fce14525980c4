"""Session tickets over QUIC that any worker can take back (resumption and 0-RTT).

Strategy: qh3's server issues a ticket (a random 64-byte label) after each handshake
and hands its state to a handler; a later connection presenting the label asks a fetcher
for that state. A worker's own dictionary would resume only connections that the kernel
happens to hash to the same worker (a new connection has a new source port), so the state
goes into one table shared by every worker of every generation: an anonymous shared
mapping made by the server before the first fork, of ``SLOTS`` fixed slots, the label
choosing the slot (a later ticket may take an earlier one's place: that client does a
full handshake, as without a ticket). Each slot carries a keyed BLAKE2b tag of its bytes
(one key per server, from os.urandom), so a slot read while another worker writes it,
or any slot that is not ours, is a miss, never a wrong resumption. Bounded: ``SLOTS`` ×
``SLOT`` bytes whatever the number of handshakes. A ticket is taken back only under the
server name it was issued for (several sites: no resuming into another site's certificate
without its handshake). 0-RTT follows: qh3's tickets allow early data, and every
answer of this server is a static GET or HEAD (a replay changes nothing; RFC 9001 §9.2).
"""

from __future__ import annotations

import datetime
import mmap
import os
import struct
from hashlib import blake2b

from qh3.tls import CipherSuite, SessionTicket

SLOTS = 4096
SLOT = 512
_TAG = 16
_HEAD = struct.Struct("!IHddqH")  # age_add, suite, valid from, valid until, early data, len
_NONE = -1
_EPOCH = datetime.datetime(1970, 1, 1)  # qh3's tickets carry naive UTC times


class Tickets:
    """The table (made before the fork; every worker reads and writes the same pages)."""

    def __init__(self, slots: int = SLOTS) -> None:
        self.slots = slots
        self.map = mmap.mmap(-1, slots * SLOT)  # MAP_SHARED | MAP_ANONYMOUS: kept by fork
        self.key = os.urandom(32)

    def _slot(self, label: bytes) -> int:
        return int.from_bytes(blake2b(label, digest_size=4, key=self.key).digest(), "big") \
            % self.slots * SLOT

    def store(self, t: SessionTicket) -> None:
        """Keep ``t`` (qh3's ticket handler); one that does not fit a slot is not kept."""
        name = (t.server_name or "").encode()
        ext = b"".join(struct.pack("!HH", k, len(v)) + v for k, v in t.other_extensions)
        body = (_HEAD.pack(t.age_add, t.cipher_suite, _seconds(t.not_valid_before),
                           _seconds(t.not_valid_after),
                           _NONE if t.max_early_data_size is None else t.max_early_data_size,
                           len(t.other_extensions))
                + _blob(t.resumption_secret) + _blob(name) + _blob(t.ticket) + ext)
        record = struct.pack("!H", len(body)) + body
        if len(record) + _TAG > SLOT:
            return
        at = self._slot(t.ticket)
        self.map[at:at + _TAG + len(record)] = blake2b(record, digest_size=_TAG,
                                                       key=self.key).digest() + record

    def fetch(self, label: bytes, server_name: str | None) -> SessionTicket | None:
        """The ticket issued as ``label`` under ``server_name``, or None (qh3's fetcher)."""
        at = self._slot(label)
        slot = self.map[at:at + SLOT]
        size = int.from_bytes(slot[_TAG:_TAG + 2], "big")
        record = slot[_TAG:_TAG + 2 + size]
        if size + 2 + _TAG > SLOT or slot[:_TAG] != blake2b(record, digest_size=_TAG,
                                                            key=self.key).digest():
            return None  # empty, overwritten while read, or torn
        t = _parse(record[2:])
        if t.ticket != label or (t.server_name or None) != (server_name or None):
            return None
        return t


def _seconds(when: datetime.datetime) -> float:
    if when.tzinfo is not None:
        when = when.astimezone(datetime.timezone.utc).replace(tzinfo=None)
    return (when - _EPOCH).total_seconds()


def _blob(b: bytes) -> bytes:
    return struct.pack("!H", len(b)) + b


def _parse(body: bytes) -> SessionTicket:
    age_add, suite, since, until, early, n = _HEAD.unpack_from(body)
    pos, blobs = _HEAD.size, []
    for _ in range(3):
        size = int.from_bytes(body[pos:pos + 2], "big")
        blobs.append(body[pos + 2:pos + 2 + size])
        pos += 2 + size
    ext = []
    for _ in range(n):
        kind, size = struct.unpack_from("!HH", body, pos)
        ext.append((kind, body[pos + 4:pos + 4 + size]))
        pos += 4 + size
    secret, name, label = blobs
    return SessionTicket(
        age_add=age_add, cipher_suite=CipherSuite(suite),
        not_valid_before=_EPOCH + datetime.timedelta(seconds=since),
        not_valid_after=_EPOCH + datetime.timedelta(seconds=until),
        resumption_secret=secret, server_name=name.decode() or None, ticket=label,
        max_early_data_size=None if early == _NONE else early, other_extensions=ext)
