"""The distribution's name and the install line for an optional extra, in one place.

The package installs as ``kvstore-cache`` (the name ``kvstore`` on the package index is an
unrelated project) and imports as ``kvstore``. Every "this needs extra X" message uses
:func:`install_hint`, so no message points at the wrong distribution.
"""

from __future__ import annotations

DISTRIBUTION = "kvstore-cache"


def install_hint(extra: str) -> str:
    """How to install ``extra`` (for ``"s3"``: ``pip install 'kvstore-cache[s3]'``), and
    the form for a checkout."""
    return f"pip install '{DISTRIBUTION}[{extra}]', or in a checkout pip install -e '.[{extra}]'"


__all__ = ["DISTRIBUTION", "install_hint"]
