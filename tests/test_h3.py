"""HTTP/3 over QUIC on every hosted loop: the same answers as HTTP/1.1, the build's QPACK
bytes on the wire, Alt-Svc, --no-http3, random datagrams.

Servers run ``orisha serve --tls-cert --tls-key`` (HTTP/3 on by default on the same port
number over UDP); the client is aioquic's own (``aioquic.asyncio.client.connect`` and
``H3Connection``) over real loopback UDP, with the test CA of tests/tlsutil.py. Test ids
carry the loop name.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import pytest
from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TEST_LIMITS
from test_h2 import CASES as H2_CASES
from httpraw import Conn
from tlsutil import client_context, pki, serve, tls_connect  # noqa: F401  (pki: a fixture)

# HTTP/3 is the compiled module over ngtcp2 (compiled_h3) on every loop body; a pure-Python
# server has none (test_a_pure_server_serves_no_http3_and_says_so).
HOSTED = ["epoll", "io-uring", "kqueue", "asyncio"]
_servers: dict = {}


class _Recorder(H3Connection):
    """aioquic's H3Connection, keeping every raw field section it decodes. Its client checks
    a response's Content-Length against its DATA even for HEAD, whose Content-Length is the
    GET's (RFC 9110 §9.3.2): streams in ``heads`` are not checked."""

    def __init__(self, quic) -> None:
        super().__init__(quic)
        self.sections: dict[int, list[bytes]] = {}
        self.heads: set[int] = set()

    def _check_content_length(self, stream) -> None:
        if stream.stream_id not in self.heads:
            super()._check_content_length(stream)

    def _decode_headers(self, stream_id, frame_data):
        if frame_data is not None:
            self.sections.setdefault(stream_id, []).append(bytes(frame_data))
        return super()._decode_headers(stream_id, frame_data)


class _Client(QuicConnectionProtocol):
    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.h3 = _Recorder(self._quic)
        self.waiting: dict[int, asyncio.Future] = {}
        self.got: dict[int, list] = {}
        self.interim: dict[int, list] = {}  # stream → its 1xx responses (h3_get)
        self.order: list[int] = []          # the streams of request(), in call order
        self.closed = asyncio.get_running_loop().create_future()

    def quic_event_received(self, event) -> None:
        if isinstance(event, ConnectionTerminated) and not self.closed.done():
            self.closed.set_result(event)
        for e in self.h3.handle_event(event):
            r = self.got.get(e.stream_id)
            if r is None:
                continue
            if isinstance(e, HeadersReceived) and _interim(e.headers):
                self.interim.setdefault(e.stream_id, []).append(dict(e.headers))
            elif isinstance(e, HeadersReceived):
                r[0].extend(e.headers)
            elif isinstance(e, DataReceived):
                r[1] += e.data
            if getattr(e, "stream_ended", False) and not self.waiting[e.stream_id].done():
                self.waiting[e.stream_id].set_result(None)

    async def request(self, path: str, method: str = "GET", headers=(),
                      authority: str = "localhost") -> tuple:
        """(status, {name: value}, body, raw field section) of one request's final
        response; its interim ones (a 103) are kept in ``interim``."""
        sid = self._quic.get_next_available_stream_id()
        self.order.append(sid)
        self.got[sid] = [[], bytearray()]
        self.waiting[sid] = asyncio.get_running_loop().create_future()
        if method == "HEAD":
            self.h3.heads.add(sid)
        self.h3.send_headers(sid, [(b":method", method.encode()), (b":scheme", b"https"),
                                   (b":authority", authority.encode()), (b":path", path.encode()),
                                   *[(k.lower().encode(), v.encode()) for k, v in headers]],
                             end_stream=True)
        self.transmit()
        await asyncio.wait_for(self.waiting[sid], 20)
        fields, body = self.got.pop(sid)
        d = {}
        for k, v in fields:
            d[k.decode()] = v.decode()
        return int(d.pop(":status")), d, bytes(body), self.h3.sections[sid][-1]


def _interim(headers) -> bool:
    return any(k == b":status" and v[:1] == b"1" for k, v in headers)


def h3_get(port: int, ca: str, requests: list, interim: list | None = None,
           host: str = "127.0.0.1") -> list:
    """Every (path, method, headers) of ``requests`` on one connection to ``host``,
    concurrently. With ``interim``, a list: each request's (interim responses' fields, every
    raw field section of its stream in order) is appended to it, in request order."""
    async def run():
        config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name="localhost")
        config.load_verify_locations(ca)
        async with connect(host, port, configuration=config, create_protocol=_Client,
                           wait_connected=True) as client:
            got = await asyncio.gather(*(client.request(*r) for r in requests))
            if interim is not None:
                interim.extend((client.interim.get(sid, []), client.h3.sections[sid])
                               for sid in client.order)
            return got
    return asyncio.run(asyncio.wait_for(run(), 60))


@pytest.fixture(scope="module", params=HOSTED)
def hosted(request):
    return request.param


def compiled_h3_answers(s) -> None:
    """HTTP/3 is the compiled module over ngtcp2, mapped in a worker of ``s``; bounded wait
    for the workers to import it."""
    from conftest import orisha_modules
    deadline = time.monotonic() + 10
    while not any("compiled_h3" in m for m in orisha_modules(s.proc.pid)):
        assert time.monotonic() < deadline, "no worker mapped orisha.protocols.compiled_h3"
        time.sleep(0.05)


def h3_server(builds, loop: str, pki, *extra: str):
    key = (loop, extra)
    if key not in _servers:
        _servers[key] = serve(builds["notfound"], "--loop", loop, "--workers", "2", *TEST_LIMITS,
                              "--tls-cert", pki.chain, "--tls-key", pki.key, *extra)
        compiled_h3_answers(_servers[key])
    return _servers[key]


