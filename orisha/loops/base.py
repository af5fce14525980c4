"""The seam between the request core and the loop bodies.

A loop body waits for readiness or completions and moves bytes between
sockets and ``orisha.core.connection.Connection`` objects. It holds no HTTP
logic: framing, keep-alive, pipelining, timeouts, negotiation and routing are
the core's. For each accepted socket it follows this contract:

  conn = app.connect(now, peer)  on accept, with the peer's address as text (then write
                                 ``conn.outgoing`` if any: a worker over its connection
                                 limit answers 503 at once)
  conn.receive(data, now)        after each read; ``b""`` when the peer shut its side
  conn.outgoing                  the buffers to write next, in order (a list; may be empty);
                                 the core keeps them alive until ``sent`` reports them
  conn.sent(n, now)              after writing n bytes of ``outgoing``
  conn.wants_read                read only while True (False while output is pending: backpressure)
  conn.should_close              close the socket as soon as this is True
  conn.shut_write                when True (and nothing is outgoing), shut down the sending
                                 side once (SHUT_WR) and keep reading: the core drains input
                                 until the peer's EOF so the close cannot become a reset
  conn.tick(now)                 about once a second for every connection (timeouts)
  conn.shutdown(now)             graceful stop: idle connections close, busy ones finish
  conn.close()                   exactly once, when the loop has closed the socket
  app.tick(now)                  about once a second, and once more before ``run`` returns
                                 (counters and access-log lines leave the worker here)
  orisha.blob.release()          about once a second (the blob's pages leave the worker's
                                 page tables; they stay in the page cache)

The graceful stop, the same in every body: when ``stopping()`` is first seen True the
loop stops accepting *before* it handles that turn's events, so a connection still
queued stays on the listener — which the supervisor and the next generation share (a
reload: they answer it) or which closes (a stop: the client is refused). Then every
connection gets ``conn.shutdown(now)`` except one that has not had its first response
yet (accepted, but its request is still on the way; or handed over by an accept that
completed after the stop, as io_uring's multishot accept does): that one is *late*, and
gets ``shutdown`` as soon as a receive leaves its first response in ``outgoing`` — its
request is answered, never accepted and dropped (the head and idle timeouts and the
grace bound the wait). A body keeps ticking while it drains.

``now`` is ``time.time()``. Errors on a socket (ECONNRESET, EPIPE…) end that
connection only: the loop closes it and calls ``conn.close()``.

Items of ``outgoing`` are bytes-like, except large bodies, which are
``orisha.blob.FileRegion(fd, offset, length)``: bytes of the blob's file to send
with sendfile (or splice), never through the worker's memory. A region is
reported whole: while part of it is written the loop keeps its own position in
it and calls ``conn.sent(0, now)`` (progress, for the send timeout), then
``conn.sent(region.length, now)`` once all of it is written. A loop that cannot
send from a file writes ``region.view`` (a memoryview of the same bytes).

The datagram side (HTTP/3 over QUIC, orisha/protocols/compiled_h3.pyx). A body may be given
``datagrams``: a ``Datagrams`` pair of a bound, non-blocking UDP socket and an
*endpoint* that holds every QUIC connection of the worker. There is no per-connection
object at this level: the endpoint demultiplexes by connection ID itself. Contract:

  ep.receive(batch, now)         after each read turn: ``batch`` is a list of
                                 (data, address) pairs, every datagram read until EAGAIN
                                 or ``BATCH`` of them (so one turn cannot starve the rest)
  ep.outgoing                    a list of (payload, address, segment) to send next, in
                                 order: ``payload`` is one datagram when ``segment`` is 0,
                                 else datagrams of ``segment`` bytes (the last may be
                                 shorter) for one GSO send (UDP_SEGMENT) — a body that
                                 cannot do GSO sends each slice itself
  ep.sent(n, now)                after sending the first n items of ``outgoing`` (fewer
                                 than all when the socket buffer is full: wait until
                                 writable, then send the rest). A datagram the kernel
                                 refuses otherwise (EMSGSIZE, EHOSTUNREACH…) counts as
                                 sent: QUIC treats it as lost and recovers
  ep.timer                       the time (``now``'s clock) at which ``ep.expire`` is due,
                                 or None: the one timer of all QUIC connections
  ep.expire(now)                 once ``now >= ep.timer`` (retransmissions, ACK delay, idle)
  ep.tick(now)                   about once a second
  ep.shutdown(now)               graceful stop: HTTP/3 GOAWAY, CONNECTION_CLOSE once drained
  ep.busy                        True while connections remain (a stopping body keeps the
                                 socket until it is False or the grace is over)
  ep.close()                     once, when the body has closed the socket

After ``receive``, ``expire``, ``tick`` and ``shutdown`` the body flushes ``outgoing``.
The shared moving — reads in batches, GSO sends, the timer — is ``orisha/loops/udp.py``'s
``Pump``; a body only watches the socket (readable; writable while ``outgoing`` is left)
and waits no longer than the timer.
"""

from __future__ import annotations

import socket
from typing import Callable, NamedTuple, Protocol

from ..core.connection import App

# A connection's first answer (the graceful stop above): FRESH from its accept until a
# receive leaves a response outgoing, LATE when the stop comes before that, then ANSWERED.
ANSWERED, FRESH, LATE = 0, 1, 2
BACKLOG = 4096  # listen(2) backlog of every listener (orisha/serving/server.py opens them)
BATCH = 64  # datagrams read per turn at most (the datagram side, above)


class Datagrams(NamedTuple):
    """The datagram side a body may be given: a UDP socket and the endpoint it feeds;
    ``steer``: this worker's connection-ID tag (orisha/protocols/quic_steer.py) or None;
    a body given one binds ``udp.handover_socket(steer)``, calls ``ep.steer_with(steer)``,
    sends ``udp.handovers(ep, …)`` before ``ep.outgoing`` and gives what it reads there
    to ``ep.receive(udp.handed(…), now, True)`` (``udp.Pump`` does all of it)."""
    sock: socket.socket
    endpoint: object
    steer: object = None


def last_accepts(listener: socket.socket):
    """The descriptors still queued on ``listener`` after a stop, then the listener closed.

    For the io_uring bodies, once their accept has ended: io_uring arms an accept's poll
    with EPOLLEXCLUSIVE (its op table marks IORING_OP_ACCEPT poll_exclusive), so a
    connection wakes one waiter only; when that was our accept and the cancel ended it
    first, the next generation's accept on the same listener is never woken and the
    connection would wait until another arrives (seen as a hung client at one reload in
    twenty). The caller serves each as late (above). At most a backlog's worth: those
    queued before the cancel come first, and a flood cannot keep us here."""
    for _ in range(BACKLOG if listener.fileno() >= 0 else 0):
        try:
            sock = listener.accept()[0]
        except BlockingIOError:  # nothing queued
            break
        except ConnectionAbortedError:  # the client gave up while queued
            continue
        except OSError:  # EMFILE and friends: what is left waits for the next wake-up
            break
        yield sock.detach()
    listener.close()


class LoopBody(Protocol):
    name: str
    """Short name used by ``--loop`` and in logs."""

    def __init__(self, listener: socket.socket, app: App,
                 datagrams: Datagrams | None = None) -> None:
        """Take a bound, listening, non-blocking socket (and the datagram side, if
        any: above); do not accept or read yet."""

    def run(self, stopping: Callable[[], bool]) -> None:
        """Serve until ``stopping()`` is True (checked at least once a second),
        then stop accepting, ``shutdown`` every connection (and the endpoint), let
        in-flight responses finish (at most ``app.limits.grace`` seconds) and return."""
