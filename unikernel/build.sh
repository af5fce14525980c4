#!/bin/sh
# Build a bootable Orisha unikernel image with a site blob embedded.
#   unikernel/build.sh SITE_BLOB [OUTPUT_IMAGE]
# Default output: unikernel/build/orisha.img (a 32-bit ELF for QEMU -kernel).
# Needs gcc, binutils, make; fetches lwIP with `apt-get source` (see fetch-lwip.sh).
# The core's generated header must be in $BUILD/gen (BUILD defaults to build):
# `orisha build --loop unikernel` writes it; by hand, from the repository root, first
#   python -m orisha.targets.unikernel.policy_header unikernel/build/gen
set -eu
here=$(cd "$(dirname "$0")" && pwd)
[ $# -ge 1 ] || { echo "usage: $0 SITE_BLOB [OUTPUT_IMAGE]" >&2; exit 2; }
site=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
[ -f "$site" ] || { echo "build.sh: no such file: $1" >&2; exit 2; }
out=${2:-$here/build/orisha.img}
case "$out" in /*) ;; *) out=$(pwd)/$out ;; esac
lwip=$("$here/fetch-lwip.sh")
make -C "$here" -j"${JOBS:-2}" --no-print-directory LWIP_DIR="$lwip" SITE="$site" OUT="$out" >&2
echo "$out"
