"""One Store process sharing an S3 bucket (run by tests/test_s3_faults.py):
``python -m tests._s3_proc save|load <endpoint> <bucket> <prefix> <blocks> <block bytes>``.
Prints one JSON line. Credentials come from the environment (the standard AWS chain)."""

import json
import sys

import numpy as np

from kvstore.keys import Namespace
from kvstore.store import Store
from kvstore.testing import payload


def main(mode: str, endpoint: str, bucket: str, prefix: str, blocks: str, nbytes: str) -> None:
    n, size = int(blocks), int(nbytes)
    keys = Namespace(model="shared", dtype="uint8", chunk_tokens=16).chunk_keys(np.arange(16 * n))
    cfg = {"tiers": [{"name": "shared", "kind": "s3", "capacity": "256MiB", "bucket": bucket,
                      "endpoint_url": endpoint, "region": "us-east-1", "addressing_style": "path",
                      "prefix": prefix}]}
    with Store.from_config(cfg) as store:
        if mode == "save":
            ok = store.save(keys, [payload(i, size) for i in range(n)]).result()
            print(json.dumps({"saved": sum(ok)}))
            return
        hit = store.lookup(keys)
        dsts = [np.zeros(size, np.uint8) for _ in range(n)]
        ok = store.load(keys, dsts).result()
        exact = all(np.array_equal(d, payload(i, size)) for i, d in enumerate(dsts))
        print(json.dumps({"lookup": hit, "loaded": sum(ok), "exact": exact,
                          "parents": sum(k.parent is not None for k in store.tiers[0].keys())}))


if __name__ == "__main__":
    main(*sys.argv[1:])
