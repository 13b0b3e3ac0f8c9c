"""The S3-compatible object storage tier (:class:`S3Tier`), one module per job:

- :mod:`~tiers.s3.tier`: the tier (index and byte budget, batches on the thread pools);
- :mod:`~tiers.s3.client`: boto3 clients, the bucket check, sorting botocore's errors;
- :mod:`~tiers.s3.http`: single-object GET/PUT/DELETE without botocore's per-call pipeline;
- :mod:`~tiers.s3.io`: object names and the object format (header + payload), streamed;
- :mod:`~tiers.s3.stage`: per-thread staging and upload buffers.

Endpoint health (fail fast, probe with backoff) is :mod:`tiers._health`, shared with the
Redis and Mooncake tiers. boto3 is imported only when a tier is built.
"""

from kvstore.tiers.s3.tier import S3Tier

__all__ = ["S3Tier"]