@pytest.fixture(scope="module", autouse=True)
def _stop_h3_servers():
    yield
    for s in _servers.values():
        s.stop()
    _servers.clear()


@pytest.fixture
def engine():
    """The HTTP/3 endpoint's module, for the cases that drive one in memory."""
    from orisha.protocols import compiled_h3
    return compiled_h3


# test_h2.py's comparison over h3 (every answer equal to HTTP/1.1's), and one more range
CASES = H2_CASES + [("HEAD", "/files/big.txt", {"range": "bytes=0-0"})]


def http11(port: int, pki, method: str, path: str, headers: dict):
    """One HTTP/1.1 request over TLS on the same server: (status, headers, body)."""
    c = Conn.__new__(Conn)
    c.sock, c.buf = tls_connect(port, client_context(pki, ("http/1.1",))), b""
    try:
        r = c.request(path, method=method, headers={"Host": "localhost", **headers})
        return r.status, dict(r.headers), r.body
    finally:
        c.close()


def test_h3_answers_equal_http11_on_every_loop(builds, hosted, pki):
    s = h3_server(builds, hosted, pki)
    etag = http11(s.port, pki, "GET", "/", {})[1]["etag"]
    cases = CASES + [("GET", "/", {"if-none-match": etag}),
                     ("GET", "/", {"if-modified-since": "Fri, 01 Jan 2100 00:00:00 GMT"})]
    got = h3_get(s.port, pki.ca, [(p, m, list(h.items())) for m, p, h in cases])
    statuses = []
    for (method, path, headers), (status, fields, body, _) in zip(cases, got):
        want_status, want, want_body = http11(s.port, pki, method, path, headers)
        assert want.pop("alt-svc") == f'h3=":{s.port}"; ma=86400'
        for h in ("date", "connection"):
            want.pop(h, None)
        assert "date" in fields and "connection" not in fields and "alt-svc" not in fields
        fields.pop("date")
        assert (status, fields, body) == (want_status, want, want_body), (method, path, headers)
        statuses.append(status)
    assert {200, 206, 301, 304, 404, 405, 406, 416} <= set(statuses), statuses


def test_many_streams_on_one_connection(builds, hosted, pki):
    from conftest import demo_file
    s = h3_server(builds, hosted, pki)
    paths = ["/", "/css/site.css", "/nope", "/docs/", "/img/pixel.png"] * 20
    paths[3] = "/files/big.txt"  # 1.2 MB among them: flow control and the fed stream
    got = h3_get(s.port, pki.ca, [(p, "GET", ()) for p in paths])
    assert [g[0] for g in got] == [200, 200, 404, 200, 200] * 20
    assert got[3][2] == demo_file("files/big.txt")
    assert got[8][2] == demo_file("docs/index.html")


@pytest.mark.parametrize("loop", ["epoll"])
def test_the_field_section_on_the_wire_is_the_builds(builds, pki, loop):
    """What a client decodes is the build's Variant.h3 (or h3_304) + one Date literal."""
    from orisha.protocols.qpack_blocks import date_field
    from orisha.serving.server import load_site
    site = load_site(builds["notfound"])
    s = h3_server(builds, loop, pki)
    css = site.routes[b"/css/site.css"]
    br = next(v for v in css.variants if v.coding == b"br")
    got = h3_get(s.port, pki.ca, [("/css/site.css", "GET", [("accept-encoding", "br")]),
                                 ("/css/site.css", "GET", [("accept-encoding", "br"),
                                                           ("if-none-match", br.etag.decode())]),
                                 ("/", "GET", ())])
    built = [br.h3, br.h3_304, site.routes[b"/"].identity.h3]
    assert all(built)
    for (_, fields, _, section), want in zip(got, built):
        assert section == want + date_field(fields["date"].encode())


def _hint_cases(site) -> tuple[list, list]:
    """(requests, the 103 section each must get first, b"" for none): the demo's pages with
    hints (its index, in identity and br, and its HEAD) and without (a stylesheet, an image,
    the not-found page, a 304 of the index)."""
    from orisha.protocols.qpack_blocks import early_section
    index = site.routes[b"/"]
    br = next(v for v in index.variants if v.coding == b"br")
    cases = [(("/", "GET", ()), index.identity.head), (("/", "GET", [("accept-encoding", "br")]), br.head),
             (("/", "HEAD", ()), index.identity.head),
             (("/css/site.css", "GET", ()), None), (("/img/pixel.png", "GET", ()), None),
             (("/nope", "GET", ()), None),
             (("/", "GET", [("if-none-match", index.identity.etag.decode())]), None)]
    return [r for r, _ in cases], [early_section(h) if h else b"" for _, h in cases]


@pytest.mark.parametrize("loop", ["epoll"])
def test_a_page_with_early_hints_gets_a_103_before_its_200(builds, pki, loop):
    """RFC 8297 over HTTP/3: the demo's index (its stylesheet is a hint) is answered with a
    103 whose Link is the preload values of its 200, as the first field section of the
    stream — the bytes qpack_blocks.early_section made when the site was taken — then the
    200; a stylesheet, an image, the 404 page and a 304 get no 103."""
    from orisha.serving.server import load_site
    site = load_site(builds["notfound"])
    requests, want = _hint_cases(site)
    assert want[0] and not want[-1]
    s = h3_server(builds, loop, pki)
    interim: list = []
    got = h3_get(s.port, pki.ca, requests, interim)
    for req, (status, fields, _, final), (hints, sections), section in zip(requests, got,
                                                                             interim, want):
        assert status in (200, 304, 404), (req, status)
        if not section:
            assert hints == [] and sections == [final], req
            continue
        assert status == 200 and sections == [section, final], (req, sections, section)
        assert hints == [{b":status": b"103", b"link": fields["link"].encode()}], (req, hints)
        assert "rel=preload" in fields["link"] and "/css/site.css" in fields["link"]


