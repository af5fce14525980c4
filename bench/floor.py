"""The floor: a pure-Python epoll loop that answers every request with one constant.

Strategy: no parsing, no negotiation, no Date — it counts request ends in what
it read and sends that many copies of one precomputed response. Whatever a
Python server does per request costs at least this much CPU; bench/bench.py
prints it as the floor line.

    python bench/floor.py PORT BODY_FILE
"""

from __future__ import annotations

import select
import socket
import sys


def main() -> None:
    port, body = int(sys.argv[1]), open(sys.argv[2], "rb").read()
    response = (b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Encoding: gzip\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body)) + body
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(4096)
    ls.setblocking(False)
    ep = select.epoll()
    ep.register(ls.fileno(), select.EPOLLIN)
    socks: dict[int, socket.socket] = {}
    lfd = ls.fileno()
    while True:
        for fd, _ in ep.poll():
            if fd == lfd:
                while True:
                    try:
                        s, _ = ls.accept()
                    except BlockingIOError:
                        break
                    s.setblocking(False)
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    socks[s.fileno()] = s
                    ep.register(s.fileno(), select.EPOLLIN)
                continue
            s = socks[fd]
            try:
                data = s.recv(65536)
                if data:  # a benchmark client never fills the socket buffer with 1 response
                    s.send(response * data.count(b"\r\n\r\n"))
                    continue
            except OSError:  # ECONNRESET: the client went away
                pass
            ep.unregister(fd)
            del socks[fd]
            s.close()


if __name__ == "__main__":
    main()
