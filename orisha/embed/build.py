"""The build step: site directory in, build output directory out.

Strategy: walk → read the author's rules (``_headers``, ``_redirects`` at the
root, never served; ``--header``, ``--redirect``) → compress (parallel,
cached) → assemble responses and routes, the rules resolved into the route
table (orisha/embed/rules.py) → emit, all into a temporary directory beside
OUT that replaces OUT only when complete, so a failed build leaves OUT as it
was. An existing OUT is replaced only if it is itself an Orisha build: a build
never deletes a user's files.

A document is assembled once per (file, status, author headers): the same file
served at two paths that different ``_headers`` blocks match is two entries
(their bodies are stored once).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

from . import assemble, auth, compress, dictionaries, emit, links, rules
from .. import manifest
from ..errors import BuildError
from .dictionaries import DEFAULT_KEEP
from .walk import SourceFile, walk

RULE_FILES = ("_headers", "_redirects")  # read at the root, never served


class Built(NamedTuple):
    """What a build made, for a target that lays it out again (orisha/targets/)."""
    docs: list  # the documents responses are made of (assemble.Document)
    table: dict  # route key -> the route's answer (emit's table)
    not_found: object  # the 404 document
    fallback: str | None  # the fallback document's id
    runtime: list  # the rules decided per request (rules.resolve)
    assets: frozenset | None  # extensions the navigation-only fallback refuses


@dataclass
class Result:
    out: str
    files: int
    bytes: dict[str, int]
    seconds: float
    summary: str
    dictionaries: int = 0   # responses announced with Use-As-Dictionary
    deltas: int = 0         # dcz variants kept (their bytes: ``bytes["dcz"]``)
    history_bytes: int = 0  # earlier bodies kept in OUT/dictionaries for the next build


def _check_doc(site: str, rel: str | None, option: str) -> str | None:
    if rel is None:
        return None
    rel = rel.strip("/")
    if not os.path.isfile(os.path.join(site, rel)):
        raise BuildError(f"{os.path.join(site, rel)}: {option} file does not exist in the site")
    return rel


def check_out(site: str, out: str) -> None:
    """OUT must not be inside SITE and may replace only an earlier build (or nothing)."""
    real_site, real_out = os.path.realpath(site), os.path.realpath(out)
    if real_out == real_site or real_out.startswith(real_site + os.sep):
        raise BuildError(f"{out}: the output directory is inside the site directory {site}")
    if not manifest.replaceable(out):
        raise BuildError(f"{out}: exists and is not an Orisha build; refusing to replace it")


def build(site: str, out: str, *, fallback: str | None = None, not_found: str | None = None,
          cache_control: list[tuple[str, str]] | None = None, loop: str = "auto",
          cache: str | None = "", progress: bool = False,
          warn: Callable[[str], None] = lambda m: print(f"orisha: warning: {m}", file=sys.stderr),
          symlinks: str = "follow", headers: list[str] | tuple = (),
          redirects: list[str] | tuple = (), autoindex: bool = False,
          fallback_all: bool = False, strict_links: bool = False,
          basic_auth: list[str] | tuple = (), early_hints: bool = True,
          keep: int = DEFAULT_KEEP, history: str | None = None,
          also: Callable[[str, "Built"], None] | None = None) -> Result:
    """Build SITE into OUT. ``fallback_all``: the fallback answers every unknown path
    (the behaviour before it answered navigations only: ``Site.assets``);
    ``strict_links``: a broken internal link is an error (nothing is written);
    ``basic_auth``: ``GLOB=HTPASSWD`` values (orisha/embed/auth.py); ``early_hints``: a
    page's render-blocking and preloaded subresources become a ``Link`` field (and a 103
    over HTTP/2: orisha/protocols/hpack_blocks.py); ``keep``: RFC 9842 deltas from the last
    ``keep`` builds into ``history`` (OUT by default), 0: none (orisha/embed/dictionaries.py);
    ``also``: a target's own output (orisha/targets/), written into the same temporary
    folder from the build's documents (``Built``) before it replaces OUT, so a target's
    failure leaves OUT as it was too."""
    started = time.monotonic()
    areas, fallback, not_found = _check_options(site, out, loop, basic_auth, fallback,
                                                not_found)
    overrides = cache_control or []

    files = walk(site, warn, symlinks)
    header_rules, redirect_rules = _rules(site, files, headers, redirects)
    files = [f for f in files if f.rel not in RULE_FILES]
    if not files:
        raise BuildError(f"{site}: the site directory has no files to serve")
    served = len(files)
    cache = compress.default_cache_dir() if cache == "" else cache
    files, datas, encoded = _contents(files, cache, progress, autoindex)
    docs = _Documents(files, datas, encoded, overrides, header_rules, areas)
    past = docs.announce(out if history is None else history, keep, cache, progress)
    docs.table = assemble.routes([f.rel for f in files])
    resolved, runtime = rules.resolve(docs.table, redirect_rules)
    compiled = [docs.rule(r) for r in runtime]
    assets = None if fallback is None or fallback_all else assemble.asset_extensions(
        [f.rel for f in files])
    docs.hints = _check_links(site, files, datas, cache,
                              links.Routes(resolved, compiled, docs.rule, fallback is not None,
                                           assets),
                              warn, strict_links, progress, early_hints)
    nf = _not_found(docs, not_found, overrides)
    table = {key: docs.route(key, resolved[key]) for key in sorted(resolved)}
    fallback = docs.id(fallback, "200 OK", docs.headers("/" + fallback, fallback)) if fallback else None

    totals, summary = _summary(docs, served)

    def write(tmp: str) -> None:
        emit.write(tmp, docs.used, table, nf, fallback, loop, summary,
                   {"files": served, "bytes": totals}, compiled, assets, areas)
        docs.keep_history(tmp, past, keep)  # the bodies the next build's deltas start from
        if also is not None:
            also(tmp, Built(docs.used, table, nf, fallback, compiled, assets))
    replace_dir(out, write)
    return Result(out, served, totals, time.monotonic() - started, summary, *docs.kept())


def _not_found(docs: "_Documents", not_found: str | None, overrides):
    """The 404 document: the site's ``--not-found`` page, or the built-in one."""
    if not_found:
        return docs.make(not_found, "404 Not Found",
                         docs.headers("/" + not_found, not_found, hints=False))
    return assemble.document("404.html", assemble.BUILTIN_404, 0, None, overrides,
                             status="404 Not Found", dated=False)