def test_no_early_hints_builds_send_no_103_over_h3(pki, tmp_path):
    from conftest import DEMO, orisha
    out = str(tmp_path / "plain")
    r = orisha("build", DEMO, "-o", out, "--not-found", "404.html", "--no-early-hints")
    assert r.returncode == 0, r.stderr
    s = serve(out, "--loop", "epoll", "--workers", "1", *TEST_LIMITS,
              "--tls-cert", pki.chain, "--tls-key", pki.key)
    try:
        interim: list = []
        got = h3_get(s.port, pki.ca, [("/", "GET", ()), ("/", "HEAD", ())], interim)
    finally:
        s.stop()
    assert [g[0] for g in got] == [200, 200] and "link" not in got[0][1]
    assert [(h, len(sections)) for h, sections in interim] == [([], 1), ([], 1)]


def test_headers_frames_are_aioquics():
    """qpack_blocks.headers_frame (the 103s' HEADERS frames) frames as aioquic does, at every
    length of QUIC's variable-length integer."""
    from aioquic.h3.connection import FrameType, encode_frame
    from orisha.protocols.qpack_blocks import headers_frame
    for n in (0, 1, 63, 64, 16383, 16384, 70_000):
        assert headers_frame(b"s" * n) == encode_frame(FrameType.HEADERS, b"s" * n), n


def test_every_built_section_decodes_to_its_head(builds):
    """site.py's sections (qpack_blocks.section of each head) decode, with pylsqpack, to the
    head's own fields: the static table and literals are right."""
    from pylsqpack import Decoder
    from orisha.protocols.fields import CONNECTION_FIELDS
    from orisha.protocols.hpack_blocks import variants
    from orisha.protocols.qpack_blocks import section
    from orisha.serving.server import load_site
    site = load_site(builds["notfound"])
    d = Decoder(0, 0)
    n = 0
    for v in variants(site):
        for head, built in ((v.head, v.h3), (v.head_304, v.h3_304)):
            assert built == section(head)
            lines = head.split(b"\r\n")
            want = [(b":status", lines[0][9:12])] + [
                (k.strip().lower(), val.strip()) for k, _, val in
                (line.partition(b":") for line in lines[1:] if line)
                if k.strip().lower() not in CONNECTION_FIELDS]
            assert d.feed_header(n, built)[1] == want
            n += 4
    assert n > 20


def _step(client, ep, client_addr, now: float) -> float:
    """The client's datagrams to ``ep``; when neither side has any to send, the simulated
    clock on to the next timer (ngtcp2 paces and delays ACKs), which fires. The clock."""
    up = [(d, client_addr) for d, _ in client.datagrams_to_send(now)]
    ep.receive(up, now)
    if not up and not ep.outgoing:
        now = min(t for t in (client.get_timer(), ep.timer, now + 1) if t is not None)
        if client.get_timer() is not None and now >= client.get_timer():
            client.handle_timer(now)
        if ep.timer is not None and now >= ep.timer:
            ep.expire(now)
    return now


def _deliver(ep, client, server_addr, now: float) -> None:
    """What ``ep`` has queued, each GSO group cut into its datagrams, to aioquic's ``client``."""
    for payload, _, seg in ep.outgoing:
        for i in range(0, len(payload), seg or len(payload)):
            client.receive_datagram(payload[i:i + (seg or len(payload))], server_addr, now)
    ep.sent(len(ep.outgoing), now)


def _statuses(ep, pki, paths: list, now: float, wave: int = 50) -> tuple[dict, float]:
    """aioquic's client against ``ep`` in memory, one connection from ``now`` on a simulated
    clock: GET each of ``paths`` (bytes), ``wave`` streams at a time; ({path: final status, or
    "reset" for a stream the server reset}, the clock's time at the end). A path that starts
    with ``/bad`` is sent with a field name in capitals (malformed: RFC 9114 §4.2)."""
    from aioquic.quic.connection import QuicConnection
    from aioquic.quic.events import StreamReset
    config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name="localhost")
    config.load_verify_locations(pki.ca)
    client = QuicConnection(configuration=config)
    ch3 = _Recorder(client)
    server_addr, client_addr = ("127.0.0.1", 4433), ("127.0.0.1", 5555)
    client.connect(server_addr, now)
    pending, running, statuses, ready = list(paths), {}, {}, False
    for _ in range(20 * len(paths) + 100):
        now = _step(client, ep, client_addr, now)
        _deliver(ep, client, server_addr, now)
        event = client.next_event()
        while event is not None:
            ready = ready or event.__class__.__name__ == "HandshakeCompleted"
            if isinstance(event, StreamReset):
                statuses[running.pop(event.stream_id)] = "reset"
            for e in ch3.handle_event(event):
                if isinstance(e, HeadersReceived) and not _interim(e.headers):
                    statuses[running[e.stream_id]] = int(dict(e.headers)[b":status"])
                if getattr(e, "stream_ended", False):
                    del running[e.stream_id]
            event = client.next_event()
        if ready and not running:
            if not pending:
                return statuses, now
            for path in pending[:wave]:
                sid = client.get_next_available_stream_id()
                running[sid] = path
                bad = [(b"X-Bad", b"1")] if path.startswith(b"/bad") else []
                ch3.send_headers(sid, [(b":method", b"GET"), (b":scheme", b"https"),
                                       (b":authority", b"localhost"), (b":path", path)] + bad, True)
            del pending[:wave]
    raise AssertionError(f"{len(statuses)} of {len(paths)} answered")


