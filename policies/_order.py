"""Private helpers shared by the eviction policies: walking an ``OrderedDict`` queue
head-first while the Store evicts (and so mutates it) between yields.

Not thread-safe; callers hold the Store's lock.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice
from typing import Hashable, Iterator

# After this many skipped (still held) keys the walk takes one snapshot of the rest
# instead of re-seeking past the skipped prefix on every step, so a long run of
# leased or pinned keys costs O(n) once rather than O(n^2).
_SNAPSHOT_AFTER_SKIPS = 16


def iter_live(order: OrderedDict[Hashable, object]) -> Iterator[Hashable]:
    """Yield the keys of ``order`` head-first, tolerating removals between yields.

    A key the caller removed after it was yielded simply drops out; a key it skipped
    (still present on resumption) is stepped over. Every yielded key is held at the
    moment it is yielded. O(1) per yield while the caller evicts what it is given;
    at most one O(n) snapshot when it skips many keys.
    """
    skipped = 0
    while True:
        key = next(islice(order, skipped, None), _END)
        if key is _END:
            return
        yield key
        if key in order:
            skipped += 1
            if skipped >= _SNAPSHOT_AFTER_SKIPS:
                break
    for key in list(islice(order, skipped, None)):
        if key in order:
            yield key


_END = object()
