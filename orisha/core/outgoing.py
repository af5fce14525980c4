"""The ``outgoing`` bookkeeping of the loop-body contract.

Strategy: a loop body writes the front of ``outgoing`` and reports how many
bytes went out with ``sent(n)``; the connection then drops those bytes — whole
buffers, and the written part of a partly written one as a memoryview (no
copy). The HTTP/1.1 connection (which checks the common case, everything
written, inline) and the TLS and HTTP/2 layers share this function.
"""

from __future__ import annotations


def consume(out: list, total: int, n: int) -> int:
    """Drop the first ``n`` bytes of ``out`` (``total`` bytes in all); returns the bytes left."""
    if n >= total:
        out.clear()
        return 0
    left = total - n
    while n:
        size = len(out[0])
        if n < size:
            out[0] = memoryview(out[0])[n:]
            break
        n -= size
        del out[0]
    return left
