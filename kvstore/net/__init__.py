"""The cache server and its client, and what the two ends share.

* :mod:`kvstore.net.protocol` — the wire format (frames and bodies; pure functions).
* :mod:`kvstore.net.auth` — the HELLO challenge-response proof.
* :mod:`kvstore.net.staging` — where a same-host client's staging region lives.
* :mod:`kvstore.net.tls` — TLS contexts and checks for ``server.tls`` and ``Client(tls=...)``.
* :mod:`kvstore.net.nixl` — NIXL: availability, the agent wrapper, descriptor lists.
* :mod:`kvstore.net.client` — :class:`~kvstore.net.client.Client`, one module per transport
  (``tcp``, ``shm``, ``nixl``; ``wire`` is the connection, ``selection`` picks the transport).
  It never imports the Store or the server (an import-linter contract).
* :mod:`kvstore.net.server` — the server (``kvstore serve``): listeners, connections, the
  same-host arena, NIXL, the admin port, metrics, tenants.

The public names stay where they were: ``kvstore.Client`` / ``kvstore.client.Client``,
``kvstore.server.Server`` / ``run_server``, ``kvstore.transport.select_transport``.
"""
