"""The sans-I/O request core: HTTP policy (``policy``), parsing (``request``),
header interpretation (``negotiate``), the compiled site's classes (``site``),
dates, and the per-connection state machine (``connection``).

Nothing here imports socket, select, time, asyncio or a ring library.
"""
