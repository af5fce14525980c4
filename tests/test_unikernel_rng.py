"""Entropy in the booted unikernel (issue 15): RDSEED/RDRAND and virtio-rng.

``orisha boot`` gives the guest a virtio-rng device fed from the host's
/dev/urandom (``qemu_command``); the kernel (unikernel/src/virtio_rng.c) adds
it to mbedTLS's entropy pool as a strong source beside the CPU's instructions
and mixes it into the TCP ISN key, and with ``orisha.verbose`` logs
``orisha: entropy sources: …``. Each test boots the demo site built with a
test certificate straight from ``qemu_command`` (plus ``orisha.verbose``, a CPU
model without RDRAND/RDSEED, or no virtio-rng) and reads the serial console:

- with virtio-rng the kernel names it and serves HTTPS;
- on a CPU model without RDRAND/RDSEED it names virtio-rng alone and still
  serves HTTPS (before virtio-rng such a CPU could not);
- with neither it refuses to boot TLS with one PANIC line naming the reason.

The CPU model without RDRAND/RDSEED needs TCG: under this host's KVM (PVM, see
unikernel/README.md "Ring 3") the guest's ring-3 CPUID runs natively, so
``-cpu host,-rdrand,-rdseed`` still shows both instructions.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading

import pytest
from conftest import DEMO, demo_file
from httpraw import read_to_close
from tlsutil import client_context, make_pki
from unikernel_target import build

from orisha.targets.unikernel.boot import (GUEST_TLS, free_port, guest_megabytes, qemu_command,
                                           resolve_accel)

pytestmark = pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                                reason="apt-get install qemu-system-x86")

WAIT = 60
NO_CPU_RNG = "-rdrand,-rdseed"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(str(tmp_path_factory.mktemp("pki")))


@pytest.fixture(scope="module")
def image(pki, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("rng") / "out")
    build(DEMO, ["--tls-cert", pki.chain, "--tls-key", pki.key], out)
    return f"{out}/orisha.img"


class Vm:
    """QEMU running ``qemu_command`` (TLS port forwarded, verbose log), its serial
    console collected; ``up`` says whether the kernel logged its serving line before
    QEMU ended or WAIT ran out. Always stopped by ``close`` (the tests' finally)."""

    def __init__(self, image: str, accel: str, **options) -> None:
        self.port = free_port("127.0.0.1")
        cmd = qemu_command(image, "127.0.0.1", self.port, accel, guest_megabytes(image),
                           "orisha.verbose", guest_port=GUEST_TLS, **options)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        self.serial: list[str] = []
        serving = threading.Event()

        def pump() -> None:
            for raw in self.proc.stdout:
                self.serial.append(raw.decode("utf-8", "replace").rstrip())
                if "orisha: serving" in self.serial[-1]:
                    serving.set()
            serving.set()  # QEMU is gone
        self.pumper = threading.Thread(target=pump, daemon=True)
        self.pumper.start()
        serving.wait(WAIT)
        self.up = self.proc.poll() is None and any("orisha: serving" in s for s in self.serial)

    def log(self) -> str:
        return "\n".join(self.serial)

    def entropy_line(self) -> str:
        return next((s for s in self.serial if "orisha: entropy sources:" in s), "")

    def exit_status(self) -> int:
        """Wait (bounded) for QEMU to end by itself; its exit status."""
        try:
            return self.proc.wait(WAIT)
        finally:
            self.pumper.join(5)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b"exit\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (BrokenPipeError, subprocess.TimeoutExpired):  # gone, or stuck: killed below
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.pumper.join(5)


def https_get(vm: Vm, pki, path: str = "/css/site.css") -> bytes:
    ctx = client_context(pki, ("http/1.1",))
    with socket.create_connection(("127.0.0.1", vm.port), timeout=WAIT) as raw, \
            ctx.wrap_socket(raw, server_hostname="localhost") as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        return read_to_close(s)


def test_orisha_boot_gives_the_guest_a_virtio_rng():
    """One command line: microvm's virtio-mmio device, or a transitional PCI one."""
    cmd = qemu_command("k.img", "127.0.0.1", 8443, "tcg", 64, "")
    assert cmd[cmd.index("-object") + 1] == "rng-random,filename=/dev/urandom,id=rng0"
    assert "virtio-rng-device,rng=rng0" in cmd
    pc = qemu_command("k.img", "127.0.0.1", 8443, "tcg", 64, "", machine="pc")
    assert "virtio-rng-pci,rng=rng0,disable-legacy=off,disable-modern=on" in pc
    bare = qemu_command("k.img", "127.0.0.1", 8443, "tcg", 64, "", rng=False, cpu_flags=NO_CPU_RNG)
    assert not any("rng" in a and "rdrand" not in a for a in bare)
    assert bare[bare.index("-cpu") + 1] == "max,-rdrand,-rdseed"


def test_virtio_rng_is_found_and_tls_serves(image, pki):
    vm = Vm(image, resolve_accel("auto"))
    try:
        assert vm.up, vm.log()
        assert "virtio-rng virtio-mmio" in vm.entropy_line(), vm.log()
        for _ in range(3):
            data = https_get(vm, pki)
            assert data.startswith(b"HTTP/1.1 200 OK\r\n") and data.endswith(demo_file("css/site.css"))
    finally:
        vm.close()


def test_without_rdrand_and_rdseed_tls_runs_on_virtio_rng(image, pki):
    vm = Vm(image, "tcg", cpu_flags=NO_CPU_RNG)
    try:
        assert vm.up, vm.log()
        line = vm.entropy_line()
        assert line.split("entropy sources: ")[1].startswith("virtio-rng "), vm.log()
        assert "rdrand" not in line and "rdseed" not in line
        assert not any("keyed from the clock" in s for s in vm.serial), vm.log()  # the ISN key too
        for _ in range(3):  # each handshake draws from the DRBG that virtio-rng seeded
            data = https_get(vm, pki, "/")
            assert data.startswith(b"HTTP/1.1 200 OK\r\n") and data.endswith(demo_file("index.html"))
    finally:
        vm.close()


def test_without_any_entropy_source_tls_is_refused(image):
    """No RDRAND/RDSEED and no virtio-rng: no TLS keys can be made, so the kernel
    stops at boot (PANIC: QEMU exits 255 through isa-debug-exit) with one line
    saying why, before it serves anything."""
    vm = Vm(image, "tcg", cpu_flags=NO_CPU_RNG, rng=False)
    try:
        assert not vm.up, vm.log()
        assert vm.exit_status() == 255, vm.log()
        assert vm.entropy_line().endswith("entropy sources: none"), vm.log()
        panic = [s for s in vm.serial if "PANIC" in s]
        assert len(panic) == 1 and "no entropy source" in panic[0] \
            and "refusing to serve TLS" in panic[0], vm.log()
    finally:
        vm.close()

