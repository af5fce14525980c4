"""Protocols around the HTTP/1.1 core: TLS (``tls.py``), HTTP/2 (``h2.py``) and the
cleartext front that tells HTTP/1.1 from h2c (``front.py``). Each implements the
loop-body contract of ``orisha/loops/base.py``, so no loop body knows they exist.
Like the core, nothing here imports socket, select, time or asyncio."""
