"""Loop body on asyncio Protocols, run by uvloop (the stdlib loop when uvloop is missing).

Strategy: the event loop does the waiting; a Protocol per connection hands
what it reads to the core and writes what the core returns. Backpressure in
both directions uses the transport's own switches: reading is paused while the
core wants no input, and writing stops at the transport's high-water mark
(``pause_writing``), with large bodies fed in slices so a slow reader never
makes the transport copy more than one slice beyond that mark. The graceful
stop follows ``base.py``; connections keep their once-a-second tick while the
worker drains, so a client that keeps a finished connection open is let go after
the core's linger, not held until the grace runs out.

The datagram side (``base.py``) is a ``DatagramProtocol``: what arrives within one
event-loop turn is gathered into one batch (a ``call_soon`` per turn), sends go
through the transport's ``sendto`` (it buffers on EAGAIN and pauses us at its
high-water mark), and the endpoint's timer is one ``call_at`` handle. A transport
takes no control messages, so this body sends GSO groups slice by slice. Steering
by connection ID (``udp.py``): the hand-over socket is one more reader of the loop,
and what the endpoint hands to other workers goes out before its own datagrams.
"""

from __future__ import annotations

import asyncio
import socket
import time

try:
    import uvloop
except ImportError:  # documented fallback: the stdlib loop, same behaviour, slower
    uvloop = None

from ..blob import REGION_MIN, FileRegion, release as release_maps
from ..core.connection import App
from .base import ANSWERED, BACKLOG, BATCH, FRESH, LATE
from .udp import HANDOVER_BYTES, handed, handover_socket, handovers

_SLICE = 256 * 1024


class _Protocol(asyncio.Protocol):
    __slots__ = ("body", "conn", "t", "paused", "reading", "eof_sent", "region_done", "first")

    def __init__(self, body: "Loop") -> None:
        self.body = body
        self.region_done = 0  # bytes of the first FileRegion written (base.py: reported whole)
        self.eof_sent = False
        self.paused = False
        self.reading = True

    def connection_made(self, transport) -> None:
        self.t = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        self.conn = self.body.app.connect(time.time(), peer[0] if peer else "-")
        # Its first answer (base.py): an accept the event loop took just before the server
        # closed may be handed over after the stop, and is late from the start.
        self.first = LATE if self.body.stopped else FRESH
        self.body.protocols.add(self)
        self.flush(time.time())

    def data_received(self, data: bytes) -> None:
        now = time.time()
        self.conn.receive(data, now)
        if self.first and self.conn.outgoing:  # its first response (see Loop._stop)
            if self.first == LATE:
                self.conn.shutdown(now)
            self.first = ANSWERED
        self.flush(now)

    def eof_received(self) -> bool:
        now = time.time()
        self.conn.receive(b"", now)
        self.flush(now)
        return True  # keep the transport open: answers to a half-closed client still go out

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self.flush(time.time())

    def _write_region(self, region: FileRegion, now: float) -> None:
        done = self.region_done
        piece = region.view[done:done + _SLICE]
        self.t.write(piece)
        self.region_done = done = done + len(piece)
        if done < region.length:
            self.conn.sent(0, now)
        else:
            self.region_done = 0
            self.conn.sent(region.length, now)

    def connection_lost(self, exc) -> None:
        self.body.protocols.discard(self)
        self.conn.close()

    def flush(self, now: float) -> None:
        conn, t = self.conn, self.t
        if t.is_closing():
            return
        while not self.paused:
            out = conn.outgoing
            if not out:
                break
            first = out[0]
            if first.__class__ is FileRegion:  # a transport writes memory: the region's map
                self._write_region(first, now)
                continue
            size = sum(len(b) for b in out)
            if size < REGION_MIN:  # so never a FileRegion among them (each is at least that)
                t.writelines(out)
            else:
                size = min(len(first), _SLICE)
                t.write(first if size == len(first) else memoryview(first)[:size])
            conn.sent(size, now)
        if conn.should_close:
            t.close()
            return
        if conn.shut_write and t.can_write_eof() and not self.eof_sent:
            self.eof_sent = True
            t.write_eof()
        want = conn.wants_read
        if want != self.reading:
            self.reading = want
            (t.resume_reading if want else t.pause_reading)()


