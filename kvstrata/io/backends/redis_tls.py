"""TLS for the Redis tiers: one client ``SSLContext`` per tier, shared by
all of its connections.

redis-py builds a context for every new connection, on the event loop and
inside the connect timeout: ``ssl.create_default_context()`` loads and
parses the system CA store each time (30 ms on an idle host, 300 ms and
more on a loaded one). Eight reads that open eight connections at once
then block the loop for seconds and time out connecting although every
server answers. The tier builds its context once, in a thread, at start;
:class:`SharedContextSSLConnection` hands it to each connection.
"""

from __future__ import annotations

import ssl

import structlog
from redis.asyncio.connection import SSLConnection

from kvstrata.io.config import RedisTLSOptions

log = structlog.get_logger(__name__)


def tls_context(o: RedisTLSOptions, tier: str) -> ssl.SSLContext:
    """The client context ``o`` asks for (call it off the loop: it reads
    files). The server is verified against ``ssl_ca_certs``, else the
    system's CA store, and its host name unless ``ssl_check_hostname`` is
    false; ``ssl_insecure_skip_verify`` accepts any certificate (logged).
    A file that cannot be loaded is a configuration error (ValueError)."""
    try:
        if o.ssl_insecure_skip_verify:
            log.warning("redis_tls_verification_disabled", tier=tier,
                        reason="ssl_insecure_skip_verify is set: any certificate is accepted")
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        else:
            ctx = ssl.create_default_context(cafile=o.ssl_ca_certs)  # no CA file: the system store
            ctx.check_hostname = o.ssl_check_hostname
        if o.ssl_certfile:
            ctx.load_cert_chain(o.ssl_certfile, o.ssl_keyfile)
    except OSError as e:  # ssl.SSLError is one too
        raise ValueError(f"{tier}: cannot load the TLS files (ssl_ca_certs / ssl_certfile / ssl_keyfile): {e}") from e
    return ctx


class SharedContextSSLConnection(SSLConnection):
    """A redis-py TLS connection on a context built beforehand
    (``shared_ssl_context``) instead of one of its own."""

    def __init__(self, *, shared_ssl_context: ssl.SSLContext, **kwargs) -> None:
        super().__init__(**kwargs)
        # RedisSSLContext.get() builds its context only while this is None.
        self.ssl_context.context = shared_ssl_context