def test_the_memo_of_request_sections_is_bounded_and_answers_as_decoding_does(builds, pki):
    """The ngtcp2 endpoint answers a request section it has seen from its memo (no dynamic
    table: the same bytes are the same fields), a malformed one too (the stream reset again,
    never answered), and keeps at most ``MEMO_MAX`` sections, however many distinct ones
    come."""
    from orisha.core.connection import App
    from orisha.protocols import compiled_h3
    from orisha.serving.server import load_site
    ep = compiled_h3.Endpoint(App(load_site(builds["notfound"])),
                              compiled_h3.configuration(pki.chain, pki.key, 15))
    paths = [b"/?%d" % i for i in range(compiled_h3.MEMO_MAX + 200)]
    paths += [b"/", b"/nope", b"/bad", b"/"]
    got, now = _statuses(ep, pki, paths, time.time())
    assert [got[p] for p in paths] == [200] * (len(paths) - 4) + [200, 404, "reset", 200]
    assert 0 < len(ep.heads) <= compiled_h3.MEMO_MAX
    again, _ = _statuses(ep, pki, [b"/nope", b"/bad", b"/", b"/?5"], now)  # memoised
    assert again == {b"/nope": 404, b"/bad": "reset", b"/": 200, b"/?5": 200}


def test_a_section_changed_in_the_loaded_site_is_what_goes_out(builds, pki, engine):
    """Nothing re-encodes a built section: the Endpoint, driven in memory by aioquic's own
    client connection, sends the bytes a loaded site carries."""
    from orisha.core.connection import App
    from orisha.protocols.qpack_blocks import field
    from orisha.serving.server import load_site
    site = load_site(builds["notfound"])
    v = site.routes[b"/"].identity
    v.h3 += field(b"x-section", b"from-the-build")
    ep = engine.Endpoint(App(site), engine.configuration(pki.chain, pki.key, 15))
    headers, sections, _ = _in_memory(ep, pki)
    assert headers[b"x-section"] == b"from-the-build"
    assert sections[-1].startswith(v.h3)


def _in_memory(ep, pki, path: bytes = b"/"):
    """aioquic's client connection against ``ep`` with datagrams moved in memory: one GET;
    (the response's fields, its raw sections, every datagram the endpoint sent)."""
    from aioquic.quic.connection import QuicConnection
    config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name="localhost")
    config.load_verify_locations(pki.ca)
    client = QuicConnection(configuration=config)
    ch3 = _Recorder(client)
    now = time.time()
    server_addr, client_addr = ("127.0.0.1", 4433), ("127.0.0.1", 5555)
    client.connect(server_addr, now)
    sid, done, sent = None, [], []
    for _ in range(50):
        now = _step(client, ep, client_addr, now)
        for payload, _, seg in ep.outgoing:
            for i in range(0, len(payload), seg or len(payload)):
                sent.append(payload[i:i + (seg or len(payload))])
                client.receive_datagram(sent[-1], server_addr, now)
        ep.sent(len(ep.outgoing), now)
        event = client.next_event()
        while event is not None:
            if event.__class__.__name__ == "HandshakeCompleted" and sid is None:
                sid = client.get_next_available_stream_id()
                ch3.send_headers(sid, [(b":method", b"GET"), (b":scheme", b"https"),
                                       (b":authority", b"localhost"), (b":path", path)], True)
            for e in ch3.handle_event(event):
                if isinstance(e, HeadersReceived) and not _interim(e.headers):
                    done.append(dict(e.headers))
            event = client.next_event()
        if done:
            # the client's ACKs of the endpoint's last packets (its HANDSHAKE_DONE among
            # them), due after its maximum ACK delay (25 ms: RFC 9000 §13.2.1)
            at = now + 0.026
            ep.receive([(d, client_addr) for d, _ in client.datagrams_to_send(at)], at)
            ep.sent(len(ep.outgoing), at)  # what it answers is not this test's
            return done[0], ch3.sections[sid], sent
    raise AssertionError("no response")


def _lossy(builds, pki, engine, seed: int, shutdown: bool = False) -> tuple[dict, list]:
    """The many-streams page (100 streams, a 1.2 MB one among them) over a path losing
    25 % of the server's datagrams and 10 % of the client's, in memory on a simulated
    clock. With ``shutdown``, the endpoint is told to stop (GOAWAY on every connection,
    each closed once drained: a reload's old generation) as soon as the large body's
    first bytes arrive; once every response is whole, the server's datagrams are no
    longer lost (its CONNECTION_CLOSE is sent once, and a client with nothing more to
    send would wait for its idle timeout). Returns every stream's [path, body, ended]
    and the client's
    ConnectionTerminated events; a stream the server reset (a request that reached it after
    its GOAWAY) ends with its error code as the body."""
    import random
    from aioquic.quic.events import StreamReset
    from aioquic.quic.connection import QuicConnection
    from orisha.core.connection import App
    from orisha.serving.server import load_site
    rng = random.Random(seed)
    ep = engine.Endpoint(App(load_site(builds["notfound"])),
                         engine.configuration(pki.chain, pki.key, 3))
    config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name="localhost")
    config.load_verify_locations(pki.ca)
    client = QuicConnection(configuration=config)
    ch3 = _Recorder(client)
    now = tick = 1000.0
    server_addr, client_addr = ("127.0.0.1", 4433), ("127.0.0.1", 5555)
    client.connect(server_addr, now)
    paths = ["/", "/css/site.css", "/nope", "/docs/", "/img/pixel.png"] * 20
    paths[3] = "/files/big.txt"
    got: dict[int, list] = {}  # stream → [path, body, ended]
    ended: list = []
    while now < 1060 and not ended:  # simulated seconds: the client's idle timeout ends a stall sooner
        up = [d for d, _ in client.datagrams_to_send(now) if rng.random() >= 0.10]
        if up:
            ep.receive([(d, client_addr) for d in up], now)
        down = [payload[i:i + (seg or len(payload))] for payload, _, seg in ep.outgoing
                for i in range(0, len(payload), seg or len(payload))]
        ep.sent(len(ep.outgoing), now)
        whole = got and all(done for _, _, done in got.values())
        for d in down:  # once every response is whole, the server's close is not lost
            if rng.random() >= 0.25 or whole:
                client.receive_datagram(d, server_addr, now)
        event = client.next_event()
        while event is not None:
            if event.__class__.__name__ == "HandshakeCompleted" and not got:
                for path in paths:
                    sid = client.get_next_available_stream_id()
                    got[sid] = [path, bytearray(), False]
                    ch3.send_headers(sid, [(b":method", b"GET"), (b":scheme", b"https"),
                                           (b":authority", b"localhost"),
                                           (b":path", path.encode())], True)
            if isinstance(event, ConnectionTerminated):
                ended.append(event)
            if isinstance(event, StreamReset):
                got[event.stream_id][1:] = [event.error_code, True]
            for e in ch3.handle_event(event):
                if isinstance(e, DataReceived):
                    got[e.stream_id][1] += e.data
                    if shutdown and not ep.stopping and got[e.stream_id][0] == "/files/big.txt":
                        ep.shutdown(now)
                if getattr(e, "stream_ended", False):
                    got[e.stream_id][2] = True
            event = client.next_event()
        if got and all(done for _, _, done in got.values()) and (ended or not shutdown):
            break
        if up or down:
            continue
        timers = [t for t in (client.get_timer(), ep.timer) if t is not None]
        now = max(min(timers + [tick + 1.0]), now) + 1e-6  # on to the next timer
        if client.get_timer() is not None and now >= client.get_timer():
            client.handle_timer(now)
        if ep.timer is not None and now >= ep.timer:
            ep.expire(now)
        if now >= tick + 1.0:
            ep.tick(now)
            tick = now
    return got, ended


