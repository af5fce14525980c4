"""The admin port: metrics and health probes, and the client that checks a probe.

Strategy: the supervisor answers the admin port itself (one short request at a
time, between its other duties), so the answers say what the supervisor knows:

  /healthz   200 while the supervisor runs (a liveness probe: restart me if not)
  /readyz    200 once the site is loaded and the first workers have entered
             their loops, while each worker has a live process; 503 while
             starting, while a dead worker awaits its restart, and from the
             moment a stop begins (a readiness probe: send me traffic only if 200)
  /metrics   Prometheus text: every worker's counters (live and retired), restarts, reloads

``check(url)`` is the other end — what ``orisha health URL`` and the container's
``--health`` run (a FROM-scratch image has no curl): one GET with a short
timeout, a 2xx or a one-line reason. It needs only ``socket``, so the frozen
container executable carries nothing more for it.

The paths are named here once; the Kubernetes manifests and the Dockerfile's
HEALTHCHECK are checked against them (tests/test_deploy.py).
"""

from __future__ import annotations

import socket
from typing import Callable, NamedTuple
from urllib.parse import urlsplit

from ..core.policy import ERROR_STATUSES, STATS_SLOTS, Stat

HEALTH_PATH = "/healthz"
READY_PATH = "/readyz"
METRICS_PATH = "/metrics"
CHECK_TIMEOUT = 3.0  # seconds a probe may take (connect, then the status line)
# How long the supervisor waits for one admin request: it must not stall on a slow client.
REQUEST_TIMEOUT = 0.5


class Status(NamedTuple):
    """What the supervisor knows when a request arrives."""
    ready: bool
    why: str  # when not ready: "starting", "stopping", "no worker"
    # worker index → counters (``Stat`` slots), live + retired; with several sites, each
    # site's request counters follow, in ``sites`` order (``App.site_stats``)
    per_worker: dict[int, list[int]]
    restarts: int
    reloads: int
    draining: int  # generations still finishing their responses
    sites: tuple = ()  # several sites: (host names, build summary) of each, in --site order
    # More (name, type, help, value) series: the ACME manager's (orisha/serving/acme.py), certificate
    # file reloads.
    extra: tuple = ()


# (slot, metric name, type, help) of the per-worker counters, addressed by ``Stat``.
_COUNTERS = ((Stat.REQUESTS, "requests_total", "counter", "Requests answered."),
             (Stat.RESPONSE_BYTES, "response_body_bytes_total", "counter",
              "Response body bytes queued for sending."),
             (Stat.CONNECTIONS, "connections_total", "counter", "Connections accepted."),
             (Stat.OPEN_CONNECTIONS, "open_connections", "gauge", "Connections open now."))


# What a request is counted by: with several sites, these series name the site.
_PER_SITE = (Stat.REQUESTS, Stat.RESPONSE_BYTES)


def exposition(s: Status) -> bytes:
    """Prometheus text exposition (format 0.0.4) of a ``Status``."""
    out = []
    per = sorted(s.per_worker.items())
    for slot, name, kind, doc in _COUNTERS:
        out.append(f"# HELP orisha_{name} {doc}\n# TYPE orisha_{name} {kind}")
        for i, v in per:
            out += _series(f"orisha_{name}", f'worker="{i}"', v, slot,
                           s.sites if slot in _PER_SITE else ())
    out.append("# HELP orisha_errors_total Error responses by status.\n"
               "# TYPE orisha_errors_total counter")
    for i, v in per:
        for status in ERROR_STATUSES:
            out += _series("orisha_errors_total", f'worker="{i}",status="{status}"', v,
                           Stat.ERROR[status], s.sites)
    if s.sites:
        out.append("# HELP orisha_site_info A site this server answers for (--site): its "
                   "first host, every host, the build it serves.\n# TYPE orisha_site_info gauge")
        out += [f'orisha_site_info{{site="{_label(names[0])}",hosts="{_label(",".join(names))}",'
                f'build="{_label(summary)}"}} 1' for names, summary in s.sites]
    for name, kind, doc, value in (
            ("worker_restarts_total", "counter", "Workers restarted after dying.", s.restarts),
            ("reloads_total", "counter", "Builds reloaded (SIGHUP).", s.reloads),
            ("draining_generations", "gauge",
             "Older generations of workers still finishing their responses.", s.draining),
            ("ready", "gauge", "1 when /readyz answers 200.", int(s.ready)), *s.extra):
        out.append(f"# HELP orisha_{name} {doc}\n# TYPE orisha_{name} {kind}\n"
                   f"orisha_{name} {value}")
    return ("\n".join(out) + "\n").encode()


