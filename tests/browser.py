"""A real browser for the tests: headless Chromium driven over its DevTools pipe.

``load_pages(urls, timeout)`` opens each URL in a fresh tab of one headless
Chromium and reports, per page, whether it loaded and everything that went
wrong while it did: failed requests (``Network.loadingFailed``), responses with
a status of 400 or more, uncaught exceptions (``Runtime.exceptionThrown``),
``console.error`` calls and browser log errors (``Log.entryAdded``). The
browser's own request for ``/favicon.ico`` is not the page's and is not counted.

Chromium is started with ``--remote-debugging-pipe``: it reads commands from
fd 3 and writes replies and events to fd 4, each a JSON message ended by a NUL
byte — no websocket library needed. Tabs are attached with flattened sessions
(``Target.attachToTarget``), so one pipe carries them all. Each page gets at
most ``timeout`` seconds; the browser is always killed at the end. As root
(containers, CI) Chromium needs ``--no-sandbox``.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

SETTLE = 0.5  # seconds after the load event for late requests and errors


def chromium() -> str | None:
    """The Chromium executable, or None (Debian: apt-get install chromium)."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageResult:
    url: str
    loaded: bool = False
    failed_requests: list[str] = field(default_factory=list)      # "URL: net::ERR_…"
    bad_responses: list[str] = field(default_factory=list)        # "404 URL"
    errors: list[str] = field(default_factory=list)               # exceptions, console, log
    protocols: dict[str, str] = field(default_factory=dict)       # URL → "h2", "h3"… (DevTools)
    headers: dict[str, dict] = field(default_factory=dict)        # URL → response fields
    sent: dict[str, dict] = field(default_factory=dict)           # URL → request fields, as sent
    value: object = None                                          # ``evaluate``'s result

    @property
    def problems(self) -> list[str]:
        return ([] if self.loaded else [f"{self.url}: did not load"]) + self.failed_requests \
            + self.bad_responses + self.errors

    @property
    def ok(self) -> bool:
        return not self.problems


class _Browser:
    def __init__(self, executable: str) -> None:
        self.profile = tempfile.mkdtemp(prefix="orisha-chromium-")
        cmd_r, cmd_w = os.pipe()
        evt_r, evt_w = os.pipe()
        # Above 4, so the child's dup2 onto 3 and 4 cannot clobber one with the other.
        child_in, child_out = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (cmd_r, evt_w))
        for fd in (cmd_r, evt_w):
            os.close(fd)

        def fds() -> None:
            os.dup2(child_in, 3)
            os.dup2(child_out, 4)

        args = [executable, "--headless=new", "--remote-debugging-pipe", "--disable-gpu",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={self.profile}", "about:blank"]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")
        # close_fds=False: subprocess would close fds 3 and 4 after preexec_fn has placed them;
        # Python's own descriptors are non-inheritable (PEP 446), so nothing else leaks.
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, preexec_fn=fds, close_fds=False)
        os.close(child_in)
        os.close(child_out)
        self.w, self.r = cmd_w, evt_r
        self.buf = b""
        self.next_id = 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> int:
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        data = json.dumps(msg).encode() + b"\0"
        while data:
            data = data[os.write(self.w, data):]
        return self.next_id

    def _read(self, deadline: float) -> dict | None:
        while b"\0" not in self.buf:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([self.r], [], [], wait)[0]:
                return None
            chunk = os.read(self.r, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed its DevTools pipe")
            self.buf += chunk
        msg, _, self.buf = self.buf.partition(b"\0")
        return json.loads(msg)

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 10.0) -> dict:
        """Send a command and wait for its reply; events that arrive meanwhile are kept."""
        n = self.send(method, params, session)
        deadline = time.monotonic() + timeout
        while True:
            msg = self._read(deadline)
            if msg is None:
                raise TimeoutError(f"chromium did not answer {method}")
            if msg.get("id") == n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_event(self, deadline: float) -> dict | None:
        if self.events:
            return self.events.pop(0)
        return self._read(deadline)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send("Browser.close")
                self.proc.wait(3)
        except (OSError, subprocess.TimeoutExpired):  # a stuck or gone browser: killed below
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            for fd in (self.w, self.r):
                os.close(fd)
            shutil.rmtree(self.profile, ignore_errors=True)