@pytest.mark.parametrize("seed", range(10))
def test_a_lossy_path_delivers_every_stream(builds, pki, engine, seed):
    """100 streams with a 1.2 MB one over a lossy path (``_lossy``): every response
    arrives whole."""
    from conftest import demo_file
    got, ended = _lossy(builds, pki, engine, seed)
    assert ended == []
    assert [p for p, _, done in got.values() if not done] == []
    big = next(body for path, body, _ in got.values() if path == "/files/big.txt")
    assert big == demo_file("files/big.txt")


@pytest.mark.parametrize("seed", range(20))
def test_a_goaway_under_loss_closes_only_once_every_response_is_delivered(builds, pki, engine,
                                                                           seed):
    """The same page and path, the endpoint told to stop once the large body has begun
    (a reload): every response still arrives whole, and only then does the connection
    close, with H3_NO_ERROR (RFC 9114 §5.2)."""
    from aioquic.h3.connection import ErrorCode
    from conftest import demo_file
    got, ended = _lossy(builds, pki, engine, seed, shutdown=True)
    assert [p for p, _, done in got.values() if not done] == [], ended
    # A request that reached the server after its GOAWAY is refused, to be made again.
    assert {b for _, b, _ in got.values() if isinstance(b, int)} <= {ErrorCode.H3_REQUEST_REJECTED}
    big = next(body for path, body, _ in got.values() if path == "/files/big.txt")
    assert big == demo_file("files/big.txt")
    assert [e.error_code for e in ended] == [ErrorCode.H3_NO_ERROR], ended


def test_a_new_connection_id_names_its_worker_with_no_table(builds, pki, tmp_path):
    """Every connection ID a worker issues — the first, and each in a NEW_CONNECTION_ID — names
    that worker by its tag alone: after the client moves to a spare ID (RFC 9000 §5.1.2), a
    datagram of it read by another worker's endpoint is handed to the owner (``forward``,
    from the ID and the server's key only: no table is shared between the two), and the
    owner answers it."""
    from aioquic.quic.connection import QuicConnection
    from orisha.core.connection import App
    from orisha.protocols import compiled_h3
    from orisha.loops.udp import handover_socket
    from orisha.protocols.quic_steer import Steer
    from orisha.serving.server import load_site
    site, key, length = load_site(builds["notfound"]), os.urandom(16), 8  # compiled_h3's CID_LEN
    eps = []
    for index in range(2):
        ep = compiled_h3.Endpoint(App(site), compiled_h3.configuration(pki.chain, pki.key, 15))
        ep.steer_with(Steer(str(tmp_path), key, 1, index))
        eps.append(ep)
    owner, other = eps
    config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name="localhost")
    config.load_verify_locations(pki.ca)
    client = QuicConnection(configuration=config)
    server_addr, client_addr, now = ("127.0.0.1", 4433), ("127.0.0.1", 5555), time.time()
    client.connect(server_addr, now)
    hello = [d for d, _ in client.datagrams_to_send(now)]
    owner.receive([(d, client_addr) for d in hello], now)
    chosen = hello[0][6:6 + hello[0][5]]  # the client's first destination ID: not ours
    ours: set = set()
    settled = 0
    for _ in range(50):  # the handshake, then the spare IDs the owner sends, acknowledged
        now = _step(client, owner, client_addr, now)
        _deliver(owner, client, server_addr, now)
        event = client.next_event()
        while event is not None:
            settled = settled or event.__class__.__name__ == "HandshakeCompleted"
            event = client.next_event()
        ours = {c for conn in owner.live for c in conn.cids if c != chosen}
        if settled and len(ours) >= 3:
            settled += 1
            if settled > 5:
                break
    assert len(ours) >= 3, ours  # the first ID and two NEW_CONNECTION_IDs at least
    assert {other.steer.owner(c) for c in ours} == {owner.steer.tag}
    client.change_connection_id()  # to a spare ID: the next packets carry it
    client.send_ping(7)
    moved = [d for d, _ in client.datagrams_to_send(now)]
    assert moved and all(not d[0] & 0x80 and d[1:1 + length] in ours for d in moved)
    bound = handover_socket(owner.steer)  # as the owner's pump does: it lives
    try:
        other.receive([(d, client_addr) for d in moved], now)
    finally:
        bound.close()
    assert [(tag, d) for tag, d, _ in other.forward] == [(owner.steer.tag, d) for d in moved]
    assert not other.live and other.strays == 0
    owner.receive([(d, client_addr) for d in moved], now, True)  # as the pump hands them over
    assert owner.outgoing  # its acknowledgment of the PING