def _series(name: str, labels: str, v: list[int], slot: int, sites) -> list[str]:
    """One worker's series of a counter: one, or with several sites one per site (its
    first host as ``site``), and then the worker's own where it counted requests no site
    answered (the plain port's redirects to https)."""
    if not sites:
        return [f"{name}{{{labels}}} {v[slot]}"]
    out = [f'{name}{{{labels},site="{_label(names[0])}"}} {v[(k + 1) * STATS_SLOTS + slot]}'
           for k, (names, _) in enumerate(sites)]
    return out + [f"{name}{{{labels}}} {v[slot]}"] if v[slot] else out


def _label(value: str) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _response(path: bytes, status: Callable[[], Status]) -> tuple[bytes, bytes]:
    """(status line, body) for one admin path."""
    if path == HEALTH_PATH.encode():
        return b"200 OK", b"ok\n"
    if path == READY_PATH.encode():
        s = status()
        return (b"200 OK", b"ready\n") if s.ready else (b"503 Service Unavailable",
                                                          s.why.encode() + b"\n")
    if path == METRICS_PATH.encode():
        return b"200 OK", exposition(status())
    return b"404 Not Found", b"not found\n"


def answer(sock: socket.socket, status: Callable[[], Status]) -> None:
    """Answer one request waiting on the admin listener. Never blocks long."""
    try:
        conn, _ = sock.accept()
    except OSError:  # EAGAIN (another wake-up took it) or the client gave up while queued
        return
    with conn:
        conn.settimeout(REQUEST_TIMEOUT)
        try:
            line = conn.recv(4096).split(b"\r\n", 1)[0].split(b" ")
            method, path = (line[0], line[1].split(b"?", 1)[0]) if len(line) == 3 else (b"", b"")
            if method in (b"GET", b"HEAD"):
                head, body = _response(path, status)
            else:
                head, body = b"405 Method Not Allowed", b"GET or HEAD\n"
            conn.sendall(b"HTTP/1.1 %s\r\nContent-Type: text/plain; version=0.0.4\r\n"
                         b"Content-Length: %d\r\nCache-Control: no-store\r\n"
                         b"Connection: close\r\n\r\n%s"
                         % (head, len(body), body if method != b"HEAD" else b""))
        except OSError:  # timeout or reset: the supervisor moves on
            pass


def check(url: str, timeout: float = CHECK_TIMEOUT) -> tuple[bool, str]:
    """GET ``url`` (http:// only): (True, status line) on a 2xx, else (False, one-line reason)."""
    parts = urlsplit(url)
    try:
        port = parts.port or 80
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None:
        return False, f"{url}: not an http://HOST[:PORT]/PATH URL"
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = parts.hostname
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(f"GET {target} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                      "Connection: close\r\n\r\n".encode("latin-1"))
            data = b""
            while b"\r\n" not in data and len(data) < 1024:
                chunk = s.recv(1024)
                if not chunk:
                    break
                data += chunk
    except socket.timeout:
        return False, f"{url}: no answer within {timeout:g} s"
    except OSError as e:  # refused, unreachable, reset: say which
        return False, f"{url}: {e.strerror or e}"
    line = data.split(b"\r\n", 1)[0].decode("latin-1")
    fields = line.split(" ", 2)
    if len(fields) < 2 or not fields[0].startswith("HTTP/") or not fields[1].isdigit():
        return False, f"{url}: not an HTTP answer ({line[:60]!r})"
    return fields[1].startswith("2"), f"{url}: {' '.join(fields[1:])}"
