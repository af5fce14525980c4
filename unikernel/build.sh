#!/bin/sh
# Build a bootable Orisha unikernel image with a site blob embedded.
#   unikernel/build.sh SITE_BLOB [OUTPUT_IMAGE]
# Default output: $BUILD/orisha.img (a 32-bit ELF for QEMU -kernel).
# Needs gcc, binutils, make; fetches lwIP with `apt-get source` (see fetch-lwip.sh).
# BUILD (objects; default unikernel/build) may be absolute: `orisha build` puts it in
# the user's cache, so the sources may be read-only (an installed wheel's copy).
# With TLS_CERT and TLS_KEY set (PEM paths) the kernel also serves TLS on 443.
# The core's generated header must be in $BUILD/gen (BUILD defaults to build):
# `orisha build --loop unikernel` writes it; by hand, from the repository root, first
#   python -m orisha.targets.unikernel.policy_header unikernel/build/gen
set -eu
here=$(cd "$(dirname "$0")" && pwd)
[ $# -ge 1 ] || { echo "usage: $0 SITE_BLOB [OUTPUT_IMAGE]" >&2; exit 2; }
site=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
[ -f "$site" ] || { echo "build.sh: no such file: $1" >&2; exit 2; }
build=${BUILD:-build}
case "$build" in /*) ;; *) build=$here/$build ;; esac
out=${2:-$build/orisha.img}
case "$out" in /*) ;; *) out=$(pwd)/$out ;; esac
lwip=$(sh "$here/fetch-lwip.sh")
# ORISHA_OLD: tree files make counts as old (orisha build sets it when the objects in BUILD
# were built from byte-identical sources, e.g. copied from another install's folder).
old=
for f in ${ORISHA_OLD:-}; do old="$old -o $f"; done
# TLS_CERT and TLS_KEY (PEM files, from the environment): a kernel that also
# serves TLS on 443, with mbedTLS fetched like lwIP (fetch-mbedtls.sh).
if [ -n "${TLS_CERT:-}" ]; then
    [ -n "${TLS_KEY:-}" ] || { echo "build.sh: TLS_CERT without TLS_KEY" >&2; exit 2; }
    mbedtls=$(sh "$here/fetch-mbedtls.sh")
    make $old -C "$here" -j"${JOBS:-2}" --no-print-directory LWIP_DIR="$lwip" SITE="$site" OUT="$out" \
        BUILD="$build" MBEDTLS_DIR="$mbedtls" TLS_CERT="$TLS_CERT" TLS_KEY="$TLS_KEY" >&2
else
    make $old -C "$here" -j"${JOBS:-2}" --no-print-directory LWIP_DIR="$lwip" SITE="$site" OUT="$out" \
        BUILD="$build" TLS_CERT= TLS_KEY= >&2
fi
echo "$out"