def test_under_a_flood_of_handshakes_new_clients_get_a_retry(builds, pki, engine):
    """Past ``retry_above`` handshakes in progress the first answer is a Retry (stateless:
    no connection is made for it); the client's second Initial carries the token, and the
    connection then completes with the validated original connection ID."""
    from aioquic.buffer import Buffer
    from aioquic.quic.packet import QuicPacketType, pull_quic_header
    from orisha.core.connection import App
    from orisha.serving.server import load_site
    ep = engine.Endpoint(App(load_site(builds["notfound"])),
                         engine.configuration(pki.chain, pki.key, 15))
    headers, _, sent = _in_memory(ep, pki)
    assert headers[b":status"] == b"200"
    first = pull_quic_header(Buffer(data=sent[0]), host_cid_length=8)
    assert first.packet_type != QuicPacketType.RETRY  # not under load: no Retry
    ep.retry_above = 0  # as if a flood of Initials were in progress
    before = len(ep.live)
    headers, _, sent = _in_memory(ep, pki)
    assert headers[b":status"] == b"200"
    assert pull_quic_header(Buffer(data=sent[0]), host_cid_length=8).packet_type == \
        QuicPacketType.RETRY
    assert len(ep.live) == before + 1  # the Retry made no connection; the retried one did


def test_a_pure_server_serves_no_http3_and_says_so(builds, pki):
    """A pure-Python install (here ORISHA_PURE=1: no compiled module runs) serves HTTP/1.1,
    HTTPS and HTTP/2 but not HTTP/3, which needs the compiled module: it says so in one line,
    takes no UDP port and advertises no Alt-Svc."""
    s = serve(builds["notfound"], "--loop", "epoll", "--workers", "1", *TEST_LIMITS,
              "--tls-cert", pki.chain, "--tls-key", pki.key, env={**os.environ, "ORISHA_PURE": "1"})
    try:
        status, fields, _ = http11(s.port, pki, "GET", "/", {})
        assert status == 200 and "alt-svc" not in fields, fields
        assert "HTTP/3" not in s.line, s.line
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.bind(("127.0.0.1", s.port))  # free: no worker holds the UDP port
    finally:
        assert s.stop() == 0
    said = [ln for ln in s.proc.stderr.read().splitlines() if "HTTP/3" in ln]
    assert len(said) == 1 and said[0].startswith("orisha: HTTP/3 off: it needs the compiled "
                                                 "module orisha.protocols.compiled_h3"), said


def test_alt_svc_on_tls_responses_over_h1_and_h2(builds, pki):
    from h2util import H2Client
    s = h3_server(builds, "epoll", pki)
    want = f'h3=":{s.port}"; ma=86400'
    assert http11(s.port, pki, "GET", "/", {})[1]["alt-svc"] == want
    assert http11(s.port, pki, "GET", "/nope", {})[1]["alt-svc"] == want
    client = H2Client(tls_connect(s.port, client_context(pki, ("h2",))))
    try:
        got = client.fetch([("GET", "/", {}), ("GET", "/nope", {})])
    finally:
        client.close()
    assert [r.headers.get("alt-svc") for r in got] == [want, want]


def _udp_port_taken(port: int) -> bool:
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        u.bind(("127.0.0.1", port))
    except OSError:
        return True
    finally:
        u.close()
    return False


def test_no_http3_closes_the_udp_port_and_drops_alt_svc(builds, pki):
    on = h3_server(builds, "epoll", pki)
    assert _udp_port_taken(on.port)
    off = serve(builds["notfound"], "--loop", "epoll", "--workers", "1", *TEST_LIMITS,
                "--tls-cert", pki.chain, "--tls-key", pki.key, "--no-http3")
    try:
        assert not _udp_port_taken(off.port)
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.connect(("127.0.0.1", off.port))
        u.settimeout(5)
        u.send(b"\xc0" + os.urandom(1199))  # an Initial-shaped datagram: port unreachable
        with pytest.raises(ConnectionRefusedError):
            u.recv(2048)
        u.close()
        assert "alt-svc" not in http11(off.port, pki, "GET", "/", {})[1]
    finally:
        off.stop()


_datagram = st.one_of(
    st.binary(max_size=1500),
    st.binary(min_size=1200, max_size=1400).map(lambda b: b"\xc3\x00\x00\x00\x01\x08" + b[6:]),
    st.binary(min_size=20, max_size=200).map(lambda b: b"\x40" + b),  # short header
    st.binary(min_size=1200, max_size=1300).map(lambda b: b"\xc0\x1a\x2a\x3a\x4a" + b[5:]),
)


