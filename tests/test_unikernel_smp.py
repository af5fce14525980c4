"""The image on more than one core: ``orisha boot OUT --cpus N``.

``--cpus`` is read by its range in ``core/policy.py`` like every numeric option;
QEMU gets ``-smp N`` and, since microvm has no ACPI (no MADT to find the
application processors in), the kernel gets ``orisha.cpus=N`` on its command line
and starts them with INIT-SIPI-SIPI (unikernel/src/smp.c). The serving line says
how many came online.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import signal
import subprocess
import time

import pytest
from conftest import DEMO, orisha
from httpraw import Conn
from unikernel_target import Booted

from orisha.core.policy import RANGES
from orisha.targets.unikernel.boot import cmdline, kvm_usable, qemu_command

pytestmark = pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                                reason="apt-get install qemu-system-x86")


@pytest.mark.parametrize("value", ["0", str(RANGES["cpus"].high + 1), "-1", "two"])
def test_a_cpu_count_outside_the_range_is_refused_in_one_line(value):
    r = orisha("boot", DEMO, "--port", "0", "--cpus", value, timeout=60)
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and r.stdout == "" and len(lines) == 1, r.stderr
    what = "not an integer" if value == "two" else "out of range"
    assert lines[0].startswith("orisha: error: --cpus ") and value in lines[0] and what in lines[0], lines
    assert f"(expected {RANGES['cpus'].text()})" in lines[0]


def test_qemu_gets_smp_and_the_kernel_the_count():
    from orisha.core.policy import Limits
    one = qemu_command("k.img", "127.0.0.1", 8080, "tcg", 64, cmdline(Limits()))
    assert one[one.index("-smp") + 1] == "1" and "-append" not in one
    four = qemu_command("k.img", "127.0.0.1", 8080, "tcg", 64, cmdline(Limits(), 4), cpus=4)
    assert four[four.index("-smp") + 1] == "4"
    assert "orisha.cpus=4" in four[four.index("-append") + 1].split()


def _vcpu_seconds(qemu: int) -> dict[str, float]:
    """CPU time of each vCPU thread of QEMU (named ``CPU 1/KVM`` by ``debug-threads``)."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for tid in os.listdir(f"/proc/{qemu}/task"):
        try:
            name = open(f"/proc/{qemu}/task/{tid}/comm").read().strip()
            fields = open(f"/proc/{qemu}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:  # a thread that ended meanwhile
            continue
        if name.startswith("CPU "):
            seconds[name.split("/")[0]] = (int(fields[11]) + int(fields[12])) / tick
    return seconds


def _serving(vm: Booted) -> str:
    """The kernel's serving line (the serial log streams to stderr: it may lag stdout)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        line = next((s for s in vm.log if "orisha: serving http on port 80" in s), None)
        if line:
            return line
        time.sleep(0.05)
    raise AssertionError("\n".join(vm.log))


def _qemu_pid(vm: Booted) -> int:
    out = subprocess.run(["pgrep", "-P", str(vm.proc.pid), "qemu-system"], capture_output=True,
                         text=True).stdout.split()
    assert len(out) == 1, out
    return int(out[0])


def _quiet(vm: Booted) -> tuple[dict[str, float], float]:
    """Each vCPU thread's CPU seconds over 2 s in which nothing is sent to the guest, and
    the wall seconds they took."""
    qemu = _qemu_pid(vm)
    before, t0 = _vcpu_seconds(qemu), time.monotonic()
    time.sleep(2)  # the quiet measured
    after, wall = _vcpu_seconds(qemu), time.monotonic() - t0
    return {cpu: after[cpu] - before[cpu] for cpu in after}, wall


def _accels():
    return [pytest.param("kvm", marks=pytest.mark.skipif(not kvm_usable(), reason="no /dev/kvm")),
            "tcg"]


@pytest.mark.slow
@pytest.mark.parametrize("accel", _accels())
def test_two_cores_come_online_and_the_second_waits_without_spinning(image, accel):
    vm = Booted(image, ["--cpus", "2", "--accel", accel])
    try:
        assert "2 cores online" in _serving(vm), vm.log
        assert "(loop unikernel, 2 workers, pid" in vm.line, vm.line
        c = Conn(vm.port)
        r = c.request("/")
        assert r.status == 200 and r.body == open(os.path.join(DEMO, "index.html"), "rb").read()
        c.close()
        busy, wall = _quiet(vm)
        assert set(busy) == {"CPU 0", "CPU 1"}, busy
        # Core 1 halts between its LAPIC timer's wake-ups (lwIP's next timer, at most
        # 10 ms): a core that spun would use ~all of `wall` (core 0: the test below).
        assert busy["CPU 1"] < 0.2 * wall, (busy, wall)
        assert Conn(vm.port).request("/css/site.css").status == 200
        for _ in range(5):
            time.sleep(0.02)  # a quiet of 20 ms: past the polling, core 0 naps again
            assert Conn(vm.port).request("/").status == 200
    finally:
        assert vm.stop() == 0, "\n".join(vm.log)


def _napped_ms(log: list[str]) -> dict[int, int]:
    """Each core's time in HLT, from its last net line (``... napped_ms N``): core 0's
    reads ``orisha: net rx`` (one queue pair) or ``orisha: net cpu 0 queue 0``."""
    napped = {}
    for line in log:
        m = re.search(r"orisha: net (?:cpu (\d+) )?.*napped_ms (\d+)", line)
        if m:
            napped[int(m.group(1) or 0)] = int(m.group(2))
    return napped


@pytest.mark.slow
@pytest.mark.parametrize("accel", _accels())
@pytest.mark.parametrize("cpus", [1, 2])
def test_an_idle_image_naps_instead_of_spinning(image, accel, cpus):
    """Core 0 polls the device for every core; once nothing has come for a while it
    naps in HLT instead of spinning (net.c net_wait), and the device's interrupt ends
    the nap (microvm's virtio-mmio line, routed to core 0). Over 2 s of quiet its vCPU
    thread uses under a fifth of them (a spinning one uses all the host gives it, a
    whole core on a quiet host), the stop's net line counts more than half of them
    napped (a spinning core 0 naps never: 0), and a request after the quiet is
    answered, and so are requests spaced past core 0's 1 ms of polling after a frame:
    their frames arrive in naps, and the net line counts the device's interrupts
    (``irqs``; 0 where only a timer ends a nap)."""
    vm = Booted(image, ["--cpus", str(cpus), "--accel", accel])
    try:
        assert f"{cpus} core" in _serving(vm), vm.log
        assert Conn(vm.port).request("/").status == 200
        busy, wall = _quiet(vm)
        assert busy["CPU 0"] < 0.2 * wall, (busy, wall)
        assert Conn(vm.port).request("/css/site.css").status == 200
        for _ in range(5):
            time.sleep(0.02)  # a quiet of 20 ms: past the polling, core 0 naps again
            assert Conn(vm.port).request("/").status == 200
    finally:
        assert vm.stop() == 0, "\n".join(vm.log)
    napped = _napped_ms(vm.log)
    assert set(napped) == set(range(cpus)), vm.log
    assert napped[0] > 1000 * wall / 2, (napped, wall)
    irqs = [int(m.group(1)) for line in vm.log
            for m in [re.search(r"orisha: net rx .* irqs (\d+)", line)] if m]
    assert irqs and irqs[-1] > 0, vm.log


@pytest.mark.slow
def test_one_core_is_as_before(image):
    vm = Booted(image, ["--cpus", "1"])
    try:
        assert "1 core online" in _serving(vm) and not any("cpu 1" in s for s in vm.log), vm.log
        assert "(loop unikernel, 1 worker, pid" in vm.line, vm.line
        assert set(_vcpu_seconds(_qemu_pid(vm))) == {"CPU 0"}
        assert Conn(vm.port).request("/").status == 200
    finally:
        assert vm.stop() == 0, "\n".join(vm.log)


def _per_core(log: list[str]) -> dict[int, dict[str, int]]:
    """The per-core stats lines (the last of each core's): ``orisha: stats cpu N
    connections C requests R drops D busy_ms B cycles_per_request K``."""
    cores = {}
    for line in log:
        m = re.search(r"orisha: stats cpu (\d+) connections (\d+) requests (\d+) drops (\d+) "
                      r"busy_ms (\d+) cycles_per_request (\d+)", line)
        if m:
            cpu, *counts = map(int, m.groups())
            cores[cpu] = dict(zip(("connections", "requests", "drops", "busy_ms",
                                   "cycles_per_request"), counts))
    return cores


@pytest.mark.parametrize("cpus", [1, 2])
def test_sigusr1_has_every_core_log_its_cycles_per_request(image, cpus):
    """`orisha boot` turns SIGUSR1 into the console's ``stats``: every core logs its
    stats lines now, each with its time out of HLT and that time as guest (TSC) cycles
    per request answered; asked again after more requests, the counts have grown."""
    vm = Booted(image, ["--cpus", str(cpus)])
    try:
        assert f"{cpus} core" in _serving(vm), vm.log
        snapshots = []
        for _ in range(2):
            for _ in range(20):
                assert _one_request(vm.port) == 200
            seen = len(vm.log)
            vm.proc.send_signal(signal.SIGUSR1)
            deadline = time.monotonic() + 10  # the console is read every 50 ms
            while len(_per_core(vm.log[seen:])) < cpus and time.monotonic() < deadline:
                time.sleep(0.05)
            snapshots.append(_per_core(vm.log[seen:]))
        first, second = snapshots
        assert set(first) == set(second) == set(range(cpus)), vm.log
        assert sum(c["requests"] for c in first.values()) >= 20, first
        assert sum(c["requests"] for c in second.values()) >= 40, second
        for cpu, c in second.items():
            assert c["busy_ms"] >= first[cpu]["busy_ms"], (first, second)
            if c["requests"]:
                assert c["cycles_per_request"] > 0, c
    finally:
        assert vm.stop() == 0, "\n".join(vm.log)


def _one_request(port: int) -> int:
    c = Conn(port)
    try:
        return c.request("/css/site.css", headers={"Connection": "close"}).status
    finally:
        c.close()


LOAD = 400  # new connections, one request each, 8 at a time: a bounded load


@pytest.mark.slow
@pytest.mark.parametrize("accel", _accels())
def test_both_cores_carry_new_connections(image, accel):
    """Core 0 hands each TCP segment to a core by its 4-tuple; each core's own lwIP and
    request core answers. Every request is answered 200 and each core takes at least
    35 % of the connections (its own counters, logged at the stop)."""
    vm = Booted(image, ["--cpus", "2", "--accel", accel])
    try:
        assert "2 cores online" in _serving(vm)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(lambda _: _one_request(vm.port), range(LOAD), timeout=120))
        assert statuses == [200] * LOAD
    finally:
        assert vm.stop() == 0, "\n".join(vm.log)
    cores = _per_core(vm.log)
    assert set(cores) == {0, 1}, vm.log
    total = sum(c["connections"] for c in cores.values())
    assert total == LOAD, cores
    for cpu, c in cores.items():
        assert c["connections"] >= 0.35 * LOAD and c["requests"] == c["connections"], (cpu, cores)
        assert c["drops"] == 0, cores
    assert any("orisha: drained" in s for s in vm.log)
