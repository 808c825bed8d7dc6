"""The pool's media policy: images named by URL become inline ``data:`` URLs, or a 400.

``Pool.admit`` runs every request that carries images through one :class:`MediaLoader`
before it is queued (issue #19; vLLM's CVE-2025-6242 is the fetching anchor). See
``docs/operations.md`` ("Images") for the settings and ``REFUSAL_REASONS`` for the
``reason`` of an ``image_refused`` error.
"""

from pool.media._addresses import GuardedNetwork, Resolver, public_address, system_resolver
from pool.media._images import IMAGE_TYPES, data_url_bytes, sniff_image_type
from pool.media._loader import MediaLoader
from pool.media._refusal import REFUSAL_REASONS

__all__ = [
    "IMAGE_TYPES",
    "REFUSAL_REASONS",
    "GuardedNetwork",
    "MediaLoader",
    "Resolver",
    "data_url_bytes",
    "public_address",
    "sniff_image_type",
    "system_resolver",
]
