"""HTTP/3 downloads in flight through reloads: steering by connection ID.

Each worker index's UDP socket is shared by every generation (the draining ones and the
new one read it), so without steering a datagram of an old connection is read, about half
the time, by a new-generation worker that does not know it and drops it. With steering
(orisha/protocols/quic_steer.py) its connection ID names the worker that issued it and the
reader hands it over. Real sockets: ``orisha serve`` and aioquic's client over loopback.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import signal

from aioquic.asyncio.client import connect
from aioquic.h3.connection import H3_ALPN, ErrorCode
from aioquic.quic.configuration import QuicConfiguration

from conftest import TEST_LIMITS, orisha
from test_h3 import _Client
from tlsutil import pki, serve  # noqa: F401  (pki: a fixture)

_SIZE = 1536 * 1024  # incompressible: every variant is the identity one
_STRAYS = re.compile(r"HTTP/3 worker \w+: (\d+) datagrams of connections no worker knew")


def _site(tmp_path) -> tuple[str, bytes]:
    src = tmp_path / "src"
    src.mkdir()
    (src / "index.html").write_text("<!doctype html><title>x</title><p>x")
    body = os.urandom(_SIZE)
    (src / "big.bin").write_bytes(body)
    out = str(tmp_path / "out")
    r = orisha("build", str(src), "-o", out)
    assert r.returncode == 0, r.stderr
    return out, body


async def _downloads(port: int, ca: str, proc, groups: int = 2, per_group: int = 3) -> list:
    """``groups`` rounds of ``per_group`` connections, each downloading big.bin once; a
    SIGHUP as soon as every download of a round has its first bytes (so each round's
    downloads are in flight through the next reload too). Returns, per download, (status,
    body digest, bytes still to come at each SIGHUP, how the connection ended)."""
    config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name="localhost")
    config.load_verify_locations(ca)
    loop = asyncio.get_running_loop()
    results: list = []
    at_sighup: list[list[int]] = []
    clients: list = []

    async def one(started: asyncio.Future) -> None:
        try:
            async with connect("127.0.0.1", port, configuration=config, create_protocol=_Client,
                               wait_connected=True) as client:
                clients.append(client)
                task = asyncio.ensure_future(client.request("/big.bin"))
                await asyncio.sleep(0)  # the request is sent: its stream is known
                sid = client.order[-1]
                while not client.got.get(sid, [0, b""])[1] and not task.done():
                    await asyncio.sleep(0.005)
                started.set_result(None)
                status, _, body, _ = await task
                ended = await asyncio.wait_for(client.closed, 30)  # the draining worker's close
                results.append((status, hashlib.sha256(body).hexdigest(), ended.error_code))
        except BaseException as e:
            if not started.done():  # the round's SIGHUP must not wait for it
                started.set_exception(e)
            raise

    tasks = []
    for _ in range(groups):
        started = [loop.create_future() for _ in range(per_group)]
        tasks += [asyncio.ensure_future(one(f)) for f in started]
        await asyncio.gather(*started)
        at_sighup.append([_SIZE - len(c.got[c.order[-1]][1]) for c in clients
                          if c.order[-1] in c.got])  # downloads not yet complete
        proc.send_signal(signal.SIGHUP)
    await asyncio.gather(*tasks)
    return results, at_sighup


def test_h3_downloads_in_flight_survive_two_reloads(tmp_path, pki):
    """Two SIGHUPs while several 1.5 MB downloads are in flight over h3 (two workers): every
    download completes byte-identical, each connection is then closed by its draining
    worker with H3_NO_ERROR (GOAWAY first), and no worker of any generation dropped a
    datagram of a connection it did not know (the count each worker reports at its stop)."""
    out, body = _site(tmp_path)
    s = serve(out, "--loop", "epoll", "--workers", "2", *TEST_LIMITS,
              "--tls-cert", pki.chain, "--tls-key", pki.key, "--grace", "20")
    try:
        results, at_sighup = asyncio.run(asyncio.wait_for(
            _downloads(s.port, pki.ca, s.proc), 60))
    finally:
        s.stop()
    err = s.proc.stderr.read()
    want = hashlib.sha256(body).hexdigest()
    assert [r[:2] for r in results] == [(200, want)] * 6, err
    assert all(r[2] == ErrorCode.H3_NO_ERROR for r in results), results
    assert all(any(left > 0 for left in group) for group in at_sighup), at_sighup
    assert err.count("orisha: reloaded") == 2, err
    strays = sum(int(n) for n in _STRAYS.findall(err))
    assert strays == 0, err
