"""The container target for the test suite: build, `docker build`, `docker run`.

``start(site_dir, build_opts, limit_opts)`` builds the site with
``orisha build --target container`` (once per option set, in a temporary folder),
builds the FROM-scratch image from the top-level Dockerfile, runs it as uid 65534
publishing on 127.0.0.1 only (a port docker picks), waits for the first response
and returns a handle with ``.port``, ``.line`` (the start-up line from
``docker logs``), ``.container`` and ``.stop()``.

``ensure_docker()`` starts dockerd when ``docker info`` fails (``./dev test`` does it
first; this covers running pytest by hand); it skips when docker is not installed.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILE = os.path.join(ROOT, "Dockerfile")
_WORK = tempfile.mkdtemp(prefix="orisha-container-tests-")
_built: dict[tuple, tuple[str, str]] = {}


def docker(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode:
        raise RuntimeError(f"docker {' '.join(args[:3])} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def ensure_docker() -> None:
    import pytest
    if shutil.which("docker") is None:
        pytest.skip("docker is not installed (apt-get install docker.io; ./dev test does)")
    if subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        return
    if shutil.which("dockerd") is None:
        pytest.skip("dockerd is not installed")
    log = open(os.path.join(_WORK, "dockerd.log"), "ab")
    subprocess.Popen(["dockerd"], stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 60
    while subprocess.run(["docker", "info"], capture_output=True).returncode:
        if time.monotonic() > deadline:
            raise RuntimeError(f"dockerd did not come up; see {log.name}")
        time.sleep(0.5)


def build(site_dir: str, build_opts: list[str]) -> tuple[str, str]:
    """(build folder, image tag) for the site with these options; built once per session."""
    key = (site_dir, tuple(build_opts))
    if key not in _built:
        ensure_docker()
        h = hashlib.blake2b(repr(key).encode(), digest_size=6).hexdigest()
        out = os.path.join(_WORK, h)
        from conftest import with_build_args
        r = subprocess.run([sys.executable, "-m", "orisha.cli", "build", site_dir, "-o", out,
                            "--target", "container", *with_build_args(build_opts)],
                           capture_output=True, text=True, cwd=ROOT, timeout=1200)
        if r.returncode:
            raise RuntimeError(f"orisha build --target container failed: {r.stderr}")
        tag = f"orisha-test-{h}:{os.getpid()}"
        docker("build", "-q", "-f", DOCKERFILE, "-t", tag, out)
        _built[key] = (out, tag)
    return _built[key]


def _first_response(port: int, container: str, patience: float, tls=None) -> None:
    """Wait for an HTTP/1.1 answer on ``port`` (over TLS with the ``ssl.SSLContext`` tls) from
    ``container``. The wait is for a condition: it ends early, with an error, when the
    container has exited; ``patience`` only bounds a container that runs and never answers
    (its start-up costs ~0.5 s of CPU, stretched many times over on a loaded host)."""
    import ssl
    deadline = time.monotonic() + patience
    checked = time.monotonic()
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as raw:
                s = tls.wrap_socket(raw, server_hostname="localhost") if tls else raw
                s.sendall(b"HEAD / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
                if s.recv(16).startswith(b"HTTP/1.1 "):
                    return
        except (OSError, ssl.SSLError):  # not listening yet (or no certificate yet: ACME)
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the container runs and did not answer within {patience:.0f} s")
        if time.monotonic() - checked > 1:
            checked = time.monotonic()
            if not running(container):
                raise RuntimeError("the container exited before it answered")
        time.sleep(0.005)


def running(container: str) -> bool:
    r = docker("inspect", "-f", "{{.State.Running}}", container, check=False)
    return r.stdout.strip() == "true"


def exit_code(container: str) -> str:
    """A stopped container's exit status (137: SIGKILLed), or why there is none."""
    r = docker("inspect", "-f", "{{.State.ExitCode}}", container, check=False)
    return r.stdout.strip() or r.stderr.strip()