def _check_options(site: str, out: str, loop: str, basic_auth, fallback, not_found):
    """The options checked before anything is built: (auth areas, the fallback and
    not-found documents)."""
    areas = [auth.parse_option(v) for v in basic_auth]
    if not os.path.isdir(site):
        raise BuildError(f"{site}: no such directory" if not os.path.exists(site)
                         else f"{site}: not a directory")
    check_out(site, out)
    fallback = _check_doc(site, fallback, "--fallback")
    not_found = _check_doc(site, not_found, "--not-found")
    return areas, fallback, not_found


def _check_links(site: str, files: list[SourceFile], datas: list[bytes], cache: str | None,
                 routes: "links.Routes", warn, strict: bool, progress: bool,
                 early_hints: bool = True) -> dict[str, str]:
    """One warning per internal reference that leads nowhere, then their count; with
    ``strict`` that is an error, raised before anything is written. Returns each page's
    early hints (its ``Link`` field value, ``links.link_field``) unless not wanted."""
    count = 0
    broken = []
    hints: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        bar = (stack.enter_context(_Progress("checking links", len(files), sum(map(len, datas))))
               if progress else None)
        for f, data in zip(files, datas):
            base, found, wanted = links.cached_read(f.rel, data, compress.cache_key(data), cache)
            if found:
                broken += [(f.rel, line, target)
                           for line, target in links.broken(f.rel, base, found, routes)]
            value = links.link_field(f.rel, base, wanted, routes) if early_hints else None
            if value:
                hints[f.rel] = value
            if bar:
                bar.done(len(data))
    for rel, line, target in broken:  # after the bar: a warning never splits it
        warn(f"{os.path.join(site, rel)}:{line}: broken link {target}")
        count += 1
    if count:
        message = f"{site}: {count} broken link{'s' if count > 1 else ''}"
        if strict:
            raise BuildError(message + " (--strict-links)")
        warn(message)
    return hints


