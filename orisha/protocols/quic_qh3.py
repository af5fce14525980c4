"""qh3's server connection, made to take aioquic's client: the first step of porting h3.py.

Strategy: qh3 (2.1.0) keeps QUIC's state machine in Rust and splits each received datagram
into its coalesced packets in Python (``QuicConnection.receive_datagram``), handing the core
one packet at a time so that TLS installs the Handshake keys between them. The core credits a
path, for the 3x amplification limit before address validation (RFC 9000 §8.1), with the bytes
of each packet it authenticates, not of the datagram: bytes after the last packet are not
counted. aioquic's client pads its first datagram that way (a 518-byte Initial, then 682 zero
bytes), so a qh3 server is allowed 3 × 518 bytes, sends its 1,280-byte first datagram, and its
next packet (a 900-byte Handshake CRYPTO chunk) fits neither the 274 bytes left nor waits for
more: the builder raises ``packet builder capacity exhausted`` out of ``poll_transmit``. §8.1
asks a server to "count all of the payload bytes received in datagrams that are uniquely
attributed to a single connection", so here the last packet's slice runs to the datagram's end:
the core authenticates the packet, credits the whole slice, and drops the padding after it as
it drops any bytes that do not parse. Nothing else changes (no datagram size or key share
avoids it: the credit is short whatever the client's hello is).

h3.py still runs on aioquic; this module is not used by the server yet.
"""

from __future__ import annotations

from qh3._hazmat import pull_quic_header
from qh3.quic.connection import QuicConnection
from qh3.quic.packet import QuicPacketType

_END = 9  # pull_quic_header's tuple: the offset where the packet ends


class ServerConnection(QuicConnection):
    """A qh3 server connection whose datagrams are credited whole (see the module's docstring)."""

    def receive_datagram(self, data: bytes, addr, now: float) -> None:
        if self._core is None:
            # The first datagram: qh3's own checks (≥ 1200 bytes, an Initial of a version it
            # supports) make the core; its loop would then split the datagram short.
            if not self._first(data, addr, now):
                return
        length, offset, n = self._configuration.connection_id_length, 0, len(data)
        while offset < n:
            end = _packet_end(data, offset, length)
            if end < n and not _parses(data, end, length):
                end = n  # the rest is padding: counted with this packet (RFC 9000 §8.1)
            piece = data[offset:end]
            report = self._call_core(self._core.receive_datagram, piece, addr, now, n)
            if report[2]:  # authenticated: its source ID is the client's (TLS checks it)
                self._learn_remote_source_cid(piece)
            self._drain_core()
            offset = end

    def _first(self, data: bytes, addr, now: float) -> bool:
        if len(data) < 1200:
            return False
        try:
            header = pull_quic_header(data, 0, self._configuration.connection_id_length)
        except ValueError:  # not a QUIC long header: nothing to make a connection of
            return False
        if (header[1] != int(QuicPacketType.INITIAL)
                or header[0] not in self._configuration.supported_versions):
            return False  # not an Initial, or of a version this configuration lacks
        self._remote_addr, self._version = self._normalize_address(addr), header[0]
        self._create_core(self._remote_addr, header[3], now)
        self._create_tls(remote_source_cid=None)
        return True


def _parses(data: bytes, offset: int, length: int) -> bool:
    try:
        pull_quic_header(data, offset, length)
    except ValueError:  # padding or junk after the packets
        return False
    return True


def _packet_end(data: bytes, offset: int, length: int) -> int:
    """Where the packet at ``offset`` ends; the datagram's end for what does not parse."""
    try:
        end = pull_quic_header(data, offset, length)[_END]
    except ValueError:  # not a packet: the core drops it, credited or not
        return len(data)
    return end if offset < end <= len(data) else len(data)
