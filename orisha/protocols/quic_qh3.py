"""qh3's server connection, made to take aioquic's client (h3.py's connections are these).

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
"""

from __future__ import annotations

import copy

from qh3._hazmat import pull_quic_header
from qh3.quic.connection import QuicConnection, QuicConnectionError
from qh3.quic.crypto import CIPHER_SUITES, derive_key_iv_hp
from qh3.quic.events import PingAcknowledged
from qh3.quic.packet import QuicErrorCode, QuicPacketType
from qh3.tls import CipherSuite, Epoch, cipher_suite_hash, hkdf_expand_label, hkdf_extract

from .fields import H3_HANDSHAKE_HOLD

# RFC 9001 §5.2 and RFC 9369 §3.3.1: the salts of the Initial secrets, per version.
_INITIAL_SALTS = {0x00000001: bytes.fromhex("38762cf7f55934b34d179ae6a4c80cadccbb7f0a"),
                  0x6B3343CF: bytes.fromhex("0dede3def700a6db819381be6e269dcbf9bd2ed9")}

_EXHAUSTED = "packet builder capacity exhausted"
_TYPE, _END = 1, 9  # pull_quic_header's tuple: the packet's type; the offset where it ends
_INITIAL, _HANDSHAKE = int(QuicPacketType.INITIAL), int(QuicPacketType.HANDSHAKE)
_INITIAL_EPOCH = int(Epoch.INITIAL)
# RFC 9002 §6.2.3: resending the handshake's CRYPTO data ahead of the probe timeout "for a
# limited number of times per connection" (an endpoint that always answers what it cannot
# use that way "risks creating an infinite exchange of packets").
EARLY_RESENDS = 8
# Seconds a connection's core waits for its peer before it is forgotten (RFC 9000 §10.1),
# at least, until it has agreed the peer's own idle timeout (so: during the handshake, and
# no longer than the client's). A client's probes back off from a 1 s timeout (RFC 9002
# §6.2.1): at 1, 3, 7, 15, 31 and 63 s. While its address is not validated the server is
# held to 3x what the client sent (RFC 9000 §8.1), which its first flight may use up: then
# only those probes can bring the handshake on, and a server that forgot the client after
# 30 s of silence lost a handshake whose probes at 15 and 31 s were both lost. Held 64 s,
# it outlives every probe lost but the one at 63 s. After the handshake the configured
# idle timeout is the endpoint's to keep (h3.py ``Endpoint.tick``).
HANDSHAKE_HOLD = H3_HANDSHAKE_HOLD
# The uid of the PING sent with the HANDSHAKE_DONE frame: its acknowledgment says the client
# has the 1-RTT packets of that flight (``ServerConnection.confirming``).
CONFIRM_PING = 0x48445F444F4E45  # "HD_DONE"


