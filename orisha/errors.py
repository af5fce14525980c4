"""The one error base class whose message the CLI prints as its one line.

Strategy: every expected failure (a bad path, a port in use, a build that is
not one, a loop the platform lacks, a boot that fails) raises a subclass of
``OrishaError`` whose message names the file or option and the problem. The
CLI catches ``OrishaError`` alone and prints ``orisha: error: MESSAGE``;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class OrishaError(Exception):
    """An expected failure; ``str(e)`` is one line naming the file and the problem."""


class BuildError(OrishaError):
    """A build that cannot go on."""


class ServeError(OrishaError):
    """A start-up problem of a hosted server."""


class BootError(OrishaError):
    """A unikernel boot that failed (the serial log is printed separately)."""


class LoopUnavailable(OrishaError):
    """The chosen loop body cannot run here; the message says why."""
