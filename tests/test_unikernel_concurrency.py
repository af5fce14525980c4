"""Many connections at once against the booted image, with h2load (issue 32).

One TLS build of the demo site, booted with the default memory, whose table
(sized from the guest's RAM: the serving line's ``table T of N slots``) holds
fewer connections than h2load opens. Each run must be answered whole: a
connection beyond the table waits in its slot (the accept backlog) or, when
every served one is stuck, gets a 503; none is reset in its handshake. Before
issue 32 a burst of 1,000 got 177 answers (``displaced 823``: the table reset
handshakes in progress) and 100 h2 connections lost a fifth of their requests
(the TLS heap had room for ~85 h2 connections; the others were closed).

Bounded: each h2load run has a time limit, and the counts come from h2load's
own summary and the kernel's stats line, never from timing.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess

import pytest
from conftest import DEMO
from test_unikernel_hostile import Vm, _assert_bounded
from tlsutil import make_pki
from unikernel_target import build

pytestmark = [pytest.mark.slow,
              pytest.mark.serial,  # alone: beside the other tests the guest is starved (dev)
              pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                                 reason="apt-get install qemu-system-x86"),
              pytest.mark.skipif(shutil.which("h2load") is None,
                                 reason="apt-get install nghttp2-client")]

RUN_TIMEOUT = 180  # seconds for one h2load run (1,000 handshakes take ~5 s here under KVM)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pki = make_pki(str(tmp_path_factory.mktemp("pki")))
    out = str(tmp_path_factory.mktemp("demo") / "out")
    build(DEMO, ["--tls-cert", pki.chain, "--tls-key", pki.key], out)
    return out


@pytest.fixture(scope="module")
def vm(built):
    """The module's boot. At the end, whatever ran against it (any selection, any order)
    is held to test_memory_stayed_bounded_under_the_bursts's bounds (an error at the
    module's teardown otherwise)."""
    booted = Vm(built)
    try:
        yield booted
    finally:
        booted.stop()
    if booted.stats():  # nothing at all ran against it: no stats line to read
        _assert_unharmed(booted)


def _table(vm: Vm) -> tuple[int, int]:
    vm.table()  # waits for the serving line in the log
    for line in list(vm.log):
        m = re.search(r"table (\d+) of (\d+) slots", line)
        if m:
            return int(m.group(1)), int(m.group(2))
    raise AssertionError("no table in the serving line:\n" + "".join(vm.log))


def _h2load(vm: Vm, *args: str) -> dict:
    r = subprocess.run(["h2load", *args, f"https://127.0.0.1:{vm.port}/css/site.css"],
                       capture_output=True, text=True, timeout=RUN_TIMEOUT)
    m = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, "
                  r"(\d+) failed, (\d+) errored, (\d+) timeout", r.stdout)
    assert m, r.stdout + r.stderr
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", r.stdout)
    keys = ("total", "started", "done", "succeeded", "failed", "errored", "timeout")
    got = dict(zip(keys, map(int, m.groups())))
    got["5xx"] = int(codes.group(4))
    if got["errored"]:  # h2load names no reason: what the host's sockets looked like after it
        got["host"] = subprocess.run(["ss", "-s"], capture_output=True, text=True).stdout \
            + r.stderr[-500:]
    return got


@pytest.mark.parametrize("proto,requests,streams", [
    ("h1", 1, 1), ("h1", 10, 1), ("h2", 1, 1), ("h2", 10, 1), ("h2", 10, 10)])
def test_a_thousand_tls_connections_are_all_answered(vm, proto, requests, streams):
    """1,000 TLS connections at once, one or ten requests each (h2: one at a time, or
    ten streams at once), more than the table holds: every request succeeds, some
    connections waited for the table, and none was displaced (the stats line)."""
    table, slots = _table(vm)
    assert table * vm.cpus < 1000 <= slots + 1000, (table, slots)
    opts = ["--h1"] if proto == "h1" else ["-m", str(streams)]
    got = _h2load(vm, "-c", "1000", "-n", str(1000 * requests), *opts)
    ok = got["succeeded"] == 1000 * requests and got["failed"] == got["errored"] == 0
    assert ok, f"{got}\n" + "".join(vm.log[-6:])
    st = vm.wait_stats(lambda st: st["queued"] > 0, "a connection that waited")
    assert st["displaced"] == 0 and st["killed"] == 0, st


