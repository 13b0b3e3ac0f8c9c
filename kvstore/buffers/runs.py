"""Cutting a batch into runs of bounded bytes: how many blocks one tier call moves."""

from __future__ import annotations

from typing import Iterator, Sequence


def runs(sizes: Sequence[int], cap: int) -> Iterator[list[int]]:
    """The indexes of ``sizes``, in order, in runs whose sizes sum to at most ``cap``; an
    item larger than ``cap`` goes alone."""
    run: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if run and total + size > cap:
            yield run
            run, total = [], 0
        run.append(i)
        total += size
    if run:
        yield run