@pytest.mark.parametrize("loop", ["epoll"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(_datagram, min_size=1, max_size=8))
def test_random_datagrams_never_kill_a_worker(builds, pki, loop, batch):
    s = _fuzz_server(builds, pki, loop)
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for d in batch:
            u.sendto(d, ("127.0.0.1", s.port))
    finally:
        u.close()


_fuzz: dict = {}


def _fuzz_server(builds, pki, loop: str):
    if loop not in _fuzz:
        _fuzz[loop] = h3_server(builds, loop, pki, "--admin-port", str(_free_port()))
    return _fuzz[loop]


def _free_port() -> int:
    with socket.socket() as t:
        t.bind(("127.0.0.1", 0))
        return t.getsockname()[1]


@pytest.mark.parametrize("loop", ["epoll"])
def test_after_random_datagrams_the_workers_still_answer_h3(builds, pki, loop):
    """Runs after the property test: no worker was restarted, and h3 still answers."""
    import urllib.request
    s = _fuzz_server(builds, pki, loop)
    args = s.proc.args
    admin = int(args[args.index("--admin-port") + 1])
    for _ in range(4):  # several connections: both workers' sockets get some
        assert h3_get(s.port, pki.ca, [("/", "GET", ())])[0][0] == 200
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10).read()
    assert b"orisha_worker_restarts_total 0" in metrics, metrics


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["epoll"])
def test_chromium_loads_the_demo_site_with_every_response_on_h3(builds, pki, tmp_path, loop):
    """Headless Chromium, told the origin speaks QUIC, loads pages with their stylesheets and
    images: nothing failed, and DevTools reports every response of the origin on h3."""
    from browser import chromium, load_pages
    from tlsutil import trusting_chromium
    assert chromium() is not None, "no Chromium (apt-get install chromium; ./dev test does)"
    s = h3_server(builds, loop, pki)
    origin = f"https://127.0.0.1:{s.port}"
    wrapper = trusting_chromium(pki.cert, tmp_path)
    with open(wrapper) as f:
        script = f.read()
    with open(wrapper, "w") as f:
        f.write(script.replace('"$@"', f'--origin-to-force-quic-on=127.0.0.1:{s.port} "$@"'))
    pages = ["/", "/docs/", "/docs/guide/getting-started"]
    results = load_pages([origin + p for p in pages], timeout=30, executable=wrapper)
    seen = {}
    for r in results:
        assert r.ok, r.problems
        seen.update({u: p for u, p in r.protocols.items() if u.startswith(origin)})
    assert len(seen) > len(pages), seen  # the pages and their assets
    assert set(seen.values()) == {"h3"}, seen


def test_graceful_stop_closes_h3_connections_with_no_error(builds, pki):
    """SIGTERM: an open HTTP/3 connection gets GOAWAY, then CONNECTION_CLOSE with
    H3_NO_ERROR (0x100) once its responses are delivered; the server exits 0."""
    s = serve(builds["notfound"], "--loop", "epoll", "--workers", "1", *TEST_LIMITS,
              "--tls-cert", pki.chain, "--tls-key", pki.key, "--grace", "5")

    async def run():
        config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name="localhost")
        config.load_verify_locations(pki.ca)
        async with connect("127.0.0.1", s.port, configuration=config, create_protocol=_Client,
                           wait_connected=True) as client:
            assert (await client.request("/"))[0] == 200
            s.proc.send_signal(signal.SIGTERM)
            return await asyncio.wait_for(client.closed, 15)
    try:
        closed = asyncio.run(run())
        assert closed.error_code == 0x100, closed
        assert s.proc.wait(20) == 0
    finally:
        s.stop()


class _Queued:
    """An endpoint that only holds what it queued (the Pump's side of the seam)."""
    busy, timer = False, None

    def __init__(self, out: list) -> None:
        self.outgoing = out

    def sent(self, n: int, now: float) -> None:
        del self.outgoing[:n]


def test_gathered_datagrams_go_out_as_one_gso_send():
    """An endpoint's GSO groups — (payload, address, segment size): runs of one size, each
    ended by at most one shorter datagram (base.py) — go out as one send each with
    UDP_SEGMENT, and the kernel delivers the datagrams apart, in order."""
    from orisha.loops.base import Datagrams
    from orisha.loops.udp import Pump
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.bind(("127.0.0.1", 0))
        rx.settimeout(5)
        tx.setblocking(False)
        to = rx.getsockname()
        sizes = [1200] * 5 + [700, 1200, 1200, 300, 500]  # a shorter one ends each group
        data = [bytes([i]) * n for i, n in enumerate(sizes)]
        ep = _Queued([(b"".join(data[:6]), to, 1200), (b"".join(data[6:9]), to, 1200),
                      (data[9], to, 0)])
        pump = Pump(Datagrams(tx, ep))
        assert pump.gso  # Linux ≥ 4.18
        assert pump.flush(time.time()) and not ep.outgoing
        got = [rx.recv(2048) for _ in sizes]
        assert [(len(d), d[0]) for d in got] == [(n, i) for i, n in enumerate(sizes)]
        assert pump.gso  # the kernel took the GSO sends
    finally:
        rx.close()
        tx.close()


def _children(pid: int) -> list[str]:
    """The pids whose parent is ``pid`` (from /proc: no procps needed)."""
    out = []
    for p in os.listdir("/proc"):
        try:
            with open(f"/proc/{p}/stat") as f:
                if p.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(p)
        except OSError:  # exited while listing, or not a process
            continue
    return out


