"""A network queue pair per core over a tap device:
``orisha boot OUT --tap NAME --address A.B.C.D/NN --cpus N``.

QEMU opens the tap once per queue (``-netdev tap,queues=N``, ``mq=on``); the kernel
negotiates VIRTIO_NET_F_MQ and turns on N pairs (VQ_PAIRS_SET), and core i polls and
sends on pair i (unikernel/src/virtio_net.c). The host's tap hashes each new flow onto
a queue and keeps it there, so each core's lwIP gets its own connections straight from
the device, with no hand-off through core 0 (the user-networking path). The address is
static, from the kernel command line (no DHCP server needed on the tap).

The test makes its own multi_queue tap device (a /24 of its own, the host at .1, the
guest at .2) and deletes it afterwards, also when the test fails; it skips only where
the machine cannot have one (no /dev/net/tun, or no CAP_NET_ADMIN).
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import DEMO, orisha
from httpraw import Conn

from orisha.core.policy import Limits
from orisha.targets.unikernel.boot import cmdline, kvm_usable, qemu_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAP_NET_ADMIN = 12


def _tap_missing() -> str | None:
    """Why this machine cannot have a tap device of the test's own, or None."""
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun (tap devices need the tun driver)"
    with open("/proc/self/status") as f:
        caps = next((int(line.split()[1], 16) for line in f if line.startswith("CapEff:")), 0)
    if not caps >> CAP_NET_ADMIN & 1:
        return "no CAP_NET_ADMIN (making a tap device needs it: run as root)"
    if shutil.which("ip") is None:
        return "no ip(8) (apt-get install iproute2)"
    return None


pytestmark = pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                                reason="apt-get install qemu-system-x86")
needs_tap = pytest.mark.skipif(_tap_missing() is not None, reason=str(_tap_missing()))


def test_qemu_gets_a_queue_per_cpu_on_the_tap():
    one = qemu_command("k.img", "127.0.0.1", 8080, "tcg", 64, "", tap="t0")
    assert one[one.index("-netdev") + 1] == "tap,id=n0,ifname=t0,script=no,downscript=no"
    assert one[one.index("-device") + 1] == "virtio-net-device,netdev=n0"
    two = qemu_command("k.img", "127.0.0.1", 8080, "tcg", 64, "", tap="t0", cpus=2)
    assert two[two.index("-netdev") + 1].endswith(",queues=2")
    assert two[two.index("-device") + 1] == "virtio-net-device,netdev=n0,mq=on"
    pci = qemu_command("k.img", "127.0.0.1", 8080, "tcg", 64, "", machine="q35", tap="t0", cpus=3)
    assert pci[pci.index("-device") + 1] == ("virtio-net-pci,netdev=n0,disable-legacy=off,"
                                             "disable-modern=on,mq=on,vectors=8")
    line = cmdline(Limits(), 2, "10.0.0.2/24", "10.0.0.1").split()
    assert {"orisha.cpus=2", "orisha.ip=10.0.0.2/24", "orisha.gw=10.0.0.1"} <= set(line)


@pytest.mark.parametrize("args, words", [
    (["--tap", "orisha-none0"], ["--tap orisha-none0", "no such network device"]),
    (["--tap", "lo"], ["--tap lo", "not a tap device"]),
    (["--tap", "lo", "--address", "10.0.0.300/24"], ["--address 10.0.0.300/24", "A.B.C.D/NN"]),
    (["--tap", "lo", "--address", "10.0.0.2"], ["--address 10.0.0.2", "A.B.C.D/NN"]),
    (["--tap", "lo", "--address", "10.0.0.2/24", "--gateway", "10.9.0.1"],
     ["--gateway 10.9.0.1", "not another address in 10.0.0.0/24"]),
    (["--address", "10.0.0.2/24"], ["--address", "only with --tap"]),
])
def test_a_missing_tap_or_a_bad_address_is_a_one_line_error(tmp_path, args, words):
    out = str(tmp_path / "img")
    os.makedirs(out)
    with open(os.path.join(out, "manifest.json"), "w") as f:  # refused before it is read
        f.write("{}")
    r = orisha("boot", out, *args, timeout=60)
    lines = r.stderr.splitlines()
    assert r.returncode != 0 and r.stdout == "" and len(lines) == 1, r.stderr
    assert lines[0].startswith("orisha: error: ") and all(w in lines[0] for w in words), lines


