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

has_src() {
    grep -rqsE '^(deb-src|Types:.*deb-src)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null
}
if ! has_src; then
    . /etc/os-release
    suite=${VERSION_CODENAME:-bookworm}
    echo "fetch-lwip: adding deb-src for $suite" >&2
    cat > /etc/apt/sources.list.d/orisha-deb-src.sources <<SRC
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: $suite
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    apt-get update -qq >&2
elif ! apt-cache showsrc lwip >/dev/null 2>&1; then
    apt-get update -qq >&2
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
