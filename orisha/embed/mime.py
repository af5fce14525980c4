"""Content types and which of them are worth compressing.

Strategy: a fixed table instead of the platform's ``mimetypes`` database, so a
build is the same on every machine. Text types carry ``charset=utf-8``.
"""

from __future__ import annotations

TYPES = {
    "html": "text/html", "htm": "text/html", "css": "text/css",
    "js": "text/javascript", "mjs": "text/javascript", "cjs": "text/javascript",
    "json": "application/json", "map": "application/json", "webmanifest": "application/manifest+json",
    "xml": "application/xml", "rss": "application/rss+xml", "atom": "application/atom+xml",
    "txt": "text/plain", "md": "text/markdown", "csv": "text/csv", "tsv": "text/tab-separated-values",
    "svg": "image/svg+xml", "png": "image/png", "jpg": "image/jpeg", "jpeg": "image/jpeg",
    "gif": "image/gif", "webp": "image/webp", "avif": "image/avif", "ico": "image/x-icon",
    "bmp": "image/bmp", "woff": "font/woff", "woff2": "font/woff2", "ttf": "font/ttf",
    "otf": "font/otf", "eot": "application/vnd.ms-fontobject", "wasm": "application/wasm",
    "pdf": "application/pdf", "mp4": "video/mp4", "webm": "video/webm", "mp3": "audio/mpeg",
    "ogg": "audio/ogg", "wav": "audio/wav", "zip": "application/zip", "gz": "application/gzip",
    "tar": "application/x-tar", "br": "application/octet-stream", "zst": "application/zstd",
    "yaml": "text/yaml", "yml": "text/yaml", "toml": "text/plain", "ics": "text/calendar",
}
DEFAULT = "application/octet-stream"

# Types whose bytes are not already compressed. PNG, JPEG, WOFF2, ZIP, media…
# are left alone: recompressing them wastes build time for no gain.
_COMPRESSIBLE = {
    "application/json", "application/manifest+json", "application/xml", "application/rss+xml",
    "application/atom+xml", "image/svg+xml", "image/x-icon", "image/bmp", "font/ttf", "font/otf",
    "application/vnd.ms-fontobject", "application/wasm", "application/x-tar",
}


def content_type(name: str) -> str:
    """The Content-Type value for a file name."""
    ext = name.rpartition(".")[2].lower() if "." in name else ""
    t = TYPES.get(ext, DEFAULT)
    if t.startswith("text/") or t in ("application/json", "application/manifest+json",
                                       "application/xml", "image/svg+xml"):
        return t + "; charset=utf-8"
    return t


def compressible(ctype: str) -> bool:
    base = ctype.partition(";")[0]
    return base.startswith("text/") or base in _COMPRESSIBLE