def _origin(url: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0].split('?', 1)[0]}"


def _load(b: _Browser, url: str, timeout: float, same_origin: bool,
          evaluate: str | None = None) -> PageResult:
    result = PageResult(url)
    mine = _origin(url)

    def counts(resource: str) -> bool:
        if resource == mine + "/favicon.ico":  # asked for by the browser itself, not the page
            return False
        return not same_origin or _origin(resource) == mine
    target = b.call("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = b.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    try:
        for domain in ("Network", "Runtime", "Log", "Page"):
            b.call(f"{domain}.enable", session=session)
        b.events = [e for e in b.events if e.get("sessionId") != session]  # about:blank's
        nav = b.call("Page.navigate", {"url": url}, session=session)
        if nav.get("errorText"):
            result.failed_requests.append(f"{url}: {nav['errorText']}")
            return result
        urls: dict[str, str] = {}
        sent: dict[str, dict] = {}  # request id → its fields (ExtraInfo may come after the response)
        answered: dict[str, str] = {}  # request id → URL
        deadline = time.monotonic() + timeout
        settle = None
        while True:
            msg = b.wait_event(min(deadline, settle or deadline))
            if msg is None:
                break
            if msg.get("sessionId") != session:
                continue
            method, p = msg.get("method"), msg.get("params", {})
            if method == "Page.loadEventFired":
                result.loaded = True
                settle = time.monotonic() + SETTLE
            elif method == "Network.requestWillBeSent":
                urls[p["requestId"]] = p["request"]["url"]
            elif method == "Network.loadingFailed":
                failed = urls.get(p["requestId"], "?")
                if counts(failed):
                    result.failed_requests.append(f"{failed}: {p.get('errorText')}")
            elif method == "Network.requestWillBeSentExtraInfo":  # the fields on the wire
                sent[p["requestId"]] = {k.lower(): v for k, v in p.get("headers", {}).items()}
            elif method == "Network.responseReceived":
                result.protocols[p["response"]["url"]] = p["response"].get("protocol", "")
                result.headers[p["response"]["url"]] = {
                    k.lower(): v for k, v in p["response"].get("headers", {}).items()}
                answered[p["requestId"]] = p["response"]["url"]
                if p["response"]["status"] >= 400 and counts(p["response"]["url"]):
                    result.bad_responses.append(f"{p['response']['status']} {p['response']['url']}")
            elif method == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                result.errors.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
            elif method == "Runtime.consoleAPICalled" and p.get("type") == "error":
                result.errors.append("console.error: " + " ".join(
                    str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
            elif method == "Log.entryAdded" and p["entry"].get("level") == "error":
                e = p["entry"]
                if e.get("url") and not counts(e["url"]):
                    continue
                result.errors.append(f"log: {e.get('text')} {e.get('url', '')}".rstrip())
        result.sent = {u: sent[r] for r, u in answered.items() if r in sent}
        if evaluate and result.loaded:
            r = b.call("Runtime.evaluate", {"expression": evaluate, "returnByValue": True},
                       session=session)
            result.value = r.get("result", {}).get("value")
        return result
    finally:
        b.call("Target.closeTarget", {"targetId": target})


def load_pages(urls: list[str], timeout: float = 15.0, executable: str | None = None,
               same_origin: bool = False, before=None,
               evaluate: str | None = None) -> list[PageResult]:
    """Load each URL in a fresh tab of one headless Chromium; one ``PageResult`` per URL.

    ``same_origin``: count failed requests and error responses of the page's own origin
    only (pages that embed badges from other hosts, on a machine without a network).
    ``before(i)``: called before the i-th URL is loaded (the browser, its cache and its
    dictionaries live on: e.g. a site rebuilt between two visits); ``evaluate``: a
    JavaScript expression evaluated in each page after it loaded (``PageResult.value``)."""
    exe = executable or chromium()
    if exe is None:
        raise RuntimeError("no Chromium found (apt-get install chromium)")
    b = _Browser(exe)
    try:
        b.call("Target.getTargets", timeout=30)  # the first answer: the browser is up
        results = []
        for i, url in enumerate(urls):
            if before is not None:
                before(i)
            results.append(_load(b, url, timeout, same_origin, evaluate))
        return results
    finally:
        b.close()
