"""Deployment targets beyond the hosted server: each keeps its build-time and run-time code together.

- ``container``: ``build`` freezes Orisha into one static executable with the build
  appended; ``runtime`` is that executable's entry point.
- ``unikernel``: ``image`` lays the site out for the C core and links the kernel;
  ``boot`` runs it under QEMU; ``policy_header`` writes the C core's policy header.
"""
