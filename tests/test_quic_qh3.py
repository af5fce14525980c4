"""qh3's server against aioquic's client, in memory (orisha/protocols/quic_qh3.py).

aioquic's client pads its first datagram with zero bytes after its Initial packet; qh3 2.1.0
credits the amplification limit per authenticated packet, so its own server connection raises
``packet builder capacity exhausted`` on that datagram. The first test pins that (it fails
once qh3 counts whole datagrams, and the workaround can go); the others show the workaround's
connection completing the handshake and an HTTP/3 exchange, credited with the whole datagram.
"""

from __future__ import annotations

import pytest
from aioquic.buffer import Buffer
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import HandshakeCompleted
from aioquic.quic.packet import pull_quic_header
from qh3.h3.connection import H3Connection as Qh3H3
from qh3.h3.events import HeadersReceived as Qh3Headers
from qh3.quic.configuration import QuicConfiguration as Qh3Configuration
from qh3.quic.connection import QuicConnection as Qh3Connection, QuicConnectionError

from orisha.protocols.quic_qh3 import ServerConnection
from tlsutil import pki  # noqa: F401  (a fixture)

SERVER, CLIENT = ("127.0.0.1", 4433), ("127.0.0.1", 50000)


def _pair(pki, cls):
    client = QuicConnection(configuration=QuicConfiguration(
        is_client=True, alpn_protocols=H3_ALPN, server_name="localhost", cafile=pki.ca))
    client.connect(SERVER, now=0.0)
    first = client.datagrams_to_send(0.0)
    # qh3's HTTP/3 layer always sends SETTINGS_H3_DATAGRAM=1, which RFC 9297 §2.1.1 forbids
    # without the max_datagram_frame_size transport parameter (aioquic's client closes)
    config = Qh3Configuration(is_client=False, alpn_protocols=H3_ALPN,
                              max_datagram_frame_size=65536)
    config.load_cert_chain(pki.cert, pki.key)
    odcid = pull_quic_header(Buffer(data=first[0][0]), host_cid_length=8).destination_cid
    server = cls(configuration=config, original_destination_connection_id=odcid)
    return client, server, first


def test_qh3_alone_takes_aioquic_short(pki):
    """The reason for the workaround: qh3's own server fails on aioquic's first datagram, whose
    Initial (about 500 bytes) is followed by zero padding that the path is not credited with."""
    client, server, first = _pair(pki, Qh3Connection)
    data = first[0][0]
    assert len(data) >= 1200 and data[-16:] == bytes(16)  # padded after the packet
    server.receive_datagram(data, CLIENT, 0.0)
    with pytest.raises(QuicConnectionError, match="capacity exhausted"):
        server.datagrams_to_send(0.0)


def test_workaround_credits_the_whole_datagram_and_answers(pki):
    client, server, first = _pair(pki, ServerConnection)
    server.receive_datagram(first[0][0], CLIENT, 0.0)
    assert server._core.active_path[4] == len(first[0][0])  # bytes received: all of it
    for data, _ in server.datagrams_to_send(0.0):  # raised before the workaround
        client.receive_datagram(data, SERVER, 0.0)
    client_h3, server_h3 = H3Connection(client), Qh3H3(server)
    seen, answered, sid, now = [], False, None, 0.0
    for _ in range(20):
        now += 0.005
        for data, _ in server.datagrams_to_send(now):
            client.receive_datagram(data, SERVER, now)
        e = client.next_event()
        while e is not None:
            seen.append(e)
            if e.__class__ is HandshakeCompleted:
                sid = client.get_next_available_stream_id()
                client_h3.send_headers(sid, [(b":method", b"GET"), (b":scheme", b"https"),
                                             (b":authority", b"localhost"), (b":path", b"/")],
                                       end_stream=True)
            seen.extend(client_h3.handle_event(e))
            e = client.next_event()
        se = server.next_event()
        while se is not None:
            for h in server_h3.handle_event(se):
                if h.__class__ is Qh3Headers and not answered:
                    answered = True
                    server_h3.send_headers(h.stream_id, [(b":status", b"200")])
                    server_h3.send_data(h.stream_id, b"hello over qh3", end_stream=True)
            se = server.next_event()
        for data, _ in client.datagrams_to_send(now):
            server.receive_datagram(data, CLIENT, now)
    assert any(e.__class__ is HandshakeCompleted for e in seen)
    heads = [e for e in seen if e.__class__ is HeadersReceived and e.stream_id == sid]
    body = b"".join(e.data for e in seen if e.__class__ is DataReceived and e.stream_id == sid)
    assert heads and (b":status", b"200") in heads[0].headers and body == b"hello over qh3"


def test_the_server_resends_a_lost_handshake_done_on_its_own_timer(pki):
    """Once its handshake is complete the server arms its own probe timeout (RFC 9002 §6.2):
    its first four datagrams after that (HANDSHAKE_DONE among them) are lost, and what
    confirms the client's handshake is a datagram the server sent from ``handle_timer``,
    not an answer to one of the client's probes (a loaded interop run had the client
    probing for a minute with nothing from the server in between; not this layer)."""
    client, server, first = _pair(pki, ServerConnection)
    server.receive_datagram(first[0][0], CLIENT, 0.0)
    now, dropped, source = 0.0, 0, []

    def deliver(why: str) -> None:
        nonlocal dropped
        for data, _ in server.datagrams_to_send(now):
            if server._handshake_complete and dropped < 4:
                dropped += 1
                continue
            client.receive_datagram(data, SERVER, now)
            if client._handshake_confirmed and not source:
                source.append(why)

    while now < 30 and not client._handshake_confirmed:
        deliver("an answer to the client")
        while client.next_event() is not None:
            pass
        for data, _ in client.datagrams_to_send(now):
            server.receive_datagram(data, CLIENT, now)
        timers = [t for t in (client.get_timer(), server.get_timer()) if t is not None]
        now = max(now + 0.001, min(timers))
        if client.get_timer() is not None and client.get_timer() <= now:
            client.handle_timer(now)
        if server.get_timer() is not None and server.get_timer() <= now:
            server.handle_timer(now)
            deliver("the server's timer")
    assert client._handshake_confirmed and dropped == 4, (now, dropped)
    assert source == ["the server's timer"], source
