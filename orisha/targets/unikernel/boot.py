"""Booting a unikernel build under QEMU: ``orisha boot OUT``.

Strategy: one QEMU process per boot (microvm, the kernel as ``-kernel``, user
networking forwarding HOST:PORT to guest port 80, or to its TLS port 443 for an
image built with a certificate, whose port 80 is forwarded from ``http_port``
when one is given; or, with ``--tap NAME``, a tap device the guest answers on at its own
address, a virtio-net queue pair per vCPU: check_tap, check_address); ``qemu_command`` is the one
place its command line is written (``unikernel/run.sh`` prints it with
``python3 -m orisha.targets.unikernel.boot --print-command``). The serial
console is the kernel's log: it is streamed to stderr, and its ``serving`` line
is the signal that the site is up, after which the start-up line goes to stdout
in the same form ``orisha serve`` prints. Limits travel on the kernel command
line (``orisha.idle_timeout=3`` …).

Stopping: SIGTERM/SIGINT write ``stop`` to the guest's console (QEMU's stdin);
the kernel stops accepting and ends each connection after its current response
(unikernel/src/main.c). QEMU's user networking acknowledges bytes before it has
passed them to the host's sockets, so the guest cannot tell when its bytes have
left QEMU; this side can: once the guest has logged ``drained`` and none of
QEMU's forwarded sockets still carries an open stream, or when ``grace`` seconds
are up, it writes ``exit`` and the kernel leaves QEMU through isa-debug-exit;
exit status 0. A second signal skips the wait. A kernel that stops by itself (a
PANIC, a bad image) is an error with its log shown. QEMU never outlives this
process (PR_SET_PDEATHSIG) and sits in its own process group, so a terminal's
Ctrl-C reaches this process alone and is drained like SIGTERM. SIGUSR1 writes
``stats``: every core logs its stats lines (its guest cycles per request among them).
"""

from __future__ import annotations

import ipaddress
import os
import re
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
EXIT_TIMEOUT = 5.0   # seconds QEMU may take to leave after ``exit`` before it is killed
STOP_ANSWER = 2.0    # seconds after ``stop`` without the kernel's "stopping" line: logged
MACHINES = ("microvm", "pc", "q35")
TABLE_RAM = 48       # MiB above the image by default: the connection table's (see guest_megabytes)


def _manifest(out: str) -> dict:
    m = manifest.read(out)
    if m is None:
        raise BootError(f"{out}: not an Orisha build (run `orisha build SITE --target unikernel -o {out}`)")
    if m.get("loop") != "unikernel" or not m.get("image"):
        raise BootError(f"{out}: built for loop {m.get('loop')!r}, not an image "
                        f"(rebuild with --target unikernel, or run `orisha serve {out}`)")
    return m


