#!/bin/sh
# Fetch lwIP sources with Debian's package manager into the user's cache:
# $ORISHA_FETCHED (`orisha build` sets it), else $ORISHA_CACHE/unikernel/sources, else
# ${XDG_CACHE_HOME:-~/.cache}/orisha/unikernel/sources (orisha/manifest.py's cache_root).
# Adds a deb-src entry for the running suite if none exists (needs root).
# Prints the path of the unpacked source tree on stdout.
set -eu
cache=${ORISHA_FETCHED:-${ORISHA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/orisha}/unikernel/sources}
mkdir -p "$cache"

existing=$(ls -d "$cache"/lwip-*/src/core 2>/dev/null | head -n1 || true)
if [ -n "$existing" ]; then
    dirname "$(dirname "$existing")"
    exit 0
fi

# Whether apt knows lwIP's source package. Not "is any deb-src listed": ./dev's own
# bookworm-backports entry (deb and deb-src, for HTTP/3's libraries) is one, and lwIP is not
# in that suite, so a machine whose only deb-src was that one never got bookworm's.
# (apt-cache showsrc exits 0 for a package it does not know: its output tells.)
knows_lwip() {
    apt-cache showsrc lwip 2>/dev/null | grep -q '^Package: lwip$'
}
if ! knows_lwip; then
    . /etc/os-release
    suite=${VERSION_CODENAME:-bookworm}
    if [ ! -f /etc/apt/sources.list.d/orisha-deb-src.sources ]; then
        echo "fetch-lwip: adding deb-src for $suite" >&2
        cat > /etc/apt/sources.list.d/orisha-deb-src.sources <<SRC
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: $suite
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    fi
    apt-get update -qq >&2
    knows_lwip || { echo "fetch-lwip: apt knows no source package lwip (deb-src for $suite?)" >&2; exit 1; }
fi

( cd "$cache" && apt-get source --download-only -qq lwip >&2 && \
  dpkg-source --no-check -x lwip_*.dsc >&2 ) || {
    # dpkg-source may be missing (dpkg-dev); fall back to plain tar.
    cd "$cache"
    tarball=$(ls lwip_*.orig.tar.* | head -n1)
    tar xf "$tarball" >&2
}
d=$(ls -d "$cache"/lwip-*/src/core | head -n1)
[ -n "$d" ] || { echo "fetch-lwip: lwIP source not found" >&2; exit 1; }
dirname "$(dirname "$d")"