class _Handshake(QuicConnection):
    """What a qh3 server connection needs for handshakes under loss: its CRYPTO data sent
    again to a client's probes ahead of the probe timeout (RFC 9002 §6.2.3), its
    HANDSHAKE_DONE again to a client that has not confirmed (RFC 9001 §4.1.2), whether the
    client has, and the core held ``HANDSHAKE_HOLD`` meanwhile. ``ServerConnection`` calls
    these from its datagram path and gives ``built`` (what the core builds now)."""

    _now = 0.0     # the time of the input being handled (``_drain_core`` has no argument)
    # The CRYPTO data sent so far, as (epoch, offset, data): kept until the handshake is
    # complete, for ``_resend_crypto``; and how many early resends are left.
    crypto: list | None = None
    resends = EARLY_RESENDS
    # After the handshake, until the client is known to have confirmed it (RFC 9001 §4.1.2:
    # its HANDSHAKE_DONE): None before the handshake is complete, True until the PING sent
    # with the HANDSHAKE_DONE is acknowledged, then False. While True the endpoint holds the
    # connection as long as a handshake (h3.py ``Endpoint.tick``): such a client's probes
    # back off as a handshake's do. And how many more times a client's late Handshake
    # packet may bring the HANDSHAKE_DONE again (``_answer_probe``).
    confirming: bool | None = None
    confirms = EARLY_RESENDS
    losses = 0  # the core's count of packets lost when the last such PING was sent

    def _confirmation(self) -> None:
        """At the handshake's completion, a PING with the HANDSHAKE_DONE (qh3 has just queued
        it); after, its acknowledgment taken out of the events (it ends ``confirming``). qh3
        does not send a lost PING again: one is sent again whenever its core has declared
        packets lost since the last (the PING's may be among them)."""
        core = self._core
        if self.confirming is None:
            self.confirming, self.losses = True, core.loss_total
            core.send_ping(CONFIRM_PING)
            return
        for event in self._events:
            if event.__class__ is PingAcknowledged and event.uid == CONFIRM_PING:
                self._events.remove(event)
                self.confirming = False
                return
        if core.loss_total != self.losses:
            self.losses = core.loss_total
            core.send_ping(CONFIRM_PING)

    def _create_core(self, remote_addr, initial_dcid: bytes, now: float) -> None:
        """qh3's, with the core's idle timeout at least ``HANDSHAKE_HOLD`` (the transport
        parameter the client is told is still the configuration's)."""
        configuration = self._configuration
        idle = configuration.idle_timeout
        if idle is None or idle >= HANDSHAKE_HOLD:
            return QuicConnection._create_core(self, remote_addr, initial_dcid, now)
        self._configuration = copy.copy(configuration)
        self._configuration.idle_timeout = HANDSHAKE_HOLD
        try:
            return QuicConnection._create_core(self, remote_addr, initial_dcid, now)
        finally:
            self._configuration = configuration

    def _call_core(self, operation, *args):
        """qh3's, also keeping the CRYPTO data TLS hands the core during the handshake."""
        if self.crypto is not None and operation.__name__ == "send_crypto":
            self.crypto.append(args)
        return QuicConnection._call_core(self, operation, *args)

    def _resend_crypto(self, initial: bool = True) -> None:
        """The handshake's CRYPTO data queued again, Initial and Handshake, ahead of the probe
        timeout (RFC 9002 §6.2.3): a client datagram with an Initial packet and no Handshake
        packet after the server has answered says the client lacks the ServerHello (it has
        no Handshake keys) or all of the flight after it. Without it only the server's probe
        timer sends them again, which backs off on its own (1, 2, 4 … s) while the client's
        probes back off on theirs: at 30 % loss each way a client had probed for a minute,
        each probe answered with an ACK alone, until the server's idle timeout forgot it.
        Without ``initial``, the Handshake data alone (a client with the Handshake keys has
        the ServerHello). Only for a datagram that acknowledged nothing new: a client's
        acknowledgment of part of the flight, not a probe, is the core's loss detection's.
        The anti-amplification limit still bounds what goes out (RFC 9000 §8.1)."""
        self.resends -= 1
        send, now = self._core.send_crypto, self._now
        for _ in range(2 if initial else 0):  # the ServerHello twice, a datagram each
            for epoch, offset, data in self.crypto:
                if epoch == _INITIAL_EPOCH:
                    QuicConnection._call_core(self, send, epoch, offset, data)  # not kept again
            self.built(now, 1)  # one datagram: not what a probe timeout queued after it
        for epoch, offset, data in self.crypto:
            if epoch != _INITIAL_EPOCH:
                QuicConnection._call_core(self, send, epoch, offset, data)

    def _answer_probe(self, answered: bool, initial: bool, handshake: bool, late: bool,
                      flight: int) -> None:
        """After a client datagram (``receive_datagram``: whether this server's flight had
        gone, which authenticated packets it held, whether a Handshake packet came after the
        handshake was complete, and the bytes in flight before it): what a probe gets."""
        if self._handshake_complete:
            self.crypto = None
            if late and self.confirming and self.confirms > 0:
                # RFC 9001 §4.1.2: a client sends Handshake packets until the HANDSHAKE_DONE
                # confirms its handshake: this one's probe says it has none. Sent again at
                # once — a HANDSHAKE_DONE lost otherwise waits for the server's own probe
                # timer, which backs off as the client's probes do, and (keys discarded) the
                # probe cannot even be acknowledged.
                self.confirms -= 1
                self._core.handshake_complete()  # queues a HANDSHAKE_DONE; nothing else again
                self._core.send_ping(CONFIRM_PING)  # the first one's was lost with it, surely
        elif self._core is None or not answered or self._core.bytes_in_flight != flight:
            pass  # an acknowledgment of something new: not a probe (loss detection is qh3's)
        elif initial and not handshake:
            self._resend_crypto()
        elif handshake:
            # The client has the Handshake keys, and its Handshake packet acknowledged nothing
            # new: a probe (a PING) of a client that lacks some of this flight, which qh3
            # would answer with an ACK alone. Its Handshake CRYPTO data again, as above.
            self._resend_crypto(initial=False)


