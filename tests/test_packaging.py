"""What pyproject.toml promises a user: the distribution's name (``kvstore-cache``: the
name ``kvstore`` on the package index is another project), no torch among the core
dependencies, no empty extras, the license, URLs and ``py.typed``; and no install hint
in the code or the docs pointing at the wrong distribution or at a missing extra."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from kvstore._extras import DISTRIBUTION, install_hint

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
_WRONG = re.compile(r"(?<![\w-])kvstore\[")   # pip install 'kvstore[x]': another project's package
_EXTRA = re.compile(r"""(?:kvstore-cache|-e '\.|-e "\.|-e \.)\[([\w,]+)\]""")


def test_the_distribution_is_kvstore_cache_and_imports_as_kvstore():
    assert PROJECT["name"] == DISTRIBUTION == "kvstore-cache"
    assert PROJECT["scripts"] == {"kvstore": "kvstore.cli:main"}
    assert install_hint("s3") == "pip install 'kvstore-cache[s3]', or in a checkout pip install -e '.[s3]'"


def test_torch_is_an_extra_not_a_core_dependency():
    assert not [d for d in PROJECT["dependencies"] if re.match(r"torch\b", d)]
    for extra in ("torch", "gpu", "demo", "test"):
        assert any(re.match(r"torch\b", d) for d in EXTRAS[extra]), extra
    assert "msgspec>=0.18" in EXTRAS["events"] and "pytest>=8" in EXTRAS["testing"]


def test_no_extra_is_empty():
    assert not [name for name, deps in EXTRAS.items() if not deps]


def test_license_urls_classifiers_and_py_typed():
    assert PROJECT["license"] == {"text": "Apache-2.0"}
    assert "Apache License\n                           Version 2.0, January 2004" in (ROOT / "LICENSE").read_text()
    assert "License :: OSI Approved :: Apache Software License" in PROJECT["classifiers"]
    assert {"Homepage", "Repository", "Issues", "Documentation", "Changelog"} <= set(PROJECT["urls"])
    assert (ROOT / "kvstore" / "py.typed").exists()
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "py.typed" in setuptools["package-data"]["kvstore"]
    assert "## [Unreleased]" in (ROOT / "CHANGELOG.md").read_text()


def _hint_files():
    for folder in ("kvstore", "tiers", "policies", "connectors", "benchmarks", "scripts", "docs"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md", ".sh") and path.is_file():
                yield path
    yield ROOT / "README.md"


def test_every_install_hint_names_this_distribution_and_a_real_extra():
    bad = []
    for path in _hint_files():
        text = path.read_text()
        bad += [f"{path.relative_to(ROOT)}: {m.group(0)}..." for m in _WRONG.finditer(text)]
        bad += [f"{path.relative_to(ROOT)}: [{e}] is no extra" for m in _EXTRA.finditer(text)
                for e in m.group(1).split(",") if e not in EXTRAS]
    assert not bad, bad
