"""Index pages for folders without an index.html (``orisha build --autoindex``), like nginx's.

Strategy: decided once, at build time, from the walked files: every folder
that holds files (at any depth) but no ``index.html`` gets a generated
``index.html`` listing its subfolders (first) and files, sorted by name, with
their modification time (UTC) and size, in the layout of nginx's autoindex.
Names are HTML-escaped and hrefs percent-encoded (UTF-8), so any file name is
shown as it is and links to itself. The pages are written into a scratch
folder and then take part in the build like any file (compression, routes:
``/dir/``, and ``/dir`` → 301 ``/dir/``). Their Last-Modified is the newest
entry's, so a listing revalidates when something in the folder changes.
"""

from __future__ import annotations

import html
import os
import time
from urllib.parse import quote

from .walk import SourceFile


def _row(href: str, name: str, mtime: int, size: str) -> str:
    shown = name if len(name) <= 50 else name[:47] + "..>"
    stamp = time.strftime("%d-%b-%Y %H:%M", time.gmtime(mtime))
    pad = " " * (51 - len(shown))
    return f'<a href="{href}">{html.escape(shown)}</a>{pad}{stamp} {size:>19}\n'


def page(folder: str, dirs: dict[str, int], files: list[tuple[str, int, int]]) -> bytes:
    """The listing of ``folder`` ('' is the root): subfolders (name → newest mtime) and
    files (name, mtime, size)."""
    title = html.escape("/" + (folder + "/" if folder else ""))
    rows = ['<a href="../">../</a>\n'] if folder else []
    for name in sorted(dirs):
        rows.append(_row(quote(name, errors="surrogateescape") + "/", name + "/", dirs[name], "-"))
    for name, mtime, size in sorted(files):
        rows.append(_row(quote(name, errors="surrogateescape"), name, mtime, str(size)))
    text = (f"<!doctype html>\n<meta charset=utf-8>\n<title>Index of {title}</title>\n"
            f"<h1>Index of {title}</h1><hr><pre>{''.join(rows)}</pre><hr>\n")
    return text.encode("utf-8", "surrogateescape")


def pages(files: list[SourceFile], scratch: str) -> list[SourceFile]:
    """A generated index page (written under ``scratch``) per folder without index.html."""
    dirs: dict[str, dict[str, int]] = {"": {}}
    listed: dict[str, list[tuple[str, int, int]]] = {"": []}
    for f in files:
        parts = f.rel.split("/")
        for depth in range(len(parts) - 1):  # every ancestor folder lists the next one down
            parent, child = "/".join(parts[:depth]), parts[depth]
            sub = dirs.setdefault(parent, {})
            sub[child] = max(sub.get(child, 0), f.mtime)
            dirs.setdefault("/".join(parts[:depth + 1]), {})
        folder = "/".join(parts[:-1])
        listed.setdefault(folder, []).append((parts[-1], f.mtime, os.path.getsize(f.path)))
    out = []
    for n, folder in enumerate(sorted(dirs)):
        entries = listed.get(folder, [])
        if any(name == "index.html" for name, _, _ in entries):
            continue
        path = os.path.join(scratch, f"{n}.html")
        with open(path, "wb") as fh:
            fh.write(page(folder, dirs[folder], entries))
        mtime = max([m for _, m, _ in entries] + list(dirs[folder].values()) + [0])
        out.append(SourceFile(f"{folder}/index.html" if folder else "index.html", path, mtime))
    return out
