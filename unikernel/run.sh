#!/bin/sh
# Boot an image file under QEMU in the foreground, serving on 127.0.0.1:PORT.
#   unikernel/run.sh IMAGE PORT [extra qemu args...]
# The command line is orisha boot's, written once in
# orisha/targets/unikernel/boot.py (qemu_command); this runs what
# `python3 -m orisha.targets.unikernel.boot --print-command` prints. For a build
# directory, `orisha boot OUT` is the usual way (and drains on Ctrl-C).
# Environment:
#   ACCEL=kvm|tcg            default: kvm if /dev/kvm is usable, else tcg
#   MACHINE=microvm|pc|q35   default: microvm (virtio-mmio); pc/q35 use virtio-net-pci
#   MEM=64                   guest RAM in MiB (default: image size + 16, at least 64)
#   APPEND="..."             kernel command line (e.g. orisha.verbose, orisha.exit=ready)
#   PYTHON=python3           any Python 3.8+; boot.py needs only the standard library
# Serial console on stdout; typing "stop" drains, "exit" leaves. The guest exits
# QEMU through isa-debug-exit: status 1 = clean exit, 255 = PANIC.
set -eu
[ $# -ge 2 ] || { echo "usage: $0 IMAGE PORT [qemu args...]" >&2; exit 2; }
image=$1
port=$2
shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
cmd=$(PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" -m orisha.targets.unikernel.boot \
      --print-command --accel "${ACCEL:-auto}" --machine "${MACHINE:-microvm}" \
      ${MEM:+--memory "${MEM%M}"} --append "${APPEND:-}" "$image" "$port")
# $cmd is shell-quoted (shlex.join); the extra arguments follow it unchanged.
eval "exec $cmd \"\$@\""
