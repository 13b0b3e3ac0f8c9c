"""Running from a source checkout without installing it: ``tiers/``, ``policies/`` and
``connectors/`` sit beside ``kvstore/`` in the repository and install as
``kvstore.tiers``, ``kvstore.policies`` and ``kvstore.connectors`` (pyproject.toml's
``package-dir``). An installed copy (wheel or editable) resolves those names itself; a
checkout put on ``sys.path`` by hand (the benchmarks' ``sys.path.insert``, a peer venv
with ``PYTHONPATH=<repo>``) gets this finder, which maps exactly those three names."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

MAPPED = ("tiers", "policies", "connectors")


class _CheckoutFinder:
    """Finds ``kvstore.<name>`` for the three mapped folders of one checkout."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        head, _, name = fullname.partition(".")
        if head != "kvstore" or name not in MAPPED:
            return None
        folder = self.root / name
        return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def install(package_dir: Path) -> None:
    """Add the finder when ``package_dir`` (``kvstore/``) is a checkout's, not an install's."""
    root = package_dir.parent
    if (package_dir / MAPPED[0]).exists() or not (root / "pyproject.toml").is_file():
        return                      # installed (the folders are inside kvstore/), or no checkout
    if not all((root / name / "__init__.py").is_file() for name in MAPPED):
        return
    if any(isinstance(f, _CheckoutFinder) and f.root == root for f in sys.meta_path):
        return
    sys.meta_path.append(_CheckoutFinder(root))


__all__ = ["install"]
