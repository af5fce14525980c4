"""The booted image's TCP initial sequence numbers are not predictable (RFC 6528).

lwIP's own generator starts every connection of the first 500 ms at the same
number and then steps by its timer ticks; the kernel sets LWIP_HOOK_TCP_ISN to a
keyed hash of the connection's addresses and ports plus a 4 µs clock, keyed at
boot from RDSEED/RDRAND (unikernel/src/net.c).

The numbers are read off the wire, not from the kernel's own word: QEMU's
``filter-dump`` records every frame between the guest and QEMU's user
networking (the host's sockets never see the guest's TCP: libslirp ends it), and
the SYN-ACKs the guest sent carry its ISNs. The QEMU command is the one
``orisha boot`` runs (``qemu_command``) plus that filter.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import threading
import time

import pytest
from conftest import DEMO, orisha

from orisha.targets.unikernel.boot import free_port, guest_megabytes, qemu_command, resolve_accel

pytestmark = pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                                reason="apt-get install qemu-system-x86")

WAIT = 60
CONNECTIONS = 8


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("uk") / "demo")
    r = orisha("build", DEMO, "-o", out, "--target", "unikernel")
    assert r.returncode == 0, r.stderr
    return os.path.join(out, "orisha.img")


def syn_ack_isns(pcap: str) -> list[tuple[int, int]]:
    """(client port, sequence number) of every SYN-ACK sent from port 80 in a pcap
    file of Ethernet frames (little- or big-endian header, microsecond records)."""
    with open(pcap, "rb") as f:
        data = f.read()
    endian = "<" if data[:4] == b"\xd4\xc3\xb2\xa1" else ">"
    out, pos = [], 24
    while pos + 16 <= len(data):
        incl, = struct.unpack_from(endian + "I", data, pos + 8)
        frame = data[pos + 16:pos + 16 + incl]
        pos += 16 + incl
        if len(frame) < 14 + 20 + 20 or frame[12:14] != b"\x08\x00" or frame[23] != 6:
            continue
        tcp = frame[14 + (frame[14] & 0x0F) * 4:]
        sport, dport, seq = struct.unpack_from("!HHI", tcp)
        if sport == 80 and tcp[13] & 0x12 == 0x12:  # SYN and ACK
            out.append((dport, seq))
    return out


def boot_and_connect(image: str, pcap: str) -> list[tuple[int, int]]:
    """Boot with the frame dump, open CONNECTIONS connections in quick succession
    (one GET each, well within lwIP's 500 ms tick), leave, and read the SYN-ACKs."""
    port = free_port("127.0.0.1")
    cmd = qemu_command(image, "127.0.0.1", port, resolve_accel("auto"), guest_megabytes(image), "")
    cmd += ["-object", f"filter-dump,id=dump0,netdev=n0,file={pcap}"]
    vm = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)
    try:
        serial: list[bytes] = []
        serving = threading.Event()

        def pump() -> None:
            for line in vm.stdout:
                serial.append(line)
                if b"orisha: serving" in line:
                    serving.set()
            serving.set()
        threading.Thread(target=pump, daemon=True).start()
        assert serving.wait(WAIT) and vm.poll() is None, b"".join(serial).decode("replace")
        socks = []
        for _ in range(CONNECTIONS):
            s = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            socks.append(s)
        for s in socks:
            with s:
                assert s.recv(12) == b"HTTP/1.1 200"
        vm.stdin.write(b"exit\n")
        vm.stdin.flush()
        vm.wait(WAIT)
    finally:
        if vm.poll() is None:
            vm.kill()
            vm.wait()
    return syn_ack_isns(pcap)


def test_isns_differ_between_connections_and_boots(image, tmp_path):
    first = boot_and_connect(image, str(tmp_path / "a.pcap"))
    assert len(first) == CONNECTIONS, first
    isns = [seq for _, seq in first]
    assert len(set(isns)) == CONNECTIONS, isns
    steps = {(b - a) % (1 << 32) for a, b in zip(isns, isns[1:])}
    assert len(steps) > 1, f"ISNs {isns} step by a constant"
    # Keyed at boot: the same image booted again starts elsewhere.
    again = boot_and_connect(image, str(tmp_path / "b.pcap"))
    assert again and again[0][1] != first[0][1], (first, again)
