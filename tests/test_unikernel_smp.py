"""The image on more than one core: ``orisha boot OUT --cpus N``.

``--cpus`` is read by its range in ``core/policy.py`` like every numeric option;
QEMU gets ``-smp N`` and, since microvm has no ACPI (no MADT to find the
application processors in), the kernel gets ``orisha.cpus=N`` on its command line
and starts them with INIT-SIPI-SIPI (unikernel/src/smp.c). The serving line says
how many came online.
"""

from __future__ import annotations

import shutil

import pytest
from conftest import DEMO, orisha

from orisha.core.policy import RANGES
from orisha.targets.unikernel.boot import cmdline, qemu_command

pytestmark = pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                                reason="apt-get install qemu-system-x86")


@pytest.mark.parametrize("value", ["0", str(RANGES["cpus"].high + 1), "-1", "two"])
def test_a_cpu_count_outside_the_range_is_refused_in_one_line(value):
    r = orisha("boot", DEMO, "--port", "0", "--cpus", value, timeout=60)
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and r.stdout == "" and len(lines) == 1, r.stderr
    what = "not an integer" if value == "two" else "out of range"
    assert lines[0].startswith("orisha: error: --cpus ") and value in lines[0] and what in lines[0], lines
    assert f"(expected {RANGES['cpus'].text()})" in lines[0]


def test_qemu_gets_smp_and_the_kernel_the_count():
    from orisha.core.policy import Limits
    one = qemu_command("k.img", "127.0.0.1", 8080, "tcg", 64, cmdline(Limits()))
    assert one[one.index("-smp") + 1] == "1" and "-append" not in one
    four = qemu_command("k.img", "127.0.0.1", 8080, "tcg", 64, cmdline(Limits(), 4), cpus=4)
    assert four[four.index("-smp") + 1] == "4"
    assert "orisha.cpus=4" in four[four.index("-append") + 1].split()
