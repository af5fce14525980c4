"""The Python peer users might pick instead: aiohttp's static file handler.

Serves the same exported root as nginx (identity files with .gz/.br siblings,
which aiohttp's FileResponse sends when Accept-Encoding allows).
"""

import sys

from aiohttp import web

root, port = sys.argv[1], int(sys.argv[2])
app = web.Application()
app.router.add_static("/", root, show_index=False)
web.run_app(app, host="127.0.0.1", port=port, print=lambda *a: print("aiohttp ready", flush=True),
            access_log=None)
