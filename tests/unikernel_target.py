"""The booted unikernel as a conformance target.

``boot(site, build_opts, limit_opts)`` builds SITE with ``--target unikernel``
into a temporary directory and starts ``orisha boot OUT --port 0`` with the
limits; the object it returns looks like conftest's ``Server`` (``port``,
``line``, ``proc``, ``stop()``). A boot that fails raises with the serial log.
``ORISHA_TEST_CPUS=N`` boots every such image with ``--cpus N``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from conftest import Server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def with_test_cpus(opts) -> list[str]:
    """``ORISHA_TEST_CPUS=2``: every image the suites boot gets that many vCPUs (``orisha
    boot --cpus``), so the conformance, hostile and TLS suites run on more cores too."""
    cpus = os.environ.get("ORISHA_TEST_CPUS")
    return [*opts, "--cpus", cpus] if cpus and "--cpus" not in opts else list(opts)


class Booted:
    def __init__(self, out: str, limit_opts: list[str], tmp: str | None = None) -> None:
        self.tmp = tmp
        self.log: list[str] = []
        limit_opts = with_test_cpus(limit_opts)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orisha.cli", "boot", out, "--port", "0", *limit_opts],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        # The serial log streams to stderr for as long as the VM runs: drain it so a
        # chatty kernel never blocks on a full pipe, and keep it for error messages.
        self._drain = threading.Thread(target=self._read_log, daemon=True)
        self._drain.start()
        line = self.proc.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        if not m:
            self.proc.wait(30)
            self._drain.join(5)
            self._cleanup()
            raise RuntimeError(f"unikernel did not boot (exit {self.proc.returncode}): {line!r}\n"
                               + "\n".join(self.log))
        self.line = line
        self.port = int(m.group(1))

    def _read_log(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line.rstrip("\n"))

    def stop(self, sig=signal.SIGTERM, timeout: float = 20) -> int:
        try:
            return Server.stop(self, sig, timeout)
        finally:
            self._drain.join(5)  # the serial log to its end (what the stop logged)
            self._cleanup()

    def _cleanup(self) -> None:
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


def build(site_dir: str, build_opts: list[str], out: str) -> None:
    from conftest import with_build_args
    r = subprocess.run([sys.executable, "-m", "orisha.cli", "build", site_dir, "-o", out,
                        "--target", "unikernel", *with_build_args(build_opts)],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"unikernel build failed: {r.stderr.strip()}")


def boot(site_dir: str, build_opts: list[str], limit_opts: list[str]) -> Booted:
    tmp = tempfile.mkdtemp(prefix="orisha-unikernel-")
    out = os.path.join(tmp, "out")
    try:
        build(site_dir, build_opts, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Booted(out, limit_opts, tmp)
