"""The build step: walk a site, compress, assemble every response, emit the build.

Target-specific packaging (the container executable, the unikernel image)
lives in ``orisha.targets``; this package writes the ordinary build every
target starts from.
"""
