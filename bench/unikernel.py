"""The booted image against the epoll loop, in one run.

    .venv/bin/python bench/unikernel.py [--rounds 3] [--seconds 5] [--no-tso]

1. QEMU user networking: `orisha boot` (hostfwd to 127.0.0.1) and `orisha
   serve --loop epoll --workers 1` on loopback, wrk -t1 -c10 on each in
   interleaved rounds.
2. A tap device in a network namespace this script creates (10.77.0.0/24,
   dnsmasq answering the guest's DHCP), QEMU attached to it; the epoll server
   runs in the same namespace; wrk runs there too. Removed afterwards.
Prints a Markdown table of medians and the unikernel/epoll ratios.
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
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from orisha.targets.unikernel.boot import guest_megabytes, qemu_command, resolve_accel  # noqa: E402

NS, TAP, HOST_IP = "orisha-bench", "otap0", "10.77.0.1"
PATHS = {"1 KB css (gzip)": ("/css/site.css", "gzip"), "1.2 MB txt (identity)": ("/files/big.txt", "identity")}


def wrk(url: str, enc: str, seconds: float, ns: bool) -> float:
    cmd = ["wrk", "-t1", "-c10", f"-d{seconds:g}s", "-H", f"Accept-Encoding: {enc}", url]
    if ns:
        cmd = ["ip", "netns", "exec", NS, *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60).stdout
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))


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
        start([sys.executable, "-m", "orisha.cli", "boot", img, "--port", str(up)])
        start([sys.executable, "-m", "orisha.cli", "serve", host_build, "--port", str(ep), "--workers", "1"])
        wait_http("127.0.0.1", up, False)
        wait_http("127.0.0.1", ep, False)
        for label, (path, enc) in PATHS.items():
            for rnd in range(args.rounds):
                order = [("unikernel (user net)", up), ("epoll (loopback)", ep)]
                for name, port in (order if rnd % 2 == 0 else order[::-1]):
                    r = wrk(f"http://127.0.0.1:{port}{path}", enc, args.seconds, False)
                    results.setdefault(f"user|{label}|{name}", []).append(r)
                    print(f"user net  {label:22} {name:22} {r:>9,.0f} req/s", flush=True)
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
        vm = start(cmd, ns=True)
        guest = None
        end = time.monotonic() + 60
        while guest is None and time.monotonic() < end:
            line = vm.stdout.readline()
            m = re.search(r"(\d+\.\d+\.\d+\.\d+)", line) if "dhcp" in line.lower() or "address" in line.lower() \
                else None
            if m and m.group(1) != "0.0.0.0":
                guest = m.group(1)
        assert guest, "the guest reported no DHCP address"
        start([sys.executable, "-m", "orisha.cli", "serve", host_build, "--host", HOST_IP, "--port", "8080",
               "--workers", "1"], ns=True)
        wait_http(guest, 80, True)
        wait_http(HOST_IP, 8080, True)
        for label, (path, enc) in PATHS.items():
            for rnd in range(args.rounds):
                order = [("unikernel (tap)", f"http://{guest}{path}"), ("epoll (netns)", f"http://{HOST_IP}:8080{path}")]
                for name, url in (order if rnd % 2 == 0 else order[::-1]):
                    r = wrk(url, enc, args.seconds, True)
                    results.setdefault(f"tap|{label}|{name}", []).append(r)
                    print(f"tap       {label:22} {name:22} {r:>9,.0f} req/s", flush=True)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(p.pid, signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", NS], stderr=subprocess.DEVNULL)
        shutil.rmtree(tmp, ignore_errors=True)
    lines = ["| network | document | server | req/s (median) | unikernel / epoll |", "|---|---|---|---|---|"]
    for key in results:
        net, label, name = key.split("|")
        med = statistics.median(results[key])
        others = [statistics.median(v) for k, v in results.items()
                  if k.startswith(f"{net}|{label}|") and k != key]
        ratio = f"{med / others[0]:.3f}×" if name.startswith("unikernel") and others else ""
        lines.append(f"| {net} | {label} | {name} | {med:,.0f} | {ratio} |")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