def _contents(files: list[SourceFile], cache: str | None, progress: bool, autoindex: bool):
    """(files, their bytes, their codings), with ``--autoindex`` pages added after the files."""
    scratch = tempfile.mkdtemp(prefix="orisha-autoindex-") if autoindex else None
    try:
        if scratch:
            from .autoindex import pages
            files = files + pages(files, scratch)
        datas = [_read(f) for f in files]
        return files, datas, _compress(files, datas, cache, progress)
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def _summary(docs: "_Documents", served: int) -> tuple[dict[str, int], str]:
    """(bytes per coding, the summary line the build module keeps); the dcz deltas kept
    are counted in ``docs.delta_count``."""
    totals = _totals(docs, served)
    docs.delta_count = totals.pop("dcz_count")
    summary = (f"{served} files, {totals['identity']} bytes"
               + "".join(f", {c} {totals[c]}" for c in compress.CODINGS if totals[c])
               + (f", {len(docs.announced)} dictionaries, {docs.delta_count} dcz deltas "
                  f"{totals['dcz']}" if docs.announced else ""))
    return totals, summary


def _totals(docs: "_Documents", served: int) -> dict[str, int]:
    """Bytes per coding over the site's own files, counting the variants the build keeps."""
    totals = {c: 0 for c in ("identity", *compress.CODINGS, "dcz", "dcz_count")}
    for i in range(served):
        doc = docs.base(i)
        for v in doc.variants:
            totals[v.coding] += len(v.body)
        for _, v in doc.deltas:
            totals["dcz"] += len(v.body)
            totals["dcz_count"] += 1
    return totals


def _rules(site: str, files: list[SourceFile], headers, redirects):
    """The author's rules: the command line's first, then the site's files."""
    header_rules = [rules.cli_header(v) for v in headers]
    redirect_rules = [rules.cli_redirect(v) for v in redirects]
    for f in files:
        if f.rel in RULE_FILES:
            where = os.path.join(site, f.rel)
            try:
                text = _read(f).decode("utf-8")
            except UnicodeDecodeError as e:
                raise BuildError(f"{where}: not UTF-8 text (byte {e.start})") from None
            if f.rel == "_headers":
                header_rules += rules.parse_headers(text, where)
            else:
                redirect_rules += rules.parse_redirects(text, where)
    return header_rules, redirect_rules


