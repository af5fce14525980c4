"""The booted image against the epoll loop, in one run.

    .venv/bin/python bench/unikernel.py [--rounds 3] [--seconds 5] [--cpus 1] [--no-tso]

1. QEMU user networking: `orisha boot` (hostfwd to 127.0.0.1) and `orisha
   serve --loop epoll --workers 1` on loopback, wrk -t1 -c10 on each in
   interleaved rounds.
2. A tap device in a network namespace this script creates (10.77.0.0/24,
   dnsmasq answering the guest's DHCP), QEMU attached to it; the epoll server
   runs in the same namespace; wrk runs there too. Removed afterwards.
Prints a Markdown table of medians and the unikernel/epoll ratios, with each
server's CPU time per request (utime+stime of the server's process and every
descendant, from /proc, over the timed run: for the image, QEMU's vCPU and I/O
threads) and how busy wrk kept its core (its own CPU over the wall time).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from orisha.targets.unikernel.boot import guest_megabytes, qemu_command, resolve_accel  # noqa: E402

NS, TAP, HOST_IP = "orisha-bench", "otap0", "10.77.0.1"
PATHS = {"1 KB css (gzip)": ("/css/site.css", "gzip"), "1.2 MB txt (identity)": ("/files/big.txt", "identity")}


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of pid and all its descendants, threads included."""
    stats = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # exited while listing
                continue
            stats[int(d)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, ticks
    tree, ticks = {pid}, 0
    for _ in range(8):  # depth: orisha boot -> qemu; ip netns exec execs in place
        tree |= {p for p, (pp, _) in stats.items() if pp in tree}
    ticks = sum(stats[p][1] for p in tree if p in stats)
    return ticks / os.sysconf("SC_CLK_TCK")


def wrk(url: str, enc: str, seconds: float, ns: bool, server: int) -> dict:
    cmd = ["wrk", "-t1", "-c10", f"-d{seconds:g}s", "-H", f"Accept-Encoding: {enc}", url]
    if ns:
        cmd = ["ip", "netns", "exec", NS, *cmd]
    before, start = tree_cpu(server), time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    guard = threading.Timer(seconds + 60, p.kill)  # bounded even if wrk hangs
    guard.start()
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)  # wrk's own CPU (ip netns exec execs it in place)
    p.returncode = os.waitstatus_to_exitcode(status)
    guard.cancel()
    wall = time.monotonic() - start
    cpu = tree_cpu(server) - before
    n = int(re.search(r"(\d+) requests in", out).group(1))
    return {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
            "cpu_us": cpu / max(n, 1) * 1e6,
            "wrk_busy": (usage.ru_utime + usage.ru_stime) / wall}


