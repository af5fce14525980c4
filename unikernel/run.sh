#!/bin/sh
# Boot an Orisha unikernel image under QEMU, serving on 127.0.0.1:PORT.
#   unikernel/run.sh IMAGE PORT [extra qemu args...]
# Environment:
#   ACCEL=kvm|tcg        default: kvm if /dev/kvm is usable, else tcg
#   MACHINE=microvm|pc|q35   default: microvm (virtio-mmio); pc/q35 use virtio-net-pci
#   MEM=64M              guest RAM
#   APPEND="..."         extra kernel command line (e.g. orisha.exit=ready)
# Serial console goes to stdout. The guest exits QEMU through isa-debug-exit:
# status 1 = clean exit request, 255 = PANIC (QEMU reports (code << 1) | 1).
set -eu
[ $# -ge 2 ] || { echo "usage: $0 IMAGE PORT [qemu args...]" >&2; exit 2; }
image=$1
port=$2
shift 2
qemu=${QEMU:-qemu-system-x86_64}
machine=${MACHINE:-microvm}
mem=${MEM:-64M}
if [ -z "${ACCEL:-}" ]; then
    if [ -r /dev/kvm ] && [ -w /dev/kvm ]; then ACCEL=kvm; else ACCEL=tcg; fi
fi
case "$ACCEL" in
    kvm) accel="-accel kvm -cpu host,-arch-capabilities" ;;
    tcg) accel="-accel tcg -cpu max" ;;
    *) echo "run.sh: ACCEL must be kvm or tcg" >&2; exit 2 ;;
esac
case "$machine" in
    microvm)
        mach="-machine microvm,acpi=off,x-option-roms=off,pic=off,rtc=on,isa-serial=on"
        nic="-device virtio-net-device,netdev=n0"
        ;;
    pc|q35)
        mach="-machine $machine"
        nic="-device virtio-net-pci,netdev=n0,disable-legacy=off,disable-modern=on"
        ;;
    *) echo "run.sh: MACHINE must be microvm, pc or q35" >&2; exit 2 ;;
esac
# shellcheck disable=SC2086
exec "$qemu" $mach $accel -m "$mem" -nodefaults -no-user-config -display none \
    -serial stdio -no-reboot \
    -kernel "$image" ${APPEND:+-append "$APPEND"} \
    -netdev "user,id=n0,hostfwd=tcp:127.0.0.1:$port-:80" $nic \
    -device isa-debug-exit,iobase=0xf4,iosize=0x04 \
    "$@"