class _Documents:
    """Documents made on demand, one per (file, status, author headers), with stable ids:
    the file's path for the plain 200 document, ``path NUL n`` for the others."""

    def __init__(self, files, datas, encoded, overrides, header_rules, areas=()) -> None:
        self.areas = list(areas)  # --basic-auth (auth.Area)
        self.hints: dict[str, str] = {}  # rel → its early hints' Link value
        self.files, self.datas, self.encoded = files, datas, encoded
        self.overrides, self.header_rules = overrides, header_rules
        self.index = {f.rel: i for i, f in enumerate(files)}
        self.ids: dict[tuple, str] = {}
        self.used: list[assemble.Document] = []
        self._base: dict[int, assemble.Document] = {}
        self._rules: dict[int, emit.CompiledRule] = {}
        self.table: dict = {}  # the routes of the files alone (assemble.routes)
        self.match: dict[int, str] = {}  # file index → its Use-As-Dictionary pattern
        self.deltas: dict[int, tuple] = {}  # file index → (sha, key, dcz body) per earlier body
        self.announced: dict[str, tuple[str, bytes]] = {}  # path → (pattern, body)
        self.history_bytes = 0  # the bodies kept for the next build (``keep_history``)
        self.delta_count = 0  # the dcz variants kept (``_summary``)

    def announce(self, history: str, keep: int, cache: str | None,
                 progress: bool) -> "dictionaries.History":
        """Which files are announced as dictionaries (RFC 9842), and their deltas from the
        bodies of the last ``keep`` builds kept in the folder ``history``; returns those."""
        from .mime import content_type
        past = dictionaries.History(history, keep)
        if not keep:
            return past
        worth = [i for i, f in enumerate(self.files)
                 if self.encoded[i] and dictionaries.worth(content_type(f.rel), len(self.datas[i]))]
        pats = dictionaries.patterns([self.files[i].rel for i in worth])
        cache = compress.default_cache_dir() if cache == "" else cache
        jobs = []
        for i in worth:
            rel, data = self.files[i].rel, self.datas[i]
            self.match[i] = pats[rel]
            self.announced[assemble.url_key(rel).decode("utf-8", "surrogateescape")] = (
                pats[rel], data)
            for e in past.earlier(pats[rel], hashlib.sha256(data).digest()):
                jobs.append((i, e))
        with contextlib.ExitStack() as stack:
            bar = (stack.enter_context(_Progress("dictionary deltas", len(jobs),
                                                 sum(len(self.datas[i]) for i, _ in jobs)))
                   if progress and jobs else None)
            bodies = dictionaries.encode_all([(self.datas[i], e.data) for i, e in jobs], cache,
                                             bar.done if bar else lambda n: None)
        for (i, e), body in zip(jobs, bodies):
            self.deltas.setdefault(i, []).append((e.sha, dictionaries.available(e.sha), body))
        return past

    def kept(self) -> tuple[int, int, int]:
        """(dictionaries announced, dcz deltas kept, history bytes): ``Result``'s last fields."""
        return len(self.announced), self.delta_count, self.history_bytes

    def keep_history(self, tmp: str, past: "dictionaries.History", keep: int) -> None:
        """Write this build's and the kept earlier builds' dictionary bodies into the build
        being written, and their table into its manifest (nothing with ``keep`` 0)."""
        if keep:
            kept = dictionaries.write(tmp, self.announced, past, keep)
            manifest.update(tmp, dictionaries=kept)
            self.history_bytes = kept["history_bytes"]

    def headers(self, path: str, rel: str, hints: bool = True) -> tuple:
        """The author's fields for a path, after the page's early hints (a ``Link`` that
        ``_headers`` may add to or remove with ``! Link``) and its Use-As-Dictionary (RFC
        9842: ``! Use-As-Dictionary`` detaches it, an author's value comes after it and wins,
        as the later key of a structured-field dictionary does). ``hints``: False for a
        document served as a 404, which gets neither (early hints go with a 200, RFC 8297
        §2; a dictionary is a successful response)."""
        hint = self.hints.get(rel) if hints else None
        match = self.match.get(self.index[rel]) if hints else None
        initial = ((("Link", hint),) if hint else ()) + (
            (("Use-As-Dictionary", dictionaries.field(match)),) if match else ())
        return rules.headers_for(self.header_rules, path, rel, initial)

    def make(self, rel: str, status: str, headers: tuple,
             private: bool = False) -> assemble.Document:
        i = self.index[rel]
        f = self.files[i]
        ok = status == "200 OK"  # a delta is of a successful response
        return assemble.document(rel, self.datas[i], f.mtime, self.encoded[i], self.overrides,
                                 status=status, headers=headers, private=private,
                                 deltas=tuple(self.deltas.get(i, ())) if ok else ())

    def base(self, i: int):
        """The plain document of file ``i`` (200, no author headers)."""
        if i not in self._base:
            self._base[i] = self.make(self.files[i].rel, "200 OK", ())
        return self._base[i]

    def id(self, rel: str, status: str, headers: tuple, private: bool = False) -> str:
        key = (rel, status, headers, private)
        if key not in self.ids:
            plain = status == "200 OK" and not headers and not private
            doc = self.base(self.index[rel]) if plain else self.make(rel, status, headers, private)
            doc.rel = rel if plain else f"{rel}\0{len(self.ids)}"
            self.ids[key] = doc.rel
            self.used.append(doc)
        return self.ids[key]

    def route(self, key: bytes, value: tuple, guard: bool = True) -> tuple:
        """A resolved route value with its document made: ("doc", id), a redirect, rules,
        or ("auth", (area index, one of those)) behind a --basic-auth area."""
        kind, v = value
        path = key.decode("utf-8", "surrogateescape")
        area = auth.area_for(self.areas, path, v if kind in ("doc", "doc404") else None) \
            if guard and self.areas else None
        if area is not None:
            return "auth", (area, self.route(key, value, False))
        if kind == "redirect":
            return value
        if kind == "rules":
            pending, default = v
            return "rules", (tuple(self.rule(r) for r in pending),
                             None if default is None else self.route(key, default, guard))
        status = "404 Not Found" if kind == "doc404" else "200 OK"
        return "doc", self.id(v, status, self.headers(path, v, status.startswith("200")),
                             private=not guard)

    def rule(self, r) -> "emit.CompiledRule":
        """A rule for the run-time matcher (made once, however many routes refer to it)."""
        if id(r) not in self._rules:
            entries = {}
            if r.status == 404:
                for key, rel in rules.not_found_targets(r, self.table).items():
                    path = key.decode("utf-8", "surrogateescape")
                    entries[key] = self.id(rel, "404 Not Found", self.headers(path, rel, False))
            self._rules[id(r)] = emit.CompiledRule(
                r.regex.pattern.encode("utf-8", "surrogateescape"), r.conditions(), r.pieces(),
                r.status, r.keeps_query, entries, rules.pattern_pieces(r.source), r.where)
        return self._rules[id(r)]


