"""Connection IDs that name their worker, so a reload keeps QUIC connections in flight.

Strategy: every worker of every generation issues connection IDs whose first two bytes
carry its (generation, worker index) tag; the tag is masked with a keyed BLAKE2b of the
ID's other bytes (one key per server, made by the supervisor before the first fork), so
an observer cannot tell which IDs belong to one worker or one connection (RFC 9000 §9.5
asks that a connection's IDs not be linkable) while any worker holding the key reads the
tag back without state. A datagram whose destination ID names another worker is handed
to it over a unix datagram socket in a private folder (``path``), by ``loops/udp.py``;
the endpoint (``h3.py``) only decides. Why not a reuseport BPF program (nginx's
``quic_bpf``): loading a ``SK_REUSEPORT`` program needs CAP_BPF or root and a seccomp
profile that allows bpf(2) (Docker's default does not), and Orisha's workers of one index
share one UDP socket across generations anyway — the kernel cannot pick between two
processes reading one socket, only between sockets; handing over in user space works
for any user, on any loop body that moves datagrams through ``udp.Pump``.

qh3's core draws a connection's spare IDs itself (no hook), and a client with zero-length
IDs (Chromium) keeps the ID it chose for the first one: those IDs carry no tag. So every ID
a worker issues is also written to ``Owners``, a table of ID → tag in an anonymous shared
mapping made before the first fork (like the session tickets, quic_tickets.py): a worker
that reads a datagram of an ID it does not know looks the ID up there first, then reads
the tag from the ID. Bounded (``SLOTS`` slots of ``SLOT`` bytes, the ID choosing its slot
by a keyed hash; a later ID may take an earlier one's place: that datagram is a stray, as
before steering), and each slot carries a keyed check, so a torn or foreign slot is a miss.

Tags are one byte of generation and one of worker index: a generation is told apart from
the four that may still drain (``supervisor.MAX_DRAINING``) modulo 256, and servers with
more than 256 workers share tags (such a datagram reaches a worker that does not know
it and is dropped, as before steering).
"""

from __future__ import annotations

import mmap
import os
from hashlib import blake2b

TAG = 2  # bytes of an ID that carry the tag
SLOTS = 1 << 16  # Owners: IDs remembered at once (2 MiB shared)
SLOT = 32        # length byte, the ID (up to 20 bytes), the tag, an 8-byte check, padding
_CHECK = 8


class Owners:
    """Connection ID → the tag of the worker that issued it, shared by every worker."""

    def __init__(self, key: bytes, slots: int = SLOTS) -> None:
        self.key, self.slots = key, slots
        self.map = mmap.mmap(-1, slots * SLOT)  # MAP_SHARED | MAP_ANONYMOUS: kept by fork

    def _at(self, cid: bytes) -> int:
        h = blake2b(cid, digest_size=4, key=self.key, person=b"slot").digest()
        return int.from_bytes(h, "big") % self.slots * SLOT

    def _check(self, record: bytes) -> bytes:
        return blake2b(record, digest_size=_CHECK, key=self.key, person=b"check").digest()

    def put(self, cid: bytes, tag: bytes) -> None:
        if len(cid) > 20:
            return
        record = bytes((len(cid),)) + cid.ljust(20, b"\0") + tag
        at = self._at(cid)
        self.map[at:at + len(record) + _CHECK] = record + self._check(record)

    def get(self, cid: bytes) -> bytes | None:
        at = self._at(cid)
        slot = self.map[at:at + 23 + _CHECK]
        record = slot[:23]
        if slot[23:] != self._check(record) or record[1:1 + record[0]] != cid \
                or record[0] != len(cid):
            return None  # empty, another ID's, or torn
        return record[21:23]


class Steer:
    """One worker's tag, the IDs it issues, and where another worker's datagrams go."""

    __slots__ = ("folder", "key", "tag", "successor", "owners")

    def __init__(self, folder: str, key: bytes, gen: int, index: int,
                 owners: Owners | None = None) -> None:
        self.folder, self.key, self.owners = folder, key, owners
        self.tag = bytes((gen & 0xFF, index & 0xFF))
        # A stopping worker hands the Initials it reads to the same index of the next
        # generation (a reload's); with no such worker (a stop) they are dropped.
        self.successor = bytes(((gen + 1) & 0xFF, index & 0xFF))

    def _mask(self, rest: bytes) -> bytes:
        return blake2b(rest, digest_size=TAG, key=self.key).digest()

    def cid(self, length: int) -> bytes:
        """A new connection ID of ``length`` bytes that names this worker."""
        rest = os.urandom(length - TAG)
        m = self._mask(rest)
        return bytes((self.tag[0] ^ m[0], self.tag[1] ^ m[1])) + rest

    def remember(self, cid: bytes) -> None:
        """``cid`` is this worker's, whoever drew it (qh3's core, or the client)."""
        if self.owners is not None:
            self.owners.put(cid, self.tag)

    def owner(self, cid: bytes) -> bytes:
        """The tag of the worker that issued ``cid`` (noise for an ID no worker issued)."""
        if self.owners is not None:
            tag = self.owners.get(cid)
            if tag is not None:
                return tag
        m = self._mask(cid[TAG:])
        return bytes((cid[0] ^ m[0], cid[1] ^ m[1]))

    def lives(self, tag: bytes) -> bool:
        """Whether a worker tagged ``tag`` has bound its socket (one stat: Initials only)."""
        return os.path.exists(self.path(tag))

    def path(self, tag: bytes) -> str:
        """The unix datagram socket of the worker tagged ``tag``."""
        return os.path.join(self.folder, tag.hex())
