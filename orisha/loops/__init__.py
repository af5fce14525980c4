"""Loop bodies: the only code that waits for I/O.

Strategy: each module here implements ``orisha.loops.base.LoopBody`` on one
platform facility. The choice is made once, by name, in ``load`` — nowhere else
— and only the chosen module (and its library) is ever imported.
"""

from __future__ import annotations

import importlib

# name → module; "auto" is resolved by orisha.server.resolve_loop.
MODULES = {
    "epoll": "orisha.loops.epoll",
    "kqueue": "orisha.loops.kqueue",
    "asyncio": "orisha.loops.asyncio",
}


class LoopUnavailable(Exception):
    """The loop cannot run here; the message says why."""


def load(name: str):
    """Import the chosen loop body's module and return its ``LoopBody`` class."""
    try:
        module = MODULES[name]
    except KeyError:
        raise LoopUnavailable(f"unknown loop {name!r} (choose from {', '.join(MODULES)})") from None
    try:
        return importlib.import_module(module).Loop
    except ImportError as e:
        raise LoopUnavailable(f"loop {name!r} is not available here: {e}") from None