def _tap(multi_queue: bool):
    """A tap of this test's own: (name, host address, guest address/NN)."""
    n = os.getpid() % 250 + 1
    name = f"orisha-mq{n}{'m' if multi_queue else 'p'}"  # IFNAMSIZ: at most 15 bytes
    net = f"10.{79 if multi_queue else 80}.{n}"
    subprocess.run(["ip", "link", "del", name], capture_output=True)  # a crashed run's leftover
    try:
        for cmd in (["tuntap", "add", "dev", name, "mode", "tap"] + ["multi_queue"] * multi_queue,
                    ["addr", "add", f"{net}.1/24", "dev", name], ["link", "set", name, "up"]):
            subprocess.run(["ip", *cmd], check=True, capture_output=True, timeout=10)
        yield name, f"{net}.1", f"{net}.2/24"
    finally:
        # The kernel's unregister waits for every reference to the device to go (the
        # exited QEMU's queues, released after RCU grace periods): seconds on a loaded host.
        subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=120)


@pytest.fixture
def tap():
    yield from _tap(multi_queue=True)


@pytest.fixture
def plain_tap():
    yield from _tap(multi_queue=False)


class TapBoot:
    """``orisha boot`` on a tap: the serving line names the guest's own address."""

    def __init__(self, out: str, args: list[str]) -> None:
        self.log: list[str] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "orisha.cli", "boot", out, *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd=ROOT)
        self._drain = threading.Thread(target=self._read_log, daemon=True)
        self._drain.start()
        self.line = self.proc.stdout.readline()
        m = re.search(r"http://(\d+\.\d+\.\d+\.\d+)/", self.line)
        if not m:
            self.proc.wait(30)
            self._drain.join(5)
            raise AssertionError(f"did not boot: {self.line!r}\n" + "\n".join(self.log))
        self.host = m.group(1)

    def _read_log(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line.rstrip("\n"))

    def logged(self, text: str, timeout: float = 30) -> bool:
        """Whether a line of the serial log holds ``text``: the log streams to stderr, which
        the reader thread may take in after the serving line on stdout."""
        deadline = time.monotonic() + timeout
        while not any(text in s for s in list(self.log)):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self._drain.join(5)


def _accels():
    return [pytest.param("kvm", marks=pytest.mark.skipif(not kvm_usable(), reason="no /dev/kvm")),
            "tcg"]


LOAD, CLIENTS = 400, 8  # new connections, one request each, 8 client threads: bounded
CSS = open(os.path.join(DEMO, "css", "site.css"), "rb").read()


def _one_request(host: str) -> bytes:
    c = Conn(80, host=host, timeout=20)
    try:
        r = c.request("/css/site.css", headers={"Connection": "close"})
        return r.body if r.status == 200 else f"status {r.status}".encode()
    finally:
        c.close()


def _per_core(log: list[str]) -> dict[int, dict[str, int]]:
    """The stop's per-core lines: ``stats cpu N connections C requests R drops D`` and
    ``net cpu N queue N rx F ...`` (frames this core took from its own queue)."""
    cores: dict[int, dict[str, int]] = {}
    for line in log:
        m = re.search(r"orisha: stats cpu (\d+) connections (\d+) requests (\d+) drops (\d+)", line)
        if m:
            cpu, *counts = map(int, m.groups())
            cores.setdefault(cpu, {}).update(zip(("connections", "requests", "drops"), counts))
        m = re.search(r"orisha: net cpu (\d+) queue (\d+) rx (\d+) tx (\d+)", line)
        if m:
            cpu, queue, rx, tx = map(int, m.groups())
            cores.setdefault(cpu, {}).update(queue=queue, rx=rx, tx=tx)
    return cores


@pytest.mark.slow
@needs_tap
@pytest.mark.parametrize("accel", _accels())
def test_each_core_serves_its_own_queue_over_tap(image, tap, accel):
    """400 new connections from 8 threads (each its own source port, so the tap hashes
    the flows onto both queues): every answer byte-identical to the file, and each core
    carried at least 35 % of the connections from frames of its own queue pair."""
    name, _, address = tap
    vm = TapBoot(image, ["--tap", name, "--address", address, "--cpus", "2", "--accel", accel])
    try:
        assert vm.host == address.split("/")[0] and "(loop unikernel, 2 workers" in vm.line, vm.line
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            bodies = list(pool.map(lambda _: _one_request(vm.host), range(LOAD), timeout=120))
        assert sum(b == CSS for b in bodies) == LOAD, {b[:40] for b in bodies if b != CSS}
    finally:
        assert vm.stop() == 0, "\n".join(vm.log)
    cores = _per_core(vm.log)
    assert set(cores) == {0, 1}, vm.log
    assert sum(c["connections"] for c in cores.values()) == LOAD, cores
    for cpu, c in cores.items():
        # "queue" only appears when the core polls a pair of its own (none is handed on)
        assert c.get("queue") == cpu and c["rx"] > 0 and c["tx"] > 0, (cpu, cores, vm.log)
        assert c["connections"] >= 0.35 * LOAD and c["requests"] == c["connections"], (cpu, cores)
        assert c["drops"] == 0, cores
    assert any("orisha: drained" in s for s in vm.log)
    print(f"\nper core ({accel}): {cores}")


