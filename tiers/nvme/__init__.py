"""The local NVMe tier (:class:`NvmeTier`), one module per job:

- :mod:`~tiers.nvme.tier`: the tier (the Tier contract, write and read batches, commits);
- :mod:`~tiers.nvme.files`: a directory's data files, its space allocator and lock;
- :mod:`~tiers.nvme.index`: a directory's LMDB index, the source of truth after a restart;
- :mod:`~tiers.nvme.open`: start-up, rebuilding a directory's state from its index;
- :mod:`~tiers.nvme.io`: block I/O on one data file (header page + payload, ``O_DIRECT``);
- :mod:`~tiers.nvme.batch`: how one batch is spread over the I/O threads in runs;
- :mod:`~tiers.nvme.readahead`: sequential read-ahead between batches;
- :mod:`~tiers.nvme.gpu` and :mod:`~tiers.nvme.kvikio`: CUDA buffers (GPUDirect Storage);
- :mod:`~tiers.nvme.fsck`: the offline check behind ``kvstore fsck``.
"""

from kvstore.tiers.nvme.tier import NvmeTier

__all__ = ["NvmeTier"]
