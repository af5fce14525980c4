"""Every numeric option refuses a value outside its range with one line (issue 34).

The ranges are written once, in orisha/core/policy.py (``RANGES`` and each ``Limit``'s
``range``); click, the container's argparse and the kernel command line read them there.
The options are found by walking the click commands, so a numeric option added without a
range fails here rather than wrapping ``--port 80000`` to 14464 again. Each bad value runs
the real CLI (a subprocess) on a path that does not exist: a check that did not fire would
end in another error, never in a server left running.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess

import click
import pytest

from conftest import DEMO, ROOT, orisha

COMMANDS = ("build", "serve", "boot", "health")


def _numeric_options():
    from orisha import cli
    out = []
    for name in COMMANDS:
        for p in cli.main.commands[name].params:
            if isinstance(p, click.Option) and not p.is_flag and not isinstance(p.type, click.Choice) \
                    and (isinstance(p.type, (click.types._NumberParamTypeBase, cli._Ranged))):
                out.append((name, p))
    return out


def test_every_numeric_option_has_its_range_from_the_policy():
    from orisha import cli
    from orisha.core.policy import LIMITS, RANGES
    options = _numeric_options()
    assert {p.opts[0] for _, p in options} >= {"--port", "--workers", "--memory", "--timeout",
                                               *(f"--{limit.flag}" for limit in LIMITS)}
    for name, p in options:
        assert isinstance(p.type, cli._Ranged), f"orisha {name} {p.opts[0]}: no range"
        flag = p.opts[0][2:]
        want = next((limit.range for limit in LIMITS if limit.flag == flag), None) or RANGES[flag]
        assert p.type.range is want, (name, flag)


def _bad_values(r):
    below = r.low - (1 if r.kind is int else 0.0005)
    above = str(r.high + 1) if r.kind is int else f"{r.high + 1}"
    return [str(below) if r.kind is int else f"{below:.4f}", above, "1_0", "abc",
            "nan" if r.kind is float else "0x10"]


def _cases():
    cases = []
    for name, p in _numeric_options():
        target = "http://127.0.0.1:9/" if name == "health" else os.path.join(ROOT, "no-such-thing")
        for v in _bad_values(p.type.range):
            args = [name, target, p.opts[0], v] + (["-o", "/nonexistent/out"] if name == "build" else [])
            cases.append((p.opts[0], p.type.range, v, args))
    return cases


def test_out_of_range_values_get_one_line_naming_the_option_and_its_range():
    cases = _cases()
    assert len(cases) > 60
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda c: orisha(*c[3], timeout=60), cases))
    for (flag, r, value, args), res in zip(cases, results):
        lines = res.stderr.splitlines()
        assert res.returncode == 2 and len(lines) == 1 and res.stdout == "", (args, res.stderr)
        assert lines[0].startswith(f"orisha: error: {flag} "), (args, lines)
        assert f"(expected {r.text()})" in lines[0], (args, lines)
        assert "Traceback" not in res.stderr


@pytest.mark.parametrize("args, line", [
    (["serve", DEMO, "--port", "80000"], "orisha: error: --port 80000: out of range (expected 0–65535)"),
    (["serve", DEMO, "--admin-port", "70000"], "orisha: error: --admin-port 70000: out of range (expected 0–65535)"),
    (["serve", DEMO, "--http-port", "99999"], "orisha: error: --http-port 99999: out of range (expected 0–65535)"),
    (["serve", DEMO, "--workers", "0"], "orisha: error: --workers 0: out of range (expected 1–1024)"),
    (["serve", DEMO, "--workers", "-3"], "orisha: error: --workers -3: out of range (expected 1–1024)"),
    (["serve", DEMO, "--port", "-1"], "orisha: error: --port -1: out of range (expected 0–65535)"),
    (["serve", DEMO, "--max-connections", "0"], "orisha: error: --max-connections 0: out of range (expected 1–1048576)"),
    (["serve", DEMO, "--idle-timeout", "-1"], "orisha: error: --idle-timeout -1: out of range (expected 0.001–86400.0)"),
    (["serve", DEMO, "--head-limit", "0"], "orisha: error: --head-limit 0: out of range (expected 64–1048576)"),
    (["serve", DEMO, "--pipeline", "0"], "orisha: error: --pipeline 0: out of range (expected 1–1024)"),
], ids=lambda a: " ".join(a) if isinstance(a, list) else None)
def test_what_a_new_user_tried_on_a_real_site(args, line):
    """The issue's list, on the demo site itself: each refused before anything is built or bound."""
    r = orisha(*args, timeout=60)
    assert (r.returncode, r.stderr, r.stdout) == (2, line + "\n", "")