def guest_megabytes(image: str, machine: str = "microvm", cpus: int = 1) -> int:
    """RAM the kernel needs: the end of its highest PT_LOAD segment (bss included), plus room;
    for each core beyond the first, a private copy of the application's state (the first
    writable segment, 2 MiB aligned: unikernel/src/linker.ld), its stacks and tables, and
    the same room for its own connection table (each core sizes its own from its share)."""
    with open(image, "rb") as f:
        eh = f.read(52)
        if len(eh) < 52 or eh[:4] != b"\x7fELF" or eh[4] != 1:
            raise BootError(f"{image}: not a 32-bit ELF kernel image (rebuild it)")
        phoff, = struct.unpack_from("<I", eh, 28)
        phentsize, phnum = struct.unpack_from("<HH", eh, 42)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    end, private = 0, 0
    for i in range(phnum):
        p_type, _, _, p_paddr, _, p_memsz, p_flags, _ = struct.unpack_from("<8I", table, i * phentsize)
        if p_type == 1:
            end = max(end, p_paddr + p_memsz)
            if p_flags & 2 and not private:
                private = -(-p_memsz // (2 << 20)) * 2
    need = -(-end // (1 << 20)) + (cpus - 1) * (private + 2 + TABLE_RAM)
    if machine == "microvm":
        # Above its bss the kernel sizes its connection table from the RAM it finds
        # (unikernel/src/http.c size_table: slots of ~22 KB and, with TLS, 80 KiB of
        # TLS heap per connection served at once): TABLE_RAM gives the demo with TLS its
        # full 256 served and ~900 slots. Only pages the kernel touches cost the host.
        return need + TABLE_RAM
    # pc/q35: firmware (SeaBIOS, the linuxboot option ROM) lives in RAM too; their paths
    # failed to serve under 64 MiB, so they keep the old room.
    return max(64, need + 16) + TABLE_RAM


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


def cmdline(limits: Limits, cpus: int = 1, address: str | None = None,
            gateway: str | None = None) -> str:
    """The kernel command line for the limits that differ from their defaults
    (``orisha.<attr>=<value>``; the kernel reads the same names, see policy_header), and
    the vCPU count beyond one: microvm has no ACPI (no MADT), so this is how the kernel
    learns how many application processors to start. ``address`` (A.B.C.D/NN) and
    ``gateway``: a static guest address (``orisha.ip=``, ``orisha.gw=``; no DHCP then)."""
    parts = [f"orisha.cpus={cpus}"] if cpus > 1 else []
    if address:
        parts.append(f"orisha.ip={address}")
    if gateway:
        parts.append(f"orisha.gw={gateway}")
    for limit, v in limits.changed():
        if limit.kernel:
            text = f"{v:.6f}".rstrip("0").rstrip(".") if isinstance(v, float) else str(int(v))
            parts.append(f"orisha.{limit.attr}={text}")
    return " ".join(parts)


GUEST_HTTP, GUEST_TLS = 80, 443  # the kernel's ports (unikernel/src/http.c, tls.h)
IFF_MULTI_QUEUE = 0x100  # linux/if_tun.h: /sys/class/net/NAME/tun_flags


def check_tap(name: str, cpus: int) -> None:
    """``--tap NAME``: an existing tap device, multi_queue when more than one queue pair
    is asked for (QEMU opens it once per queue); a BootError that names the problem."""
    flags = f"/sys/class/net/{name}/tun_flags"
    if not name or "/" in name or not os.path.exists(f"/sys/class/net/{name}"):
        raise BootError(f"--tap {name}: no such network device (create it: "
                        f"ip tuntap add dev {name} mode tap multi_queue)")
    try:
        with open(flags) as f:
            tun_flags = int(f.read().strip(), 16)
    except (OSError, ValueError):  # no tun_flags: not a tun/tap device
        raise BootError(f"--tap {name}: not a tap device") from None
    if cpus > 1 and not tun_flags & IFF_MULTI_QUEUE:
        raise BootError(f"--tap {name}: --cpus {cpus} needs a multi_queue tap (ip tuntap add "
                        f"dev {name} mode tap multi_queue)")
    if cpus == 1 and tun_flags & IFF_MULTI_QUEUE:  # QEMU opens one queue without the flag
        raise BootError(f"--tap {name}: a multi_queue tap needs --cpus 2 or more (QEMU attaches "
                        "one queue to a tap made without multi_queue)")


def check_address(address: str | None, gateway: str | None, tap: str | None) -> None:
    """``--address A.B.C.D/NN`` and ``--gateway A.B.C.D`` (a static guest address on a tap)."""
    if (address or gateway) and not tap:
        raise BootError(f"--{'address' if address else 'gateway'}: only with --tap (QEMU's user "
                        "networking gives the guest its address by DHCP)")
    if gateway and not address:
        raise BootError("--gateway: only with --address")
    if not address:
        return
    try:
        iface = ipaddress.IPv4Interface(address)
    except ValueError:
        raise BootError(f"--address {address}: expected A.B.C.D/NN (e.g. 10.0.0.2/24)") from None
    if "/" not in address or not 1 <= iface.network.prefixlen <= 30:
        raise BootError(f"--address {address}: expected A.B.C.D/NN with NN from 1 to 30")
    if iface.ip in (iface.network.network_address, iface.network.broadcast_address):
        raise BootError(f"--address {address}: the network's own or broadcast address")
    if gateway:
        try:
            gw = ipaddress.IPv4Address(gateway)
        except ValueError:
            raise BootError(f"--gateway {gateway}: expected A.B.C.D") from None
        if gw not in iface.network or gw == iface.ip:
            raise BootError(f"--gateway {gateway}: not another address in {iface.network}")


def qemu_command(image: str, host: str, port: int, accel: str, memory: int, append: str,
                 machine: str = "microvm", guest_port: int = GUEST_HTTP,
                 http_port: int | None = None, cpu_flags: str = "",
                 rng: bool = True, cpus: int = 1, tap: str | None = None) -> list[str]:
    """The QEMU command line, the only copy: microvm with virtio-mmio (what ``orisha boot``
    runs), or pc/q35 with transitional virtio-pci devices (the drivers' PCI path). HOST:PORT
    forwards to ``guest_port``; HOST:``http_port``, if given, to the guest's port 80.

    A virtio-rng device fed from the host's /dev/urandom is the guest's second entropy
    source beside RDSEED/RDRAND (unikernel/src/virtio_rng.c), and its only one on a CPU
    model without them. ``cpu_flags`` (``-rdrand,-rdseed``) and ``rng=False`` are for
    tests that take either away. ``cpus``: ``-smp`` (the kernel hears the count from
    ``cmdline``). ``tap``: the guest on that tap device instead of user networking (no
    forwards: it answers on its own address), with a queue pair per vCPU beyond one
    (``queues=N``, ``mq=on``; virtio-pci also gets the 2N+2 MSI-X vectors Linux guests
    want, unused by this polling driver)."""
    qemu = shutil.which("qemu-system-x86_64")
    if not qemu:
        raise BootError("qemu-system-x86_64 not found (apt-get install qemu-system-x86)")
    model = "host,-arch-capabilities" if accel == "kvm" else "max"
    cpu = ["-accel", accel, "-cpu", model + (f",{cpu_flags}" if cpu_flags else "")]
    if machine == "microvm":
        mach = ["-machine", "microvm,acpi=off,x-option-roms=off,pic=off,rtc=on,isa-serial=on"]
        bus, legacy = "device", ""
    elif machine in MACHINES:
        mach = ["-machine", machine]
        bus, legacy = "pci", ",disable-legacy=off,disable-modern=on"
    else:
        raise BootError(f"machine {machine!r}: choose one of {', '.join(MACHINES)}")
    entropy = ["-object", "rng-random,filename=/dev/urandom,id=rng0",
               "-device", f"virtio-rng-{bus},rng=rng0{legacy}"] if rng else []
    # debug-threads: QEMU names each vCPU's thread ("CPU 1/KVM"), so the host can see
    # (and tests can check) what every core costs.
    if tap:
        netdev = f"tap,id=n0,ifname={tap},script=no,downscript=no"
        nic = f"virtio-net-{bus},netdev=n0{legacy}"
        if cpus > 1:
            netdev += f",queues={cpus}"
            nic += ",mq=on" + (f",vectors={2 * cpus + 2}" if bus == "pci" else "")
    else:
        netdev = (f"user,id=n0,hostfwd=tcp:{host}:{port}-:{guest_port}"
                  + (f",hostfwd=tcp:{host}:{http_port}-:{GUEST_HTTP}" if http_port else ""))
        nic = f"virtio-net-{bus},netdev=n0{legacy}"
    cmd = [qemu, "-name", "orisha,debug-threads=on", *mach, *cpu, "-smp", str(cpus),
           "-m", f"{memory}M", "-nodefaults", "-no-user-config", "-display", "none",
           "-serial", "stdio", "-no-reboot", "-kernel", image,
           "-netdev", netdev, "-device", nic, *entropy,
           "-device", "isa-debug-exit,iobase=0xf4,iosize=0x04"]
    if append:
        cmd += ["-append", append]
    return cmd


def _detach_and_die_with(parent: int) -> None:
    """In the QEMU child: a process group of its own (a terminal's Ctrl-C goes to
    orisha alone, which drains), and killed if orisha dies, so no VM outlives it."""
    os.setpgid(0, 0)
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the signal handlers still stop QEMU
        return
    if os.getppid() != parent:  # orisha died before prctl took effect
        os._exit(1)


# /proc/net/tcp states of a stream QEMU still carries: SYN_RECV, ESTABLISHED, CLOSE_WAIT.
# Once the guest has closed a connection and QEMU has written everything it acknowledged
# to the host socket, QEMU shuts that socket's sending side (FIN_WAIT*, LAST_ACK, gone).
_OPEN_STATES = {"01", "03", "08"}


def _sockets(pid: int) -> dict[str, int] | None:
    """Process ``pid``'s sockets: inode -> descriptor number (None: no /proc, or gone)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # the process is gone, or no /proc
        return None
    sockets = {}
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            sockets[link[8:-1]] = int(fd)
    return sockets


def _tcp_rows(pid: int):
    """(local port, state, inode) of every TCP socket in process ``pid``'s namespace."""
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:  # no IPv6 in this kernel
            continue
        for row in rows:
            fields = row.split()
            yield int(fields[1].rsplit(":", 1)[1], 16), fields[3], fields[9]


def forwarding(pid: int) -> bool:
    """Whether QEMU (process ``pid``) holds a TCP socket with a stream still open
    towards its client. False where /proc cannot tell (not Linux)."""
    sockets = _sockets(pid)
    return bool(sockets) and any(state in _OPEN_STATES and inode in sockets
                                 for _, state, inode in _tcp_rows(pid))


def widen_backlog(pid: int, port: int) -> bool:
    """Give QEMU's port forward a full accept queue; False where that cannot be done.

    libslirp listens for a host forward with a backlog of 1 (``tcpx_listen``:
    ``listen(s, 1)``), so a burst of connections (a browser opens six) overflows the
    host's accept queue: the kernel drops the handshakes' last ACKs and the clients
    wait for SYN-ACK retransmissions, 1, 2, 4 s and more (seen as TcpExtListenOverflows
    and as the rare time-outs of the socket tests after 20 connections in a row).
    ``listen()`` again on the same socket sets its backlog; pidfd_getfd (Linux 5.6)
    lends us QEMU's descriptor for that (our own child: the ptrace check passes)."""
    sockets = _sockets(pid) or {}
    fd = next((sockets[inode] for p, state, inode in _tcp_rows(pid)
               if p == port and state == "0A" and inode in sockets), None)
    if fd is None:
        return False
    try:
        import ctypes
        pidfd = os.pidfd_open(pid)
    except (OSError, AttributeError):  # not Linux 5.3+, or QEMU is gone
        return False
    try:
        mine = ctypes.CDLL(None, use_errno=True).syscall(438, pidfd, fd, 0)  # SYS_pidfd_getfd
    finally:
        os.close(pidfd)
    if mine < 0:  # ENOSYS (before 5.6), EPERM (a seccomp profile): the backlog stays 1
        return False
    with socket.socket(fileno=mine) as s:  # closes our duplicate only
        s.listen(socket.SOMAXCONN)
    return True


class _Vm:
    """A running QEMU: its serial log (streamed to ``log``), QEMU's own messages, and
    the moments the kernel reported (``serving``, ``drained``)."""

    def __init__(self, cmd: list[str], log) -> None:
        self.log = log
        self.serial: list[str] = []
        self.errors: list[str] = []
        self.serving = threading.Event()
        self.stopping = threading.Event()
        self.drained = threading.Event()
        parent = os.getpid()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE,
                                     preexec_fn=lambda: _detach_and_die_with(parent))
        self.threads = [threading.Thread(target=self._pump_serial, daemon=True),
                        threading.Thread(target=self._pump_stderr, daemon=True)]
        for t in self.threads:
            t.start()

    def _pump_serial(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            self.serial.append(line)
            print(line, file=self.log, flush=True)  # the serial log, streamed as it comes
            if "orisha: serving" in line:
                self.serving.set()
            elif "orisha: stopping" in line:
                self.stopping.set()
            elif "orisha: drained" in line:
                self.drained.set()
        self.serving.set()  # EOF: QEMU is gone; wake the waiters
        self.drained.set()

    def _pump_stderr(self) -> None:
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip()
            self.errors.append(line)
            print(f"qemu: {line}", file=self.log, flush=True)

    def command(self, word: str) -> None:
        """A line on the guest's console (see unikernel/src/main.c)."""
        try:
            self.proc.stdin.write(word.encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # QEMU is gone; the caller sees its exit status
            pass

    def panic(self) -> str | None:
        return next((s for s in self.serial if "PANIC" in s), None)

    def join(self) -> None:
        for t in self.threads:
            t.join(2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def fail(self, why: str) -> None:
        self.kill()
        self.join()
        if not self.serial:
            print("orisha: the serial log is empty", file=self.log, flush=True)
        raise BootError(why)


def _wait_serving(vm: _Vm, stop: threading.Event, started: float) -> None:
    """Until the kernel logs its serving line; a failed boot raises with the reason."""
    while not vm.serving.wait(0.1):
        if stop.is_set():
            vm.fail("interrupted before the kernel was serving")
        if time.monotonic() - started > BOOT_TIMEOUT:
            vm.fail(f"no 'serving' line on the serial console within {BOOT_TIMEOUT:.0f} s")
    if vm.proc.poll() is not None or not any("orisha: serving" in s for s in vm.serial):
        vm.proc.wait()
        vm.join()
        panic = vm.panic()
        qerr = next((e for e in vm.errors if e), None)
        vm.fail("the kernel stopped during boot" + (f": PANIC{panic.split('PANIC', 1)[1]}"
                                                    if panic else f": {qerr}" if qerr
                                                    else f" (QEMU exit status {vm.proc.returncode})"))


def _serve_until_stopped(vm: _Vm, stop: threading.Event, stats: threading.Event) -> None:
    """Until a signal; a kernel that stops by itself raises. ``stats`` set: the guest is
    asked for its stats lines."""
    while not stop.wait(0.2):
        if stats.is_set():
            stats.clear()
            vm.command("stats")
        if vm.proc.poll() is not None:
            vm.join()
            panic = vm.panic()
            raise BootError(f"the kernel stopped (QEMU exit status {vm.proc.returncode})"
                            + (f": {panic.strip()}" if panic else ""))


def _drain(vm: _Vm, grace: float, force: threading.Event) -> None:
    """Stop the guest gracefully (see the module docstring); at most ``grace`` seconds,
    less if a second signal comes."""
    asked = time.monotonic()
    deadline = asked + grace
    vm.command("stop")
    unanswered = True
    while not force.wait(0.05) and time.monotonic() < deadline and vm.proc.poll() is None:
        if vm.drained.is_set() and not forwarding(vm.proc.pid):
            break
        if unanswered and not vm.stopping.is_set() and time.monotonic() - asked > STOP_ANSWER:
            unanswered = False  # the kernel reads its console every 50 ms (main.c)
            print(f"orisha: the kernel has not answered 'stop' within {STOP_ANSWER:.0f} s",
                  file=vm.log, flush=True)
    vm.command("exit")
    try:
        vm.proc.wait(EXIT_TIMEOUT)
    except subprocess.TimeoutExpired:
        print(f"orisha: QEMU did not exit within {EXIT_TIMEOUT:.0f} s of 'exit': killed",
              file=vm.log, flush=True)
        vm.kill()
    vm.join()
    if vm.proc.returncode not in (1, -signal.SIGKILL):  # 1: the guest's exit(0) (isa-debug-exit)
        panic = vm.panic()
        raise BootError(f"the kernel stopped (QEMU exit status {vm.proc.returncode})"
                        + (f": {panic.strip()}" if panic else ""))


def _cores(vm: _Vm) -> int:
    """The cores serving, from the kernel's serving line (``2 cores online``)."""
    line = next((s for s in vm.serial if "orisha: serving" in s), "")
    m = re.search(r"(\d+) cores? online", line)
    return int(m.group(1)) if m else 1


def _guest_address(vm: _Vm) -> str:
    """The guest's own address, from its log (``static address A`` or ``dhcp address A``)."""
    line = next((s for s in vm.serial if re.search(r"orisha: (static|dhcp) address ", s)), "")
    m = re.search(r"address (\d+\.\d+\.\d+\.\d+)", line)
    return m.group(1) if m else "?"


def _serving_line(host: str, port: int, tls: bool, http_port: int | None, manifest: dict,
                  cores: int = 1, tap: bool = False) -> str:
    if tap:  # the guest's own address and ports, no forwards
        urls = f"https://{host}/ and http://{host}/" if tls else f"http://{host}/"
    else:
        urls = f"https://{host}:{port}/" if tls else f"http://{host}:{port}/"
    if http_port and not tap:
        urls += f" and http://{host}:{http_port}/"
    workers = f"{cores} worker" + ("s" if cores > 1 else "")  # a core each, as a worker process
    return (f"orisha: serving {urls} (loop unikernel, {workers}, pid {os.getpid()}): "
            f"{manifest.get('summary', '')}")


def _handle_signals(stop: threading.Event, force: threading.Event,
                    stats: threading.Event) -> dict:
    """SIGTERM/SIGINT: the first sets ``stop`` (drain), a second ``force`` (skip the
    wait); SIGUSR1 sets ``stats``. Returns the handlers they replaced."""
    def on_signal(*_) -> None:
        (force if stop.is_set() else stop).set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, lambda *_: stats.set())
    return old


def boot(out: str, host: str = "127.0.0.1", port: int = 8080, accel: str = "auto",
         memory: int | None = None, limits: Limits | None = None, announce=print,
         log=sys.stderr, http_port: int | None = None, cpus: int = 1, tap: str | None = None,
         address: str | None = None, gateway: str | None = None) -> int:
    """Boot OUT's image; PORT reaches its TLS port when it has one (else port 80),
    ``http_port`` its port 80 beside TLS. ``tap``: on that tap device instead, at
    ``address`` (static, with ``gateway``) or the address DHCP on the tap's side gives;
    PORT and ``http_port`` do not apply there (the guest's own 80 and 443)."""
    limits = limits or Limits()
    check_address(address, gateway, tap)
    if tap:
        check_tap(tap, cpus)
    manifest = _manifest(out)
    image = os.path.join(out, manifest["image"])
    if not os.path.isfile(image):
        raise BootError(f"{image}: missing (rebuild with --target unikernel)")
    tls = bool(manifest.get("tls"))
    if http_port is not None and not tls:
        raise BootError(f"--http-port: {out} serves plain HTTP only, on --port (build it with "
                        "--tls-cert/--tls-key for a TLS port beside it)")
    if tap:
        http_port = None
    accel = resolve_accel(accel)
    memory = memory or guest_megabytes(image, cpus=cpus)
    if port == 0 and not tap:
        port = free_port(host)
    if http_port == 0:
        http_port = free_port(host)
    cmd = qemu_command(image, host, port, accel, memory, cmdline(limits, cpus, address, gateway),
                       guest_port=GUEST_TLS if tls else GUEST_HTTP, http_port=http_port,
                       cpus=cpus, tap=tap)

    stop, force, stats = threading.Event(), threading.Event(), threading.Event()
    old = _handle_signals(stop, force, stats)
    started = time.monotonic()
    vm = None
    try:
        vm = _Vm(cmd, log)
        _wait_serving(vm, stop, started)
        if not tap and not all([widen_backlog(vm.proc.pid, p) for p in (port, http_port) if p]):
            print("orisha: QEMU's port forward keeps its backlog of 1: bursts of new connections "
                  "may wait seconds", file=log, flush=True)
        ms = (time.monotonic() - started) * 1000
        announce(_serving_line(_guest_address(vm) if tap else host, port, tls, http_port, manifest,
                               _cores(vm), bool(tap)))
        sys.stdout.flush()
        print(f"orisha: booted {image} in {ms:.0f} ms ({accel}, {memory} MiB)", file=log, flush=True)
        _serve_until_stopped(vm, stop, stats)
        _drain(vm, limits.grace, force)
        return 0
    finally:
        if vm:
            vm.kill()
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> int:
    """``python3 -m orisha.targets.unikernel.boot --print-command IMAGE PORT``: the
    QEMU command line for an image file, shell-quoted (unikernel/run.sh runs it)."""
    import argparse
    import shlex
    ap = argparse.ArgumentParser(prog="python3 -m orisha.targets.unikernel.boot")
    ap.add_argument("--print-command", action="store_true", required=True)
    ap.add_argument("image")
    ap.add_argument("port", type=int)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--accel", choices=("auto", "kvm", "tcg"), default="auto")
    ap.add_argument("--machine", choices=MACHINES, default="microvm")
    ap.add_argument("--memory", type=int, metavar="MB",
                    help="default: the image's end (bss included) + 1 MiB; pc/q35 + 16, at least 64")
    ap.add_argument("--cpus", type=int, default=1, help="vCPUs (-smp, and orisha.cpus=N)")
    ap.add_argument("--append", default="", help="kernel command line")
    a = ap.parse_args(argv)
    try:
        append = " ".join(filter(None, [cmdline(Limits(), a.cpus), a.append]))
        cmd = qemu_command(a.image, a.host, a.port, resolve_accel(a.accel),
                           a.memory or guest_megabytes(a.image, a.machine, a.cpus), append, a.machine,
                           cpus=a.cpus)
    except (BootError, OSError) as e:
        print(f"orisha: error: {e}", file=sys.stderr)
        return 1
    print(shlex.join(cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
