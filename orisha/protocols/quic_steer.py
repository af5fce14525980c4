"""Connection IDs that name their worker, so a reload keeps QUIC connections in flight.

Strategy: every worker of every generation issues connection IDs whose first two bytes
carry its (generation, worker index) tag; the tag is masked with a keyed BLAKE2b of the
ID's other bytes (one key per server, made by the supervisor before the first fork), so
an observer cannot tell which IDs belong to one worker or one connection (RFC 9000 §9.5
asks that a connection's IDs not be linkable) while any worker holding the key reads the
tag back without state. A datagram whose destination ID names another worker is handed
to it over a unix datagram socket in a private folder (``path``), by ``loops/udp.py``;
the endpoint (``compiled_h3.pyx``) only decides. Why not a reuseport BPF program (nginx's
``quic_bpf``): loading a ``SK_REUSEPORT`` program needs CAP_BPF or root and a seccomp
profile that allows bpf(2) (Docker's default does not), and Orisha's workers of one index
share one UDP socket across generations anyway — the kernel cannot pick between two
processes reading one socket, only between sockets; handing over in user space works
for any user, on any loop body that moves datagrams through ``udp.Pump``.

Tags are one byte of generation and one of worker index: a generation is told apart from
the four that may still drain (``supervisor.MAX_DRAINING``) modulo 256, and servers with
more than 256 workers share tags (such a datagram reaches a worker that does not know
it and is dropped, as before steering).
"""

from __future__ import annotations

import os
from hashlib import blake2b

TAG = 2  # bytes of an ID that carry the tag


class Steer:
    """One worker's tag, the IDs it issues, and where another worker's datagrams go."""

    __slots__ = ("folder", "key", "tag", "successor")

    def __init__(self, folder: str, key: bytes, gen: int, index: int) -> None:
        self.folder, self.key = folder, key
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

    def owner(self, cid: bytes) -> bytes:
        """The tag of the worker that issued ``cid`` (noise for an ID no worker issued)."""
        m = self._mask(cid[TAG:])
        return bytes((cid[0] ^ m[0], cid[1] ^ m[1]))

    def lives(self, tag: bytes) -> bool:
        """Whether a worker tagged ``tag`` has bound its socket (one stat: Initials only)."""
        return os.path.exists(self.path(tag))

    def path(self, tag: bytes) -> str:
        """The unix datagram socket of the worker tagged ``tag``."""
        return os.path.join(self.folder, tag.hex())