class ServerConnection(_Handshake):
    """A qh3 server connection whose datagrams are credited whole (see the module's docstring)."""

    held = False   # the last poll ended congestion-limited: the core may hold reservations
    early: list | None = None  # datagrams built before a drain (``_drain_core``), not yet sent

    def _drain_core(self) -> None:
        """qh3's, put off while its core may hold stream reservations across a drain.

        qh3 2.1.0's core reserves stream frames for a packet before it knows whether the
        congestion window lets one go; when it does not, the reservations stay queued
        for the next ``poll_transmit`` — and draining its events meanwhile may remove a
        stream that has just finished (an ACK for its last bytes: a probe or
        retransmission of them was what was reserved), after which the next packet
        with that reservation fails (``reserved stream is missing``) and loses its
        frames and every reservation after it: the connection stalls for good. So after
        a poll that ended congestion-limited, the next drain first polls (what it
        builds goes out with the next ``datagrams_to_send``) and runs only if the window
        has opened — which empties the reservations (a packet takes them); else the
        events wait in the core for the next input or timer (an ACK or a probe
        timeout), which is when the window can open."""
        core = self._core
        if self.held and self._handshake_complete and core is not None \
                and core.state == "connected":
            self.built(self._now)
            if self.held:
                return
        super()._drain_core()
        if self.confirming is not False and self._handshake_complete:
            self._confirmation()

    def built(self, now: float, most: int = 0) -> None:
        """Every datagram the core will build now (its first ``most`` if that is not 0),
        kept for the next ``datagrams_to_send`` (the core counts them in flight from here)."""
        got = self._poll(now, most)
        if got:
            if self.early is None:
                self.early = got
            else:
                self.early.extend(got)

    def handle_timer(self, now: float) -> None:
        self._now = now
        super().handle_timer(now)

    def receive_batch(self, datagrams: list, addr, now: float) -> None:
        """Datagrams of one address, in order: once the handshake is complete (no more
        keys to install between packets) one call of the core for all of them and one
        drain of its events; before, one by one (``receive_datagram``)."""
        if not self._handshake_complete or self._core is None \
                or self.confirming and any(d and d[0] & 0x80 for d in datagrams):
            for data in datagrams:
                self.receive_datagram(data, addr, now)
            return
        self._now = now
        if self._quic_logger is not None:
            for data in datagrams:
                self._log_datagram("datagrams_received", data)
        self._call_core(self._core.receive_many_datagrams, datagrams,
                        self._normalize_address(addr), now)
        self._drain_core()

    def datagrams_to_send(self, now: float) -> list:
        """qh3's, without parsing every packet's header again for a log that is off; and
        the core's ``packet builder capacity exhausted`` taken as "nothing more now": it
        raises it when what the amplification limit still allows (RFC 9000 §8.1) is too
        small for its next packet — e.g. after a client's unpadded 56-byte Handshake PING
        probe under loss — where it should wait for the client's next datagram (which
        raises the limit) as it does when nothing at all is allowed. The datagrams built
        before stand; the frames of the refused packet were never sent and go out later."""
        early = self.early
        if early is not None:
            self.early = None
            early.extend(self._poll(now))
            return early
        return self._poll(now)

    def _poll(self, now: float, most: int = 0) -> list:
        """Every datagram the core will build now, or its first ``most`` (``held`` says
        whether it stopped on the congestion window)."""
        core = self._core
        if core is None:
            return []
        poll, out, log = core.poll_transmit, [], self._quic_logger is not None
        try:
            transmit = poll(now)
            while transmit is not None:
                out.append((transmit[0], transmit[1]))
                if log:
                    self._log_datagram("datagrams_sent", transmit[0])
                    self._log_packets("packet_sent", transmit[0])
                if len(out) == most:
                    break
                transmit = poll(now)
        except (RuntimeError, ValueError) as e:  # as qh3's _call_core, for the one above
            if str(e) != _EXHAUSTED:
                raise QuicConnectionError(QuicErrorCode.INTERNAL_ERROR, None, str(e)) from e
        self.held = core.congestion_window - core.bytes_in_flight \
            < self._configuration.max_datagram_size
        return out

    def receive_datagram(self, data: bytes, addr, now: float) -> None:
        self._now = now
        if self._handshake_complete and data and not data[0] & 0x80 \
                and self._quic_logger is None:
            # A short header after the handshake: one packet to the datagram's end.
            self._call_core(self._core.receive_datagram, data, self._normalize_address(addr),
                            now, len(data))
            self._drain_core()
            return
        if self._core is None:
            # The first datagram: qh3's own checks (≥ 1200 bytes, an Initial of a version it
            # supports) make the core; its loop would then split the datagram short.
            if not self._first(data, addr, now):
                return
            self.crypto = []
        answered = bool(self.crypto) and self.resends > 0  # this server's flight has gone
        complete, initial, handshake, late = self._handshake_complete, False, False, False
        flight = self._core.bytes_in_flight
        length, offset, n = self._configuration.connection_id_length, 0, len(data)
        while offset < n:
            end, kind = _packet_end(data, offset, length)
            if end < n and not _parses(data, end, length):
                end = n  # the rest is padding: counted with this packet (RFC 9000 §8.1)
            piece = data[offset:end]
            report = self._call_core(self._core.receive_datagram, piece, addr, now, n)
            if report[2]:  # authenticated: its source ID is the client's (TLS checks it)
                self._learn_remote_source_cid(piece)
                initial |= kind == _INITIAL
                handshake |= kind == _HANDSHAKE
            elif complete and kind == _HANDSHAKE:
                late = True  # its keys are gone: the client has not confirmed the handshake
            self._drain_core()
            offset = end
        self._answer_probe(answered, initial, handshake, late, flight)

    def _learn_remote_source_cid(self, data: bytes) -> None:
        """The client's source connection ID, which its transport parameters must repeat
        (RFC 9000 §7.3) — also when it is empty: qh3 2.1.0 keeps it only when it is not,
        so a client with zero-length IDs (Chromium's) fails the handshake with
        "initial_source_connection_id does not match". Long headers only (a short
        header has no source ID)."""
        if self._handshake_complete or self._tls is None or not data[0] & 0x80:
            return
        try:
            header = pull_quic_header(data, 0, self._configuration.connection_id_length)
        except ValueError:
            return
        self._tls.remote_initial_source_connection_id = header[4]

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
        if header[4] or header[0] not in _INITIAL_SALTS:
            self._create_core(self._remote_addr, header[3], now)
        else:
            # A client with zero-length IDs (Chromium): qh3's core addresses the client by
            # the ID it derives the Initial keys from until a packet names a non-empty one,
            # so it would answer under an ID such a client does not have. Instead the core
            # is made toward the empty ID, the client's chosen ID becomes ours (the core
            # takes only packets to its own ID or to the one it derives keys from), and
            # the Initial keys of that ID are installed here.
            self.host_cid = header[3]
            self._create_core(self._remote_addr, b"", now)
            _install_initial_keys(self._core, header[3], header[0])
        self._create_tls(remote_source_cid=None)
        return True


