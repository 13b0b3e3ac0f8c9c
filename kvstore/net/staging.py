"""Where a same-host client's staging region lives (``docs/protocol.md``, same host): the
client creates ``STAGING_DIR/STAGING_PREFIX<random>`` for its puts
(:mod:`kvstore.net.client.wire`), the server maps it (:mod:`kvstore.net.server._shm`) and
never removes it as a stale arena at start (:mod:`kvstore.net.server._paths`). Both ends
import these names from here."""

STAGING_DIR = "/dev/shm"
STAGING_PREFIX = "kvstore-client-"

__all__ = ["STAGING_DIR", "STAGING_PREFIX"]
