"""The unikernel target: ``image`` (site image + kernel link) and ``boot`` (QEMU)."""