def _install_initial_keys(core, dcid: bytes, version: int) -> None:
    """The Initial keys a server derives from the client's first Destination ID (RFC 9001
    §5.2), installed in qh3's core for both directions."""
    suite = CipherSuite.AES_128_GCM_SHA256
    algorithm = cipher_suite_hash(suite)
    hp_name, aead_name = CIPHER_SUITES[suite]
    initial = hkdf_extract(algorithm, _INITIAL_SALTS[version], dcid)
    for direction, label in (("receive", b"client in"), ("send", b"server in")):
        secret = hkdf_expand_label(algorithm, initial, label, b"", 32)
        key, iv, hp = derive_key_iv_hp(cipher_suite=suite, secret=secret, version=version)
        core.install_packet_key(direction, 0, (aead_name.decode(), hp_name.decode()), key, iv,
                                hp, 0, secret, version)


def _parses(data: bytes, offset: int, length: int) -> bool:
    try:
        pull_quic_header(data, offset, length)
    except ValueError:  # padding or junk after the packets
        return False
    return True


def _packet_end(data: bytes, offset: int, length: int) -> tuple[int, int | None]:
    """Where the packet at ``offset`` ends (the datagram's end for what does not parse), and
    its long header's type (None for a short header or what does not parse)."""
    try:
        header = pull_quic_header(data, offset, length)
    except ValueError:  # not a packet: the core drops it, credited or not
        return len(data), None
    end = header[_END]
    kind = header[_TYPE] if data[offset] & 0x80 else None
    return (end if offset < end <= len(data) else len(data)), kind