def _read(f: SourceFile) -> bytes:
    try:
        with open(f.path, "rb") as fh:
            return fh.read()
    except OSError as e:
        raise BuildError(f"{f.path}: cannot read ({e.strerror})") from None


def _compress(files: list[SourceFile], datas: list[bytes], cache: str | None,
              progress: bool) -> list[dict[str, bytes] | None]:
    """Every coding of every compressible file (None for the rest), in file order."""
    from .mime import compressible, content_type
    todo = [i for i, f in enumerate(files) if datas[i] and compressible(content_type(f.rel))]
    jobs = [(files[i].path, compress.cache_key(datas[i]), len(datas[i])) for i in todo]
    if progress:
        with _Progress("compressing", len(jobs), sum(j[2] for j in jobs)) as bar:
            results = compress.compress_all(jobs, cache, bar.done)
    else:
        results = compress.compress_all(jobs, cache, lambda n: None)
    encoded: list[dict[str, bytes] | None] = [None] * len(files)
    for i, r in zip(todo, results):
        encoded[i] = r
    return encoded


class _Progress:
    """A terminal's progress bar over files and bytes (click's, with its estimate of the
    time left): ``compressing  [###---]  40%  00:00:42  312/1065 files, 20.1 of 50.3 MB``.
    Made only when stdout is a terminal, so logs get the summary line alone."""

    def __init__(self, label: str, files: int, size: int) -> None:
        import click
        self.files, self.size, self.n, self.bytes = files, size, 0, 0
        self.bar = click.progressbar(length=max(size, 1), label=label, file=sys.stdout,
                                     item_show_func=self._show)

    def _show(self, _item) -> str:
        return (f"{self.n}/{self.files} files, {self.bytes / 1e6:.1f} of "
                f"{self.size / 1e6:.1f} MB")

    def done(self, size: int) -> None:
        """One more file of ``size`` bytes finished."""
        self.n += 1
        self.bytes += size
        self.bar.update(size, self)

    def __enter__(self) -> "_Progress":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)


def replace_dir(out: str, fill: Callable[[str], None]) -> None:
    """Run ``fill(tmp)`` on a fresh folder beside OUT, then put it in OUT's place.

    A failure anywhere leaves OUT as it was (the caller checked that OUT may be
    replaced: ``check_out``)."""
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".orisha-build-", dir=parent)
    try:
        fill(tmp)
        os.chmod(tmp, 0o755)
        if os.path.exists(out):
            old = tempfile.mkdtemp(prefix=".orisha-old-", dir=parent)
            os.rename(out, os.path.join(old, "out"))
            os.rename(tmp, out)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def summary(r: Result) -> str:
    """The one line a build ends with: what it made, how small, how long."""
    ident = r.bytes["identity"] or 1
    parts = [f"{c} {r.bytes[c]:,} ({r.bytes[c] / ident:.0%})" for c in ("gzip", "br", "zstd")
             if r.bytes[c]]
    return (f"built {r.out}: {r.files} files, {r.bytes['identity']:,} bytes"
            + (f"; {', '.join(parts)} of identity" if parts else "")
            + (f"; {r.dictionaries} dictionaries, {r.deltas} dcz deltas {r.bytes['dcz']:,} bytes, "
               f"history {r.history_bytes:,} bytes" if getattr(r, "dictionaries", 0) else "")
            + f" in {r.seconds:.1f}s")


def into_cache(site: str, **options) -> Result:
    """Build a site directory into its per-site cache folder (``Result.out``): what
    ``orisha serve SITE_DIR`` and ``orisha.serve`` serve."""
    if not os.path.isdir(site):
        raise BuildError(f"{site}: neither an Orisha build nor a site directory")
    key = hashlib.blake2b(os.path.realpath(site).encode(), digest_size=8).hexdigest()
    return build(site, manifest.cache_root("builds", key), **options)
