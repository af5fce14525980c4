"""Booting a unikernel build under QEMU: ``orisha boot OUT``.

Strategy: one QEMU process per boot (microvm, the kernel as ``-kernel``, user
networking forwarding HOST:PORT to guest port 80). The serial console is the
kernel's log: it is streamed to stderr, and its ``serving`` line is the signal
that the site is up, after which the start-up line goes to stdout in the same
form ``orisha serve`` prints. SIGTERM/SIGINT stop QEMU and exit 0; a kernel
that stops by itself (a PANIC, a bad image) is an error with its log shown.
Limits travel on the kernel command line (``orisha.idle_timeout=3`` …).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

from ... import manifest
from ...core.policy import Limits
from ...errors import BootError

BOOT_TIMEOUT = 60.0  # seconds from QEMU start to the serving line (TCG on a loaded host is slow)


def _manifest(out: str) -> dict:
    m = manifest.read(out)
    if m is None:
        raise BootError(f"{out}: not an Orisha build (run `orisha build SITE --loop unikernel -o {out}`)")
    if m.get("loop") != "unikernel" or not m.get("image"):
        raise BootError(f"{out}: built for loop {m.get('loop')!r}, not an image "
                        f"(rebuild with --loop unikernel, or run `orisha serve {out}`)")
    return m


def guest_megabytes(image: str) -> int:
    """RAM the kernel needs: the end of its highest PT_LOAD segment (bss included), plus room."""
    with open(image, "rb") as f:
        eh = f.read(52)
        if len(eh) < 52 or eh[:4] != b"\x7fELF" or eh[4] != 1:
            raise BootError(f"{image}: not a 32-bit ELF kernel image (rebuild it)")
        phoff, = struct.unpack_from("<I", eh, 28)
        phentsize, phnum = struct.unpack_from("<HH", eh, 42)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    end = 0
    for i in range(phnum):
        p_type, _, _, p_paddr, _, p_memsz = struct.unpack_from("<6I", table, i * phentsize)
        if p_type == 1:
            end = max(end, p_paddr + p_memsz)
    # 16 MiB above the image: the kernel's arena and heap are in bss, so this is slack
    # for the firmware's tables and the page cache QEMU itself does not need.
    return max(64, -(-end // (1 << 20)) + 16)


def kvm_usable() -> bool:
    return os.access("/dev/kvm", os.R_OK | os.W_OK)


def resolve_accel(accel: str) -> str:
    if accel == "auto" and os.environ.get("ORISHA_ACCEL") in ("kvm", "tcg"):
        accel = os.environ["ORISHA_ACCEL"]  # lets a whole test run pick one (ORISHA_ACCEL=tcg)
    if accel == "auto":
        # Measured (unikernel/README.md "Figures"): with /dev/kvm the kernel boots and serves
        # at least as fast as under TCG and leaves the host more CPU, so KVM when usable.
        return "kvm" if kvm_usable() else "tcg"
    if accel == "kvm" and not kvm_usable():
        raise BootError("--accel kvm: /dev/kvm is missing or not accessible")
    return accel


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cmdline(limits: Limits) -> str:
    """The kernel command line for the limits that differ from their defaults
    (``orisha.<attr>=<value>``; the kernel reads the same names, see policy_header)."""
    parts = []
    for limit, v in limits.changed():
        if limit.kernel:
            text = f"{v:.6f}".rstrip("0").rstrip(".") if isinstance(v, float) else str(int(v))
            parts.append(f"orisha.{limit.attr}={text}")
    return " ".join(parts)


def qemu_command(image: str, host: str, port: int, accel: str, memory: int, append: str) -> list[str]:
    qemu = shutil.which("qemu-system-x86_64")
    if not qemu:
        raise BootError("qemu-system-x86_64 not found (apt-get install qemu-system-x86)")
    cpu = ["-accel", "kvm", "-cpu", "host,-arch-capabilities"] if accel == "kvm" else \
        ["-accel", "tcg", "-cpu", "max"]
    cmd = [qemu, "-machine", "microvm,acpi=off,x-option-roms=off,pic=off,rtc=on,isa-serial=on",
           *cpu, "-m", f"{memory}M", "-nodefaults", "-no-user-config", "-display", "none",
           "-serial", "stdio", "-no-reboot", "-kernel", image,
           "-netdev", f"user,id=n0,hostfwd=tcp:{host}:{port}-:80",
           "-device", "virtio-net-device,netdev=n0",
           "-device", "isa-debug-exit,iobase=0xf4,iosize=0x04"]
    if append:
        cmd += ["-append", append]
    return cmd


def _die_with_parent() -> None:
    """In the QEMU child: be killed if orisha dies, so no VM outlives its command."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the signal handlers still stop QEMU
        pass


def boot(out: str, host: str = "127.0.0.1", port: int = 8080, accel: str = "auto",
         memory: int | None = None, limits: Limits | None = None, announce=print,
         log=sys.stderr) -> int:
    manifest = _manifest(out)
    image = os.path.join(out, manifest["image"])
    if not os.path.isfile(image):
        raise BootError(f"{image}: missing (rebuild with --loop unikernel)")
    accel = resolve_accel(accel)
    memory = memory or guest_megabytes(image)
    if port == 0:
        port = free_port(host)
    cmd = qemu_command(image, host, port, accel, memory, cmdline(limits or Limits()))

    stop = threading.Event()
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
    serial: list[str] = []
    serving = threading.Event()

    def pump_serial() -> None:
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            serial.append(line)
            print(line, file=log, flush=True)  # the serial log, streamed as it comes
            if "orisha: serving" in line:
                serving.set()
        serving.set()  # EOF: QEMU is gone; wake the waiter

    errors: list[str] = []

    def pump_stderr() -> None:
        for raw in proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip()
            errors.append(line)
            print(f"qemu: {line}", file=log, flush=True)

    threads = [threading.Thread(target=pump_serial, daemon=True),
               threading.Thread(target=pump_stderr, daemon=True)]
    for t in threads:
        t.start()

    def fail(why: str) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for t in threads:
            t.join(2)
        if not serial:
            print("orisha: the serial log is empty", file=log, flush=True)
        raise BootError(why)

    try:
        while not serving.wait(0.1):
            if stop.is_set():
                fail("interrupted before the kernel was serving")
            if time.monotonic() - started > BOOT_TIMEOUT:
                fail(f"no 'serving' line on the serial console within {BOOT_TIMEOUT:.0f} s")
        if proc.poll() is not None or not any("orisha: serving" in s for s in serial):
            proc.wait()
            threads[0].join(2)
            threads[1].join(2)
            panic = next((s for s in serial if "PANIC" in s), None)
            qerr = next((e for e in errors if e), None)
            fail("the kernel stopped during boot" + (f": PANIC{panic.split('PANIC', 1)[1]}"
                                                     if panic else f": {qerr}" if qerr
                                                     else f" (QEMU exit status {proc.returncode})"))
        ms = (time.monotonic() - started) * 1000
        announce(f"orisha: serving http://{host}:{port}/ (loop unikernel, 1 worker, pid {os.getpid()}): "
                 f"{manifest.get('summary', '')}")
        sys.stdout.flush()
        print(f"orisha: booted {image} in {ms:.0f} ms ({accel}, {memory} MiB)", file=log, flush=True)
        while not stop.wait(0.2):
            if proc.poll() is not None:
                threads[0].join(2)
                panic = next((s for s in serial if "PANIC" in s), None)
                raise BootError(f"the kernel stopped (QEMU exit status {proc.returncode})"
                                + (f": {panic.strip()}" if panic else ""))
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for s, h in old.items():
            signal.signal(s, h)