@pytest.mark.slow
@needs_tap
def test_one_core_on_a_tap_uses_one_queue(image, plain_tap):
    name, host, address = plain_tap
    vm = TapBoot(image, ["--tap", name, "--address", address])
    try:
        assert "(loop unikernel, 1 worker" in vm.line, vm.line
        assert vm.logged(f"static address {address.split('/')[0]} "), vm.log
        assert _one_request(vm.host) == CSS
    finally:
        assert vm.stop() == 0, "\n".join(vm.log)
    assert not any(" queue " in s for s in vm.log), vm.log


@needs_tap
def test_a_tap_of_the_wrong_kind_for_the_cpus_is_a_one_line_error(image, tap, plain_tap):
    """QEMU opens a one-queue tap without IFF_MULTI_QUEUE, and N queues only on a
    multi_queue one: each mismatch is refused before QEMU starts."""
    for name, cpus, words in ((tap[0], "1", "needs --cpus 2 or more"),
                              (plain_tap[0], "2", "needs a multi_queue tap")):
        r = orisha("boot", image, "--tap", name, "--cpus", cpus, timeout=60)
        lines = r.stderr.splitlines()
        assert r.returncode == 1 and len(lines) == 1 and f"--tap {name}" in lines[0] \
            and words in lines[0], r.stderr


@pytest.fixture(scope="module")
def tls_image(tmp_path_factory):
    """The demo with a test certificate: HTTP on 80, HTTPS on 443; (build, CA file)."""
    from tlsutil import make_pki
    pki = make_pki(str(tmp_path_factory.mktemp("tap-pki")))
    out = str(tmp_path_factory.mktemp("uk-tap-tls") / "demo")
    r = orisha("build", DEMO, "-o", out, "--target", "unikernel", "--tls-cert", pki.chain,
               "--tls-key", pki.key)
    assert r.returncode == 0, r.stderr
    return out, pki.ca


BIG = open(os.path.join(DEMO, "files", "big.txt"), "rb").read()


def _tso(log: list[str]) -> tuple[int, int]:
    """The stop's gathered TCP frames and the segments in them, every core's summed."""
    frames = segments = 0
    for line in log:
        m = re.search(r"orisha: net .*tso_frames (\d+) tso_segments (\d+)", line)
        if m:
            frames, segments = frames + int(m.group(1)), segments + int(m.group(2))
    return frames, segments


@pytest.mark.slow
@needs_tap
@pytest.mark.parametrize("kind, cpus", [("plain_tap", "1"), ("tap", "2")])
def test_big_downloads_over_tap_leave_in_tso_frames(tls_image, request, kind, cpus, tmp_path):
    """On a tap the device offers CSUM + HOST_TSO4: 1.2 MB downloads over HTTP and HTTPS
    (four at once on each, so both cores send with --cpus 2) arrive byte-identical, and
    the stop's counters show their segments left gathered, many to a frame (without the
    gathering in virtio_net.c there are no such counters: 1,460-byte frames only)."""
    name, _, address = request.getfixturevalue(kind)
    out, ca = tls_image
    vm = TapBoot(out, ["--tap", name, "--address", address, "--cpus", cpus])
    host = vm.host
    try:
        procs = []
        for i in range(8):
            url = f"http://{host}/files/big.txt" if i % 2 else "https://localhost/files/big.txt"
            procs.append(subprocess.Popen(
                ["curl", "-sS", "--max-time", "60", "--cacert", ca, "--resolve",
                 f"localhost:443:{host}", "-o", str(tmp_path / f"b{i}"), url],
                stderr=subprocess.PIPE))
        for p in procs:
            assert p.wait(90) == 0, p.stderr.read()
        for i in range(8):
            assert (tmp_path / f"b{i}").read_bytes() == BIG, i
    finally:
        assert vm.stop() == 0, "\n".join(vm.log)
    frames, segments = _tso(vm.log)
    # 8 × 1.2 MB is about 6,700 segments of 1,460 bytes
    assert frames > 0 and segments > 3 * frames and segments > 1000, (frames, segments, vm.log[-8:])
    print(f"\ntso ({kind}, --cpus {cpus}): {segments} segments in {frames} frames")