def wait_http(host: str, port: int, ns: bool, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    probe = ["curl", "-s", "-o", "/dev/null", "-m", "2", f"http://{host}:{port}/"]
    while time.monotonic() < end:
        cmd = ["ip", "netns", "exec", NS, *probe] if ns else probe
        if subprocess.run(cmd).returncode == 0:
            return
        time.sleep(0.1)
    raise RuntimeError(f"nothing answers on {host}:{port}")


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--cpus", type=int, default=1,
                    help="the image's vCPUs under user networking (orisha boot --cpus)")
    ap.add_argument("--no-tso", action="store_true",
                    help="the guest leaves TCP segments ungathered on the tap (orisha.tso=off)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="orisha-uk-")
    demo = os.path.join(ROOT, "sites", "demo")
    img, host_build = os.path.join(tmp, "img"), os.path.join(tmp, "host")
    for out, extra in ((img, ["--loop", "unikernel"]), (host_build, ["--loop", "epoll"])):
        subprocess.run([sys.executable, "-m", "orisha.cli", "build", demo, "-o", out, *extra], check=True,
                       cwd=ROOT, stdout=subprocess.DEVNULL)
    results: dict[str, list[float]] = {}
    procs: list[subprocess.Popen] = []

    def start(cmd, ns=False):
        if ns:
            cmd = ["ip", "netns", "exec", NS, *cmd]
        # stdin: QEMU's serial input is the guest's console (a stray "stop" would drain it)
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, start_new_session=True, cwd=ROOT)
        procs.append(p)
        return p

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    try:
        # 1. user networking vs loopback
        up, ep = free_port(), free_port()
        uk = start([sys.executable, "-m", "orisha.cli", "boot", img, "--port", str(up),
                    "--cpus", str(args.cpus)])
        hosted = start([sys.executable, "-m", "orisha.cli", "serve", host_build, "--port", str(ep),
                        "--workers", "1"])
        wait_http("127.0.0.1", up, False)
        wait_http("127.0.0.1", ep, False)
        for label, (path, enc) in PATHS.items():
            for rnd in range(args.rounds):
                order = [("unikernel (user net)", up, uk), ("epoll (loopback)", ep, hosted)]
                for name, port, proc in (order if rnd % 2 == 0 else order[::-1]):
                    r = wrk(f"http://127.0.0.1:{port}{path}", enc, args.seconds, False, proc.pid)
                    results.setdefault(f"user|{label}|{name}", []).append(r)
                    show("user net", label, name, r)
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(20)
        procs.clear()

        # 2. a tap device in a namespace of our own
        sh("ip", "netns", "add", NS)
        sh("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")
        sh("ip", "netns", "exec", NS, "ip", "tuntap", "add", "dev", TAP, "mode", "tap")
        sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"{HOST_IP}/24", "dev", TAP)
        sh("ip", "netns", "exec", NS, "ip", "link", "set", TAP, "up")
        leases = os.path.join(tmp, "leases")
        start(["dnsmasq", "--no-daemon", "--port=0", f"--interface={TAP}", "--bind-interfaces",
               "--dhcp-range=10.77.0.10,10.77.0.10,1h", f"--dhcp-leasefile={leases}"], ns=True)
        image = os.path.join(img, "orisha.img")
        # orisha boot's command line (the one copy), its user networking swapped for the tap
        cmd = qemu_command(image, "127.0.0.1", 0, resolve_accel("auto"), guest_megabytes(image),
                           "orisha.tso=off" if args.no_tso else "")
        cmd[cmd.index("-netdev") + 1] = f"tap,id=n0,ifname={TAP},script=no,downscript=no"
        vm = uk = start(cmd, ns=True)
        guest = None
        end = time.monotonic() + 60
        while guest is None and time.monotonic() < end:
            line = vm.stdout.readline()
            m = re.search(r"(\d+\.\d+\.\d+\.\d+)", line) if "dhcp" in line.lower() or "address" in line.lower() \
                else None
            if m and m.group(1) != "0.0.0.0":
                guest = m.group(1)
        assert guest, "the guest reported no DHCP address"
        hosted = start([sys.executable, "-m", "orisha.cli", "serve", host_build, "--host", HOST_IP,
                        "--port", "8080", "--workers", "1"], ns=True)
        wait_http(guest, 80, True)
        wait_http(HOST_IP, 8080, True)
        for label, (path, enc) in PATHS.items():
            for rnd in range(args.rounds):
                order = [("unikernel (tap)", f"http://{guest}{path}", uk),
                         ("epoll (netns)", f"http://{HOST_IP}:8080{path}", hosted)]
                for name, url, proc in (order if rnd % 2 == 0 else order[::-1]):
                    r = wrk(url, enc, args.seconds, True, proc.pid)
                    results.setdefault(f"tap|{label}|{name}", []).append(r)
                    show("tap", label, name, r)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(p.pid, signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", NS], stderr=subprocess.DEVNULL)
        shutil.rmtree(tmp, ignore_errors=True)
    lines = ["| network | document | server | req/s (median) | unikernel / epoll | server CPU µs/req "
             "| unikernel / epoll CPU | wrk busy |", "|---|---|---|---|---|---|---|---|"]

    def med(key: str, what: str) -> float:
        return statistics.median(r[what] for r in results[key])

    for key in results:
        net, label, name = key.split("|")
        rps, cpu = med(key, "rps"), med(key, "cpu_us")
        other = next((k for k in results if k.startswith(f"{net}|{label}|") and k != key), None)
        ratio = f"{rps / med(other, 'rps'):.3f}×" if name.startswith("unikernel") and other else ""
        cratio = f"{cpu / med(other, 'cpu_us'):.2f}×" if name.startswith("unikernel") and other else ""
        lines.append(f"| {net} | {label} | {name} | {rps:,.0f} | {ratio} | {cpu:,.1f} | {cratio} "
                     f"| {med(key, 'wrk_busy'):.2f} |")
    print("\n" + "\n".join(lines))
    print(f"\nThe image: --cpus {args.cpus} (user networking), 1 vCPU on the tap; the epoll "
          "server: one worker. Server CPU: utime+stime of the server's process tree over the "
          "run (QEMU's every thread for the image). wrk busy: wrk's CPU over the wall time "
          "(1.00: its core saturated).")


def show(net: str, label: str, name: str, r: dict) -> None:
    print(f"{net:9} {label:22} {name:22} {r['rps']:>9,.0f} req/s {r['cpu_us']:>8,.1f} µs/req "
          f"wrk busy {r['wrk_busy']:.2f}", flush=True)


if __name__ == "__main__":
    main()
