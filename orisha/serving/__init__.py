"""Serving a build on the host: the listeners, the worker processes and what runs beside them.

Strategy: ``server.run`` is the one entry (``orisha serve`` and ``orisha.serve()``): it
loads the build, claims the ports (``ports``: who holds one that is taken), makes the TLS
and QUIC configuration and hands the listeners to a ``supervisor.Supervisor``. The
supervisor forks the workers (``pool``), reloads and renews them, and answers the admin
port (``admin``: /healthz, /readyz, /metrics, from the workers' shared counters in
``stats``); certificates come from files it watches (``watch``) or from ACME (``acme``).
Each worker runs a loop body (orisha/loops) over the core and knows nothing of this
package. The package is named for what it does: ``orisha.serve`` is the API function.
"""
