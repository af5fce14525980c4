"""The image on 1 vCPU against 2 vCPUs over tap, in one run.

    .venv/bin/python bench/unikernel_cores.py [--rounds 3] [--seconds 5] [--conns 16] [--threads 1]

The demo site built with a test certificate (plain HTTP on 80, HTTPS on 443) boots
with `orisha boot --tap NAME --address A/24 --cpus N` on two tap devices this script
makes in the host's namespace (a plain one for 1 vCPU, a multi_queue one for 2: a
queue pair per vCPU) and removes afterwards. wrk (--threads threads, --conns connections,
`Connection: close`: every request a new connection, and over HTTPS a new full
handshake) runs on the host against each, interleaved round by round. Loads: plain HTTP and HTTPS with
`Connection: close`, and HTTPS keep-alive. Printed per load: median req/s, the 2-vCPU /
1-vCPU ratio, and where the host's CPU went in the window: the whole host's busy share,
the client's (wrk's) share of the host, the guest's vCPU threads (ms of vCPU time per
request, and the share of the host), and the guest's own count: its cores' time out of
HLT over the window as TSC cycles per request answered (`orisha boot` logs every core's
stats line on SIGUSR1, before and after each load; polling counts as busy, as it does
for the host).
The client's CPU per request (wrk's user + system time) beside the guest's: on a host
with as many cores as the guest has vCPUs, their sum bounds the rate whatever the vCPUs.
Needs root (tap devices), /dev/net/tun, wrk, QEMU.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from tlsutil import make_pki  # noqa: E402

TAPS = {1: ("obench-c1", "10.78.91", False), 2: ("obench-c2", "10.78.92", True)}
PATH = "/css/site.css"  # 1 KB gzip: handshake- and connection-bound, not bulk


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def host_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole host, from /proc/stat."""
    with open("/proc/stat") as f:
        v = list(map(int, f.readline().split()[1:]))
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def vcpu_seconds(qemu: int) -> float:
    """CPU time of QEMU's vCPU threads (named ``CPU n/KVM`` by debug-threads)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for tid in os.listdir(f"/proc/{qemu}/task"):
        try:
            name = open(f"/proc/{qemu}/task/{tid}/comm").read()
            fields = open(f"/proc/{qemu}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:  # a thread that ended meanwhile
            continue
        if name.startswith("CPU "):
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


LOADS = {"http": ("http", True), "https": ("https", True), "https keep-alive": ("https", False)}


def wrk(url: str, seconds: float, conns: int, threads: int = 1, close: bool = True) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    b0, t0, w0 = *host_busy(), time.monotonic()
    cmd = ["wrk", f"-t{threads}", f"-c{conns}", f"-d{seconds:g}s",
           *(["-H", "Connection: close"] if close else []), "-H", "Accept-Encoding: gzip", url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60).stdout
    b1, t1, wall = *host_busy(), time.monotonic() - w0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    client = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    rps = float(m.group(1)) if m else 0.0
    return {"rps": rps, "host": (b1 - b0) / max(1, t1 - t0),
            "client_ms": client * 1000 / max(1, rps * wall),
            "client": client / (wall * os.cpu_count()), "wall": wall,
            "errors": (errors.group(1) if errors else "") + (f" non-2xx {non2xx.group(1)}" if non2xx else "")}


STATS = re.compile(r"orisha: stats cpu (\d+) connections \d+ requests (\d+) drops \d+ busy_ms \d+ "
                   r"cycles_per_request (\d+)")


class Vm:
    def __init__(self, image: str, cpus: int) -> None:
        tap, net, _ = TAPS[cpus]
        self.cpus, self.log = cpus, []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orisha.cli", "boot", image, "--tap", tap, "--address",
             f"{net}.2/24", "--cpus", str(cpus)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=ROOT)
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        line = self.proc.stdout.readline()
        if "orisha: serving" not in line:
            raise RuntimeError(f"{cpus} vCPU: did not boot: {line!r}")
        self.host = f"{net}.2"
        qemu = subprocess.run(["pgrep", "-P", str(self.proc.pid), "qemu-system"],
                              capture_output=True, text=True).stdout.split()
        self.qemu = int(qemu[0])

    def guest(self) -> tuple[int, int]:
        """(requests answered, busy TSC cycles) of every core so far: SIGUSR1, then each
        core's stats line."""
        seen = len(self.log)
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            cores = {int(m.group(1)): (int(m.group(2)), int(m.group(2)) * int(m.group(3)))
                     for line in self.log[seen:] for m in [STATS.search(line)] if m}
            if len(cores) == self.cpus:
                return sum(r for r, _ in cores.values()), sum(c for _, c in cores.values())
            time.sleep(0.05)
        raise RuntimeError(f"{self.cpus} vCPU: no stats lines after SIGUSR1")

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="wrk's threads")
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("bench/unikernel_cores.py: needs wrk (apt-get install wrk)")
    tmp = tempfile.mkdtemp(prefix="orisha-cores-")
    results: dict[tuple[str, int], list[dict]] = {}
    try:
        pki = make_pki(os.path.join(tmp, "pki"))
        image = os.path.join(tmp, "img")
        subprocess.run([sys.executable, "-m", "orisha.cli", "build", os.path.join(ROOT, "sites", "demo"),
                        "-o", image, "--loop", "unikernel", "--tls-cert", pki.chain, "--tls-key", pki.key],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for tap, net, mq in TAPS.values():
            subprocess.run(["ip", "link", "del", tap], capture_output=True)
            sh("ip", "tuntap", "add", "dev", tap, "mode", "tap", *(["multi_queue"] if mq else []))
            sh("ip", "addr", "add", f"{net}.1/24", "dev", tap)
            sh("ip", "link", "set", tap, "up")
        for rnd in range(args.rounds):
            for cpus in ((1, 2) if rnd % 2 == 0 else (2, 1)):
                vm = Vm(image, cpus)
                try:
                    for load, (scheme, close) in LOADS.items():
                        v0, (n0, c0) = vcpu_seconds(vm.qemu), vm.guest()
                        r = wrk(f"{scheme}://{vm.host}{PATH}", args.seconds, args.conns,
                                args.threads, close)
                        (n1, c1) = vm.guest()
                        r["guest_ms"] = (vcpu_seconds(vm.qemu) - v0) * 1000 / max(1, r["rps"] * r["wall"])
                        r["guest"] = (vcpu_seconds(vm.qemu) - v0) / (r["wall"] * os.cpu_count())
                        r["cycles"] = (c1 - c0) / max(1, n1 - n0)
                        results.setdefault((load, cpus), []).append(r)
                        print(f"round {rnd + 1} {load:16} {cpus} vCPU {r['rps']:>8,.0f} req/s  host busy "
                              f"{r['host']:.0%}  client {r['client']:.0%} ({r['client_ms']:.2f} ms/req)  guest {r['guest']:.0%} "
                              f"({r['guest_ms']:.2f} ms vCPU/req, {r['cycles']:,.0f} guest cycles/req) "
                              f"{r['errors']}", flush=True)
                finally:
                    vm.stop()
    finally:
        for tap, _, _ in TAPS.values():
            subprocess.run(["ip", "link", "del", tap], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    med = lambda proto, cpus, k: statistics.median(r[k] for r in results[(proto, cpus)])  # noqa: E731
    print(f"\n{os.cpu_count()} host cores; wrk -t{args.threads} -c{args.conns}, {PATH}, "
          f"{args.rounds} rounds of {args.seconds:g} s (medians)")
    print("| load | vCPUs | req/s | 2 / 1 vCPU | host busy | client share | client ms/req | "
          "guest share | guest ms/req | guest cycles/req | 2 / 1 vCPU cycles |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for load in LOADS:
        for cpus in (1, 2):
            ratio = f"{med(load, 2, 'rps') / med(load, 1, 'rps'):.2f}×" if cpus == 2 else ""
            cycles = f"{med(load, 2, 'cycles') / med(load, 1, 'cycles'):.2f}×" if cpus == 2 else ""
            print(f"| {load} | {cpus} | {med(load, cpus, 'rps'):,.0f} | {ratio} | "
                  f"{med(load, cpus, 'host'):.0%} | {med(load, cpus, 'client'):.0%} | "
                  f"{med(load, cpus, 'client_ms'):.2f} | "
                  f"{med(load, cpus, 'guest'):.0%} | {med(load, cpus, 'guest_ms'):.2f} | "
                  f"{med(load, cpus, 'cycles'):,.0f} | {cycles} |")


if __name__ == "__main__":
    main()