def wait_answering(container: str, port: int, patience: float = 120, tls=None) -> None:
    """``_first_response`` for a container started elsewhere (``docker run`` by hand)."""
    _first_response(port, container, patience, tls)


class Container:
    """``docker run -d`` of ``tag``, publishing ``publish`` (container ports such as
    ``8080/tcp``, ``8080/udp``) on 127.0.0.1 at ports docker picks (``.ports`` maps each to
    its host port; ``.port`` is the first). ``port=N`` instead runs it in the host's network
    namespace (``--network host``: it reaches servers on the host's loopback, such as a CA)
    listening on 127.0.0.1:N. ``tls``: an ``ssl.SSLContext`` for the readiness probe."""

    def __init__(self, tag: str, args: list[str], user: str = "65534", run_args=(),
                 publish=("8080/tcp",), port: int | None = None, tls=None,
                 ready: float = 120) -> None:
        started = time.monotonic()
        if port is None:
            net = [a for p in publish for a in ("-p", f"127.0.0.1:0:{p}")]
        else:  # the image's ADMIN_PORT would listen on the host's 0.0.0.0:9090: off
            net = ["--network", "host", "-e", "ADMIN_PORT=0"]
            args = [*args, "--host", "127.0.0.1", "--port", str(port)]
        # No --rm: .stop() reads the exit status, then removes the container.
        self.container = docker("run", "-d", *net, "--user", user,
                                *run_args, tag, *args).stdout.strip()
        try:
            if port is None:
                self.ports = {p: int(docker("port", self.container, p).stdout.split()[0]
                                     .rsplit(":", 1)[1]) for p in publish}
                self.port = self.ports[publish[0]]
            else:
                self.ports, self.port = {}, port
            _first_response(self.port, self.container, ready, tls)
        except BaseException:
            self.logs = docker("logs", self.container, check=False)
            docker("rm", "-f", self.container, check=False)
            raise RuntimeError(f"container failed: {self.logs.stdout}{self.logs.stderr}") from None
        self.startup = time.monotonic() - started  # docker run → first response
        # The start-up line: docker's log may take it in after the first answer went out.
        deadline = time.monotonic() + ready
        while not (out := self.logs()[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.line = (out.splitlines() or [""])[0]
        self.stopped = None

    def logs(self) -> tuple[str, str]:
        r = docker("logs", self.container, check=False)
        return r.stdout, r.stderr

    def stop(self, timeout: float = 30, check: bool = True) -> float:
        """docker stop: SIGTERM, and docker's SIGKILL only after ``timeout`` s (above the
        server's own bound: in-flight responses get --grace, 8 s, and a worker still there
        2 s later is killed by the server). Returns how long it took; with ``check``, asserts
        that the SIGTERM ended it: exit status 0, not docker's SIGKILL (137)."""
        if self.stopped is None:
            t = time.monotonic()
            docker("stop", "-t", str(int(timeout)), self.container, timeout=timeout + 60)
            self.stopped = time.monotonic() - t
            status = exit_code(self.container)
            docker("rm", "-f", self.container, check=False)
            assert not check or status == "0", \
                f"the container exited with {status} after a {self.stopped:.1f} s docker stop"
        return self.stopped

    # The conftest teardown calls .proc.kill() if .stop() raised.
    @property
    def proc(self):
        return self

    def kill(self) -> None:
        docker("rm", "-f", self.container, check=False)


def pod_constraints() -> tuple[str, list[str]]:
    """(user, docker run options) that impose what deploy/kubernetes/base/deployment.yaml asks of
    the pod: its user, read-only root, the /tmp volume, no capabilities or privilege
    escalation, its CPU and memory limits, and the worker count it derives from them."""
    import yaml
    with open(os.path.join(ROOT, "deploy", "kubernetes", "base", "deployment.yaml")) as f:
        pod = yaml.safe_load(f)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    sec, csec, limits = pod["securityContext"], c["securityContext"], c["resources"]["limits"]
    mib = lambda q: int(q.removesuffix("Mi"))  # noqa: E731 (the manifests use Mi)
    opts = ["--cap-drop", "ALL"] if csec["capabilities"]["drop"] == ["ALL"] else []
    if not csec["allowPrivilegeEscalation"]:
        opts += ["--security-opt", "no-new-privileges"]
    if csec["readOnlyRootFilesystem"]:
        opts.append("--read-only")
    volumes = {v["name"]: v for v in pod["volumes"]}
    for m in c["volumeMounts"]:
        empty = volumes[m["name"]]["emptyDir"]  # emptyDir is mounted exec, as --tmpfs exec is
        opts += ["--tmpfs", f"{m['mountPath']}:rw,exec,nosuid,nodev,size={mib(empty['sizeLimit'])}m"]
    cpu = str(limits["cpu"])
    cores = float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
    opts += ["--memory", f"{mib(limits['memory'])}m", "--cpus", f"{cores:g}"]
    for e in c.get("env", []):
        ref = e.get("valueFrom", {}).get("resourceFieldRef", {})
        # the kubelet rounds a resourceFieldRef up to its divisor (here: whole cores)
        value = str(math.ceil(cores)) if ref.get("resource") == "limits.cpu" else e["value"]
        opts += ["-e", f"{e['name']}={value}"]
    return f"{sec['runAsUser']}:{sec['runAsGroup']}", opts


def init_pid(container: str) -> int:
    """The host pid of the container's PID 1."""
    return json.loads(docker("inspect", container).stdout)[0]["State"]["Pid"]


def namespace_processes(init: int) -> list[tuple[int, int, str, str]]:
    """(host pid, host ppid, state, command line) of every process in the PID namespace whose
    PID 1 is host pid ``init``, zombies included (``docker top`` reads the cgroup, which a
    zombie has left)."""
    ns = os.readlink(f"/proc/{init}/ns/pid")
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{name}/ns/pid") != ns:
                continue
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile
            continue
        found.append((int(name), int(fields[1]), fields[0], cmd))
    return sorted(found)


@atexit.register
def _cleanup() -> None:
    for _, tag in _built.values():
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)
    shutil.rmtree(_WORK, ignore_errors=True)


def start(site_dir: str, build_opts: list[str], limit_opts: list[str], args=()) -> Container:
    _, tag = build(site_dir, build_opts)
    return Container(tag, [*limit_opts, "--workers", "2", *args])


def measure(tags: list[str], rounds: int) -> None:
    """Interleaved rounds over ``tags``: docker run → first response, the CPU the container
    used up to then (cgroup v1 cpuacct; does not depend on how busy the host is), docker stop."""
    results = {t: {"run": [], "cpu": [], "stop": []} for t in tags}
    for _ in range(rounds):
        for tag in tags:
            t = time.monotonic()
            c = Container(tag, [])
            cpu = f"/sys/fs/cgroup/cpuacct/docker/{c.container}/cpuacct.usage"
            results[tag]["run"].append(time.monotonic() - t)
            if os.path.exists(cpu):
                with open(cpu) as f:
                    results[tag]["cpu"].append(int(f.read()) / 1e9)
            results[tag]["stop"].append(c.stop(check=False))
            time.sleep(0.2)
    for tag, m in results.items():
        size = json.loads(docker("image", "inspect", tag).stdout)[0]["Size"]
        print(f"{tag}: image {size:,} B")
        for what, xs in m.items():
            if xs:
                xs = sorted(xs)
                print(f"  {what:5} min {xs[0] * 1000:4.0f}  median {xs[len(xs) // 2] * 1000:4.0f}  "
                      f"max {xs[-1] * 1000:4.0f} ms")


if __name__ == "__main__":
    # python tests/container_target.py ROUNDS TAG...   (the README's start-up figures)
    measure(sys.argv[2:], int(sys.argv[1]))
