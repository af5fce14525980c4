"""The datagram pump over real loopback sockets: a burst read in one system call on the
compiled bodies (recvmmsg, UDP GRO trains split), a flush to several addresses in one
(sendmmsg), and the pure pump's per-datagram calls beside it (the same datagrams)."""

from __future__ import annotations

import socket

import pytest

from orisha.loops import udp
from orisha.loops.base import Datagrams

try:
    from orisha.loops import compiled_udp
except ImportError:  # a pure install
    compiled_udp = None

PUMPS = [pytest.param(udp.Pump, id="pure"),
         pytest.param(getattr(compiled_udp, "Pump", None), id="compiled",
                      marks=pytest.mark.skipif(compiled_udp is None, reason="not compiled"))]


class Endpoint:
    """Records what the pump hands over; sends what a test puts in ``out``."""

    def __init__(self) -> None:
        self.batches, self.out, self.forward, self.timer = [], [], [], None

    @property
    def outgoing(self):
        return self.out

    def sent(self, n, now):
        del self.out[:n]

    def receive(self, batch, now, handed=False):
        self.batches.append(list(batch))


def _pump(cls):
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    ep = Endpoint()
    return cls(Datagrams(sock, ep)), sock, ep


def test_the_compiled_bodies_run_the_batched_pump():
    if compiled_udp is None:
        pytest.skip("not compiled")
    from orisha.loops import compiled_epoll
    assert compiled_epoll.Pump is compiled_udp.Pump
    try:
        from orisha.loops import compiled_io_uring
    except ImportError:  # liburing missing
        return
    assert compiled_io_uring.Pump is compiled_udp.Pump


@pytest.mark.parametrize("cls", PUMPS)
def test_a_burst_is_one_batch(cls):
    pump, sock, ep = _pump(cls)
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.bind(("127.0.0.1", 0))
    sent = [bytes([i]) * (100 + i) for i in range(40)]
    for d in sent:
        client.sendto(d, sock.getsockname())
    pump.readable(0.0)
    assert ep.batches == [[(d, client.getsockname()) for d in sent]]
    assert pump.received == 40
    # One recvmmsg for the whole burst; the pure pump pays one recvfrom each, and the EAGAIN.
    assert pump.reads == (1 if cls is not udp.Pump else 41)
    client.close()
    sock.close()


def test_a_gro_train_is_split_into_its_datagrams():
    if compiled_udp is None:
        pytest.skip("not compiled")
    pump, sock, ep = _pump(compiled_udp.Pump)
    if not pump.mm.gro or not pump.gso:
        pytest.skip("this kernel has no UDP GRO or GSO")
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.bind(("127.0.0.1", 0))
    # One GSO send of 10 segments of 1200 bytes (the last shorter): on loopback it reaches a
    # GRO socket as one message, with the segment size in a control message.
    payload = b"".join(bytes([65 + i]) * 1200 for i in range(9)) + b"z" * 500
    client.sendmsg([payload], [(17, 103, (1200).to_bytes(2, "little"))], 0, sock.getsockname())
    pump.readable(0.0)
    got = [d for b in ep.batches for d, _ in b]
    assert got == [payload[i:i + 1200] for i in range(0, len(payload), 1200)]
    assert pump.reads == 1
    client.close()
    sock.close()


@pytest.mark.parametrize("cls", PUMPS)
def test_a_flush_to_several_addresses(cls):
    pump, sock, ep = _pump(cls)
    peers = []
    for _ in range(5):
        p = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        p.bind(("127.0.0.1", 0))
        p.settimeout(2)
        peers.append(p)
    # Two single datagrams and one GSO group (3 × 1000 bytes) per peer.
    for p in peers:
        addr = p.getsockname()
        ep.out += [(b"a" * 50, addr, 0), (b"b" * 70, addr, 0), (b"c" * 3000, addr, 1000)]
    assert pump.flush(0.0)
    assert ep.out == []
    for p in peers:
        got = [p.recv(65535) for _ in range(5)]
        assert got == [b"a" * 50, b"b" * 70, b"c" * 1000, b"c" * 1000, b"c" * 1000]
        p.close()
    if cls is not udp.Pump:
        assert pump.writes == 1  # one sendmmsg for 15 items to 5 addresses
    else:
        assert pump.writes == (15 if pump.gso else 25)
    sock.close()
