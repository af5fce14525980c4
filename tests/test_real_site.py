"""A real site no one here wrote: PostgreSQL 15's HTML documentation (~1,100 files).

Every file is fetched from each loop body in every encoding the build kept and
checked byte-identical after decoding; 304, HEAD, Range and negotiation are
checked on every file too. `.ci/run` installs Debian's postgresql-doc-15.
"""

from __future__ import annotations

import gzip
import os

import brotli
import pytest
import zstandard
from conftest import LOOPS, PURE, Server, orisha
from httpraw import Conn

from orisha.serving.server import load_site

REAL = "/usr/share/doc/postgresql-doc-15/html"
DECODE = {b"identity": lambda b: b, b"gzip": gzip.decompress, b"br": brotli.decompress,
          b"zstd": lambda b: zstandard.ZstdDecompressor().decompressobj().decompress(b)}

pytestmark = pytest.mark.skipif(not os.path.isdir(REAL), reason="apt-get install postgresql-doc-15 (.ci/run does)")


@pytest.fixture(scope="module")
def real_build(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("real") / "pg")
    r = orisha("build", REAL, "-o", out)
    assert r.returncode == 0, r.stderr
    return out


def site_files(root: str = REAL):
    out = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            out.append(os.path.relpath(os.path.join(dirpath, n), root))
    return sorted(out)


@pytest.mark.parametrize("loop", LOOPS + PURE)
def test_real_site_byte_identical_in_every_encoding(real_build, loop):
    files = site_files()
    assert len(files) > 1000
    site = load_site(real_build)
    s = Server(real_build, "--loop", loop, "--workers", "2")
    try:
        check_every_file(s.port, site)
    finally:
        s.stop()


def check_every_file(port: int, site, root: str = REAL) -> None:
    """Every file of ``root`` (REAL) from the server on ``port``, in every variant ``site`` has
    (tests/test_container.py runs this against the container too)."""
    files = site_files(root)
    c = Conn(port)
    checked = {b"identity": 0, b"gzip": 0, b"br": 0, b"zstd": 0}
    for rel in files:
        data = open(os.path.join(root, rel), "rb").read()
        path = "/" + rel
        entry = site.routes[path.encode()]
        for v in entry.variants:
            r = c.request(path, headers={"Accept-Encoding": v.coding.decode()})
            assert r.status == 200, path
            assert r.h("content-encoding") == (None if v.coding == b"identity" else v.coding.decode())
            assert r.body == bytes(v.body) and DECODE[v.coding](r.body) == data, (path, v.coding)
            checked[v.coding] += 1
        best = c.request(path, headers={"Accept-Encoding": "gzip, deflate, br, zstd"})
        assert len(best.body) == min(v.length for v in entry.variants)
        assert c.request(path, headers={"If-None-Match": best.h("etag"),
                                        "Accept-Encoding": "gzip, deflate, br, zstd"}).status == 304
        h = c.request(path, method="HEAD")
        assert h.status == 200 and int(h.h("content-length")) == len(data)
        if data:
            r = c.request(path, headers={"Range": "bytes=-100", "Accept-Encoding": "br"})
            assert r.status == 206 and r.body == data[-100:]
    assert all(checked.values()), checked
    assert checked[b"identity"] == len(files)