def test_a_hundred_h2_connections_lose_no_request(vm):
    """100 h2 connections of ten requests each, five times: nothing lost (the TLS heap
    holds every admitted connection's h2 state: reserved at admission)."""
    for _ in range(5):
        got = _h2load(vm, "-c", "100", "-n", "1000", "-m", "10")
        assert got["succeeded"] == 1000 and got["failed"] == 0, f"{got}\n" + "".join(vm.log[-6:])


@contextlib.contextmanager
def _starved(pid: int, percent: int):
    """Process ``pid`` and its threads held to ``percent`` of one host core (a CPU cgroup
    of its own, v1 or v2, removed afterwards): a host too busy to give the guest more."""
    v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
    root = "/sys/fs/cgroup" if v2 else "/sys/fs/cgroup/cpu"
    group = os.path.join(root, f"orisha-starved-{os.getpid()}")
    os.mkdir(group)
    try:
        if v2:
            with open(os.path.join(root, "cgroup.subtree_control"), "w") as f:
                f.write("+cpu")
            with open(os.path.join(group, "cpu.max"), "w") as f:
                f.write(f"{percent * 1000} 100000")
        else:
            with open(os.path.join(group, "cpu.cfs_period_us"), "w") as f:
                f.write("100000")
            with open(os.path.join(group, "cpu.cfs_quota_us"), "w") as f:
                f.write(str(percent * 1000))
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(pid))
        yield
    finally:
        try:  # back to the root group: a group with a member cannot be removed
            with open(os.path.join(root, "cgroup.procs"), "w") as f:
                f.write(str(pid))
        except ProcessLookupError:  # it has exited
            pass
        os.rmdir(group)


def test_a_burst_on_a_starved_host_is_all_answered(built):
    """A boot of its own whose QEMU (every thread: the vCPUs, its I/O thread, slirp) gets
    a fifth of a host core per vCPU, then 1,000 TLS connections at once, one request
    each: the guest is slow (its handshakes take several times as long, connections wait
    seconds for the table) and answers every one, none displaced. The host load a busy
    test suite makes, made here and bounded. (The guest may still time out a connection
    whose acknowledgement it was too slow to read: on 2 vCPUs at a fifth of a core, 6
    send timeouts after every response had arrived; unikernel/README.md, "tried and not
    kept".)"""
    vm = Vm(built)
    try:
        qemu = subprocess.run(["pgrep", "-P", str(vm.proc.pid), "qemu-system"],
                              capture_output=True, text=True).stdout.split()
        assert len(qemu) == 1, qemu
        with _starved(int(qemu[0]), 20 * vm.cpus):
            got = _h2load(vm, "-c", "1000", "-n", "1000", "--h1")
            st = vm.wait_stats(lambda st: st["queued"] > 0, "a connection that waited")
        assert got["succeeded"] == 1000 and got["failed"] == got["errored"] == 0, \
            f"{got}\n" + "".join(vm.log[-6:])
        assert st["displaced"] == st["killed"] == 0, st
    finally:
        vm.stop()


def _assert_unharmed(vm: Vm) -> None:
    """After a stopped boot's bursts: no failed allocation, no exhausted pool, no frame
    dropped; the stop's stats lines count no displaced or killed connection."""
    _assert_bounded(vm.stats(), vm.log)
    st = vm.totals()
    assert st["displaced"] == 0 and st["killed"] == 0, st


def test_memory_stayed_bounded_under_the_bursts(built):
    """A boot of its own (it needs no other test before it, and stops no boot another
    uses): a burst of 1,000 TLS connections of ten requests each, all answered; after
    the stop no failed allocation, no exhausted pool, no frame dropped, and no
    displaced or killed connection."""
    vm = Vm(built)
    try:
        got = _h2load(vm, "-c", "1000", "-n", "10000", "--h1")
        assert got["succeeded"] == 10000 and got["failed"] == got["errored"] == 0, \
            f"{got}\n" + "".join(vm.log[-6:])
    finally:
        vm.stop()
    _assert_unharmed(vm)