def replaced(s, pki, victim: int, path: str) -> None:
    """The killed worker ``victim`` of two is replaced (after RESTART_PAUSE if it was young)
    and fresh connections — new source ports, so both UDP sockets — all get ``path``."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        now = [int(p) for p in _children(s.proc.pid)]
        if len(now) == 2 and victim not in now:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the killed worker was not replaced")
    # no wait for the replacement to enter its loop: what reaches its socket meanwhile is
    # queued there until it reads, and a client's Initial is sent again on its own timer
    for _ in range(6):
        assert h3_get(s.port, pki.ca, [(path, "GET", ())])[0][0] == 200


def test_a_killed_worker_comes_back_on_its_udp_socket(builds, pki):
    """kill -9 of a worker: the supervisor restarts it on the same UDP socket, and new
    HTTP/3 connections (the kernel hashes them over both workers' sockets) all succeed."""
    s = serve(builds["notfound"], "--loop", "epoll", "--workers", "2", *TEST_LIMITS,
              "--tls-cert", pki.chain, "--tls-key", pki.key)
    try:
        children = _children(s.proc.pid)
        assert len(children) == 2, children
        os.kill(int(children[0]), signal.SIGKILL)
        replaced(s, pki, int(children[0]), "/")
    finally:
        s.stop()


def test_a_worker_restarted_after_its_certificate_files_changed_serves_its_generations(
        builds, pki, tmp_path):
    """A generation's QUIC certificates are read once, by the supervisor, as TLS's are: the
    key file overwritten with garbage (the supervisor's renewal refuses it and the current
    generation goes on), then its one worker killed, the worker the supervisor starts in its
    place answers HTTP/3 and HTTPS on the certificate the generation was made with. Before,
    each worker loaded the files itself as it started: the replacement failed on the new
    key, exited and was restarted every second, and nothing answered."""
    import shutil
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    shutil.copyfile(pki.chain, cert)
    shutil.copyfile(pki.key, key)
    s = serve(builds["notfound"], "--loop", "epoll", "--workers", "1", *TEST_LIMITS,
              "--tls-cert", cert, "--tls-key", key)
    try:
        (victim,) = [int(p) for p in _children(s.proc.pid)]
        with open(key, "w") as f:
            f.write("not a key\n")
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 15  # the supervisor's restart pause, with slack
        while [int(p) for p in _children(s.proc.pid)] in ([], [victim]):
            assert time.monotonic() < deadline, "the killed worker was not replaced"
            time.sleep(0.05)
        # queued on the sockets until the replacement reads them: no wait for it
        assert h3_get(s.port, pki.ca, [("/", "GET", ())])[0][0] == 200
        assert http11(s.port, pki, "GET", "/", {})[0] == 200
        assert len(_children(s.proc.pid)) == 1
    finally:
        s.stop()
    err = s.proc.stderr.read()
    assert "cannot load them for QUIC" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("loop", ["epoll"])
def test_an_oversized_field_section_gets_431_and_the_connection_goes_on(builds, pki, loop):
    """A request whose head is over --head-limit gets 431 (as HTTP/1.1 and HTTP/2 do); the
    same connection then answers the next request."""
    s = h3_server(builds, loop, pki)
    got = h3_get(s.port, pki.ca, [("/", "GET", [("x-big", "a" * 9000)]), ("/", "GET", ())])
    assert [g[0] for g in got] == [431, 200]


def test_after_a_reload_the_new_generation_serves_h3(builds, pki):
    """SIGHUP: the new generation's workers take the same UDP sockets; once the old one has
    drained, fresh HTTP/3 connections are all answered by it."""
    s = serve(builds["notfound"], "--loop", "epoll", "--workers", "2", *TEST_LIMITS,
              "--tls-cert", pki.chain, "--tls-key", pki.key, "--grace", "2")
    try:
        assert h3_get(s.port, pki.ca, [("/", "GET", ())])[0][0] == 200
        before = set(_children(s.proc.pid))
        s.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the old generation drained and exited
            now = set(_children(s.proc.pid))
            if len(now) == 2 and not now & before:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the old generation did not hand over")
        for _ in range(6):
            assert h3_get(s.port, pki.ca, [("/css/site.css", "GET", ())])[0][0] == 200
    finally:
        s.stop()


def test_hsts_is_on_h3_answers_as_on_http11(builds, pki):
    """--hsts changes the heads at load time; the build's QPACK sections are made anew too."""
    s = h3_server(builds, "epoll", pki, "--hsts", "600")
    for (status, fields, _, _), want in zip(
            h3_get(s.port, pki.ca, [("/", "GET", []), ("/css/site.css", "GET", []),
                                    ("/", "GET", [("if-none-match", "*")])]), (200, 200, 304)):
        assert status == want and fields.get("strict-transport-security") == "max-age=600", fields
    assert http11(s.port, pki, "GET", "/", {})[1]["strict-transport-security"] == "max-age=600"


def _udp_port_whose_tcp_port_is_free() -> socket.socket:
    """A bound reuseport UDP socket whose port number is free over TCP too (an ephemeral
    UDP port says nothing of the TCP port of the same number, which another process of
    the machine may hold)."""
    for _ in range(50):
        quic = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        quic.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        quic.bind(("127.0.0.1", 0))
        with socket.socket() as tcp:
            try:
                tcp.bind(("127.0.0.1", quic.getsockname()[1]))
                return quic
            except OSError:
                quic.close()
    raise AssertionError("no UDP port whose TCP port is free")


def test_a_udp_port_held_by_another_server_is_not_shared(builds, pki):
    """HTTP/3's UDP sockets are claimed like the TCP listeners (orisha/serving/ports.py): a second
    server on a held port exits with one line, the first serving h3 on; and a UDP port held
    alone — another QUIC server's reuseport socket of the same user, here this test's —
    is not joined silently either, although the TCP port is free."""
    from conftest import orisha
    first = h3_server(builds, "epoll", pki)  # the stderr's first line: the kTLS note
    args = ("--workers", "1", "--tls-cert", pki.chain, "--tls-key", pki.key)
    r = orisha("serve", builds["notfound"], "--port", str(first.port), *args, timeout=30)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("orisha: error:")]
    assert r.returncode == 1 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"port {first.port} is already in use by pid {first.proc.pid}" in errors[0]
    assert h3_get(first.port, pki.ca, [("/", "GET", [])])[0][0] == 200
    with _udp_port_whose_tcp_port_is_free() as quic:
        port = quic.getsockname()[1]
        r = orisha("serve", builds["notfound"], "--port", str(port), *args, timeout=30)
        me = open(f"/proc/{os.getpid()}/cmdline").read().replace("\0", " ").strip()[:200]
        assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == (
            f"orisha: error: 127.0.0.1:{port}/udp: port {port}/udp is already in use by pid "
            f"{os.getpid()}: {me} (--no-http3 serves without HTTP/3)"), r.stderr
    assert h3_get(first.port, pki.ca, [("/", "GET", [])])[0][0] == 200
