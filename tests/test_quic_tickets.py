"""The shared session-ticket table of HTTP/3 (orisha/protocols/quic_tickets.py), sans-I/O:
a ticket stored in one process is fetched in another, only under its server name, and a
slot that is torn, overwritten or not ours is a miss."""

from __future__ import annotations

import datetime
import os

from qh3.tls import CipherSuite, SessionTicket

from orisha.protocols.quic_tickets import SLOT, Tickets


def _ticket(label: bytes, name: str | None = "a.test", ext=((16, b"\x00\x03\x02h3"),)):
    now = datetime.datetime.utcnow().replace(microsecond=0)  # naive UTC, as qh3 makes them
    return SessionTicket(age_add=123456, cipher_suite=CipherSuite.AES_128_GCM_SHA256,
                         not_valid_after=now + datetime.timedelta(days=1), not_valid_before=now,
                         resumption_secret=os.urandom(32), server_name=name, ticket=label,
                         max_early_data_size=0xFFFFFFFF, other_extensions=list(ext))


def test_a_ticket_stored_by_one_worker_is_fetched_by_another():
    t, label = Tickets(), os.urandom(64)
    ticket = _ticket(label)
    pid = os.fork()
    if pid == 0:  # the worker that issued it
        t.store(ticket)
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert t.fetch(label, "a.test") == ticket
    assert t.fetch(label, "b.test") is None  # another site's name: a full handshake
    assert t.fetch(os.urandom(64), "a.test") is None


def test_no_server_name_and_no_early_data_round_trip():
    t, label = Tickets(), os.urandom(64)
    ticket = _ticket(label, None, ())
    ticket.max_early_data_size = None
    t.store(ticket)
    assert t.fetch(label, None) == ticket


def test_a_torn_or_overwritten_slot_is_a_miss():
    t, label = Tickets(slots=1), os.urandom(64)  # one slot: every ticket takes it
    t.store(_ticket(label))
    t.map[40] ^= 1  # a byte of the record changed under its tag (a write in progress)
    assert t.fetch(label, "a.test") is None
    t.store(_ticket(label))
    other = os.urandom(64)
    t.store(_ticket(other))
    assert t.fetch(label, "a.test") is None and t.fetch(other, "a.test") is not None


def test_a_ticket_too_large_for_a_slot_is_not_kept():
    t, label = Tickets(), os.urandom(64)
    t.store(_ticket(label, ext=((16, b"x" * SLOT),)))
    assert t.fetch(label, "a.test") is None