def test_the_container_takes_the_same_ranges():
    from orisha.targets.container.runtime import parser
    p = parser()
    for args in (["--head-limit", "0"], ["--port", "65536"], ["--http-port", "65536"],
                 ["--admin-port", "-1"], ["--workers", "2000"], ["--hsts", "-1"]):
        with pytest.raises(SystemExit):  # the last four were plain ints before the one table
            p.parse_args(args)
    a = p.parse_args(["--head-limit", "64", "--idle-timeout", "0.5", "--port", "0"])
    assert (a.head, a.idle_timeout, a.port) == (64, 0.5, 0)


def test_orisha_serve_and_the_container_read_one_table_of_options():
    """Every option of orisha/serving/options.py SERVE is an option of `orisha serve` and,
    unless it builds a site, of the container's executable, under the same name; the
    container's variable sets it, and a flag given overrides the variable."""
    from click.testing import CliRunner

    from orisha.cli import main
    from orisha.serving.options import SERVE
    from orisha.targets.container.runtime import parser
    serve_help = CliRunner().invoke(main, ["serve", "--help"], terminal_width=200).output
    actions = {a.option_strings[0]: a for a in parser()._actions if a.option_strings}
    for o in SERVE:
        assert f"--{o.flag}" in serve_help, o.flag
        assert (f"--{o.flag}" in actions) == o.container, o.flag
        if o.container:
            assert actions[f"--{o.flag}"].dest == o.attr
    env = {"HOST": "10.0.0.1,::", "TLS_CERT": "/c/a.pem", "QUIC_RETRY": "1", "HTTP3": "0",
           "ADMIN_PORT": "0", "ACCESS_LOG": "-", "LOOP": "epoll"}
    saved = dict(os.environ)
    try:
        os.environ.update(env)
        a = parser().parse_args(["--tls-cert", "/c/b.pem", "--tls-cert", "/c/c.pem"])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert (a.hosts, a.tls_cert, a.quic_retry, a.http3, a.admin_port, a.access_log, a.loop) == (
        ["10.0.0.1", "::"], ["/c/b.pem", "/c/c.pem"], True, False, None, "-", "epoll")


def test_the_kernel_header_carries_the_ranges():
    """The C core reads the same ranges (policy.h's POLICY_LIMIT_RANGES, scaled as the
    limits are) and keeps a default over a value outside them (unikernel/src/http.c)."""
    from orisha.core.policy import LIMITS
    from orisha.targets.unikernel import policy_header
    text = "\n".join(policy_header._limits())
    for limit in LIMITS:
        if not limit.kernel:
            continue
        scale = 1000 if isinstance(limit.default, float) else 1
        assert re.search(rf"X\({limit.attr}, {round(limit.range.low * scale)}ull, "
                         rf"{round(limit.range.high * scale)}ull\)", text), limit.attr
    src = open(os.path.join(ROOT, "unikernel", "src", "http.c")).read()
    assert "POLICY_LIMIT_RANGES(LIMIT_BOUNDS)" in src and "within(#name" in src


@pytest.mark.slow
def test_the_kernel_keeps_its_default_over_an_out_of_range_command_line(tmp_path):
    """A hand-written kernel command line (unikernel/run.sh --append) with values outside
    the policy's ranges: the booted image says so on its console, keeps its defaults and
    serves (a 10-byte head limit would answer every request 431)."""
    import socket
    import time
    from orisha.targets.unikernel.boot import qemu_command, resolve_accel, guest_megabytes
    out = str(tmp_path / "img")
    r = orisha("build", DEMO, "-o", out, "--target", "unikernel")
    assert r.returncode == 0, r.stderr
    image = os.path.join(out, "orisha.img")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = qemu_command(image, "127.0.0.1", port, resolve_accel("auto"), guest_megabytes(image),
                       "orisha.head=10 orisha.idle_timeout=0 orisha.target=4000")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            log.append(line)
            if "serving" in line or not line:
                break
        text = "".join(log)
        assert "ignoring out-of-range option orisha.head (expected 64 to 1048576" in text, text
        assert "ignoring out-of-range option orisha.idle_timeout (expected 1 to 86400000" in text, text
        assert "orisha.target" not in text  # in range: taken

        def status(target: bytes) -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
                c.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nUser-Agent: "
                          + b"a" * 100 + b"\r\nConnection: close\r\n\r\n")
                return c.recv(64)[:12]
        assert status(b"/") == b"HTTP/1.1 200"  # a head over 10 bytes: the default kept
        assert status(b"/" + b"x" * 4050) == b"HTTP/1.1 414"  # target 4000: taken
        assert status(b"/" + b"x" * 3000) == b"HTTP/1.1 404"
    finally:
        p.kill()
        p.wait(10)