class _Datagrams(asyncio.DatagramProtocol):
    """The datagram side: one UDP transport and its endpoint (base.py)."""

    def __init__(self, ep) -> None:
        self.ep, self.batch, self.t = ep, [], None
        self.paused = self.soon = False
        self.timer, self.timer_at = None, None
        self.hand, self.paths, self.buf = None, {}, b""

    def steer(self, steer) -> None:
        """Steering by connection ID: bind the hand-over socket and read it (``udp.py``)."""
        self.hand, self.buf = handover_socket(steer), bytearray(HANDOVER_BYTES)
        self.ep.steer_with(steer)
        asyncio.get_running_loop().add_reader(self.hand.fileno(), self.handed)

    def handed(self) -> None:
        for _ in range(BATCH):
            try:
                n = self.hand.recv_into(self.buf)
            except OSError:  # BlockingIOError: drained (nothing else is expected here)
                break
            self.ep.receive(handed(self.buf, n), time.time(), True)
        self.flush()

    def unsteer(self) -> None:
        if self.hand is not None:
            asyncio.get_running_loop().remove_reader(self.hand.fileno())
            self.hand.close()

    def connection_made(self, transport) -> None:
        self.t = transport

    def datagram_received(self, data: bytes, addr) -> None:
        self.batch.append((data, addr))
        if len(self.batch) >= BATCH:
            self.turn()
        elif not self.soon:  # the rest of this turn's datagrams join the batch
            self.soon = True
            asyncio.get_running_loop().call_soon(self.turn)

    def error_received(self, exc) -> None:  # ICMP errors for earlier sends: a lost datagram
        pass

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self.flush()

    def turn(self) -> None:
        self.soon = False
        if self.batch:
            batch, self.batch = self.batch, []
            self.ep.receive(batch, time.time())
        self.flush()

    def expire(self) -> None:
        self.timer = self.timer_at = None
        self.ep.expire(time.time())
        self.flush()

    def flush(self) -> None:
        if self.hand is not None and self.ep.forward:
            for msg, path in handovers(self.ep, self.paths):
                try:
                    self.hand.sendto(msg, path)
                except OSError:  # no such worker (any more), or its queue is full: lost
                    pass         # datagrams, which QUIC recovers
        out, t = self.ep.outgoing, self.t
        n = 0
        while n < len(out) and not self.paused and not t.is_closing():
            payload, addr, segment = out[n]
            if segment:
                view = memoryview(payload)
                for i in range(0, len(view), segment):
                    t.sendto(view[i:i + segment], addr)
            else:
                t.sendto(payload, addr)
            n += 1
        if n:
            self.ep.sent(n, time.time())
        at = self.ep.timer
        if at != self.timer_at:  # the one timer, re-armed only when it moved
            if self.timer is not None:
                self.timer.cancel()
            self.timer_at = at
            self.timer = None if at is None else asyncio.get_running_loop().call_later(
                max(0.0, at - time.time()), self.expire)


class Loop:
    name = "asyncio"

    def __init__(self, listener: socket.socket, app: App, datagrams=None) -> None:
        self.datagrams = datagrams
        self.udp: _Datagrams | None = None
        self.listener = listener
        self.app = app
        self.protocols: set[_Protocol] = set()
        self.stopped = False

    def run(self, stopping) -> None:
        if uvloop is not None:
            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        asyncio.run(self._serve(stopping))

    async def _serve(self, stopping) -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Protocol(self), sock=self.listener, backlog=BACKLOG)
        if self.datagrams is not None:
            _, self.udp = await loop.create_datagram_endpoint(
                lambda: _Datagrams(self.datagrams.endpoint), sock=self.datagrams.sock)
            if self.datagrams.steer is not None and hasattr(socket, "AF_UNIX"):
                self.udp.steer(self.datagrams.steer)
        while not stopping():
            await asyncio.sleep(1)
            self._tick(time.time())
        now = time.time()
        self._stop(server, now)
        deadline, next_tick = now + self.app.limits.grace, now + 1
        while (self.protocols or (self.udp and self.udp.ep.busy)) and now < deadline:
            await asyncio.sleep(0.05)  # the worker exits as soon as its last connection has
            now = time.time()
            if now >= next_tick:  # timeouts still apply: the linger after a last response
                next_tick = now + 1
                self._tick(now)
        for p in list(self.protocols):
            p.t.abort()
        if self.udp:
            self.udp.unsteer()
            self.udp.t.close()
            self.udp.ep.close()
        self.app.tick(time.time())  # last counters and log lines

    def _tick(self, now: float) -> None:
        self.app.tick(now)
        release_maps()
        if self.udp:
            self.udp.ep.tick(now)
            self.udp.flush()
        for p in list(self.protocols):
            p.conn.tick(now)
            p.flush(now)

    def _stop(self, server, now: float) -> None:
        """Stop accepting, then shut down every connection but the late ones: those still
        awaiting their first answer (base.py)."""
        self.stopped = True
        server.close()
        if self.udp:
            self.udp.ep.shutdown(now)
            self.udp.flush()
        for p in list(self.protocols):
            if p.first:
                p.first = LATE
            else:
                p.conn.shutdown(now)
                p.flush(now)
