#!/bin/sh
# Fetch mbedTLS 3.x sources with Debian's package manager into the user's cache:
# $ORISHA_FETCHED (`orisha build` sets it), else $ORISHA_CACHE/unikernel/sources, else
# ${XDG_CACHE_HOME:-~/.cache}/orisha/unikernel/sources (orisha/manifest.py's cache_root).
# The running suite (bookworm) has only 2.28, which lacks TLS 1.3 server support;
# trixie carries 3.6. The system's apt sources are left alone: a private apt
# configuration (its own source list, lists directory and cache under .cache/apt)
# knows only trixie's deb-src, verified with Debian's archive keyring.
# Prints the path of the unpacked source tree on stdout.
set -eu
cache=${ORISHA_FETCHED:-${ORISHA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/orisha}/unikernel/sources}
suite=${MBEDTLS_SUITE:-trixie}
mkdir -p "$cache"

existing=$(ls -d "$cache"/mbedtls-3.*/library 2>/dev/null | head -n1 || true)
if [ -n "$existing" ]; then
    dirname "$existing"
    exit 0
fi

apt="$cache/apt"
mkdir -p "$apt/sources.list.d" "$apt/lists/partial" "$apt/archives/partial"
cat > "$apt/sources.list.d/mbedtls.sources" <<SRC
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: $suite
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
set -- -o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts="$apt/sources.list.d" \
       -o Dir::State::Lists="$apt/lists" -o Dir::Cache="$apt/cache" -q
echo "fetch-mbedtls: apt-get update ($suite deb-src, private lists)" >&2
apt-get "$@" update >&2
( cd "$cache" && apt-get "$@" source --download-only mbedtls >&2 )

cd "$cache"
dsc=$(ls mbedtls_3.*.dsc 2>/dev/null | head -n1)
[ -n "$dsc" ] || { echo "fetch-mbedtls: no mbedtls 3.x source package in $suite" >&2; exit 1; }
dpkg-source --no-check -x "$dsc" >&2 || {
    # dpkg-source may be missing (dpkg-dev): the upstream tarball is what we build.
    tarball=$(ls mbedtls_3.*.orig.tar.* | head -n1)
    tar xf "$tarball" >&2
}
d=$(ls -d "$cache"/mbedtls-3.*/library | head -n1)
[ -n "$d" ] || { echo "fetch-mbedtls: mbedTLS source not found" >&2; exit 1; }
dirname "$d"
