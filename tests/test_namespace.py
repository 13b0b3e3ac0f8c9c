"""One import namespace: ``tiers/``, ``policies/`` and ``connectors/`` install as
``kvstore.tiers``, ``kvstore.policies`` and ``kvstore.connectors``, and nothing installs or
imports a top-level ``tiers``, ``policies`` or ``connectors`` package."""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAPPED = ("tiers", "policies", "connectors")
_TOP_LEVEL = re.compile(r"^\s*(?:from|import)\s+(tiers|policies|connectors)\b", re.M)


def _folder_packages() -> set[str]:
    out = set()
    for init in (i for top in ("kvstore", *MAPPED) for i in (ROOT / top).glob("**/__init__.py")):
        parts = init.parent.relative_to(ROOT).parts
        if parts[0] == "kvstore":
            out.add(".".join(parts))
        elif parts[0] in MAPPED:
            out.add(".".join(("kvstore", *parts)))
    return out


def test_pyproject_lists_every_package_under_the_kvstore_name():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {f"kvstore.{m}": m for m in MAPPED}
    assert set(setuptools["packages"]) == _folder_packages()


def test_no_source_imports_a_top_level_tiers_policies_or_connectors():
    offenders = []
    for folder in ("kvstore", *MAPPED, "tests", "benchmarks", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            for m in _TOP_LEVEL.finditer(path.read_text()):
                offenders.append(f"{path.relative_to(ROOT)}: {m.group(0).strip()}")
    assert not offenders, "import these as kvstore.<name>: " + "; ".join(offenders)


def test_outside_the_checkout_only_the_kvstore_names_import(tmp_path):
    code = ("import importlib.util, sys\n"
            "import kvstore.tiers.dram, kvstore.policies, kvstore.connectors, kvstore.store\n"
            "assert kvstore.tiers.dram.DramTier\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tiers', 'policies', 'connectors')))\n"
            "print([importlib.util.find_spec(m) is None for m in ('tiers', 'policies', 'connectors')])\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # as installed, not a checkout on the path
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", "[True, True, True]"]


def test_the_wheel_holds_the_folders_inside_kvstore(tmp_path):
    # built from a copy of the checkout, its kvstore/tiers (etc.) links kept as links:
    # setuptools writes build/ and *.egg-info beside the sources
    src = tmp_path / "src"
    for name in ("kvstore", *MAPPED):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = tmp_path.glob("kvstore_cache-*.whl")   # the distribution's name; it imports as kvstore
    names = zipfile.ZipFile(wheel).namelist()
    for must in ("kvstore/tiers/dram.py", "kvstore/tiers/nvme/tier.py", "kvstore/policies/lru.py",
                 "kvstore/connectors/vllm.py", "kvstore/store/facade.py", "kvstore/py.typed"):
        assert must in names, must
    assert [n for n in names if n.endswith(".dist-info/METADATA")], names
    assert any("dist-info" in n and n.rsplit("/", 1)[-1] == "LICENSE" for n in names), "LICENSE is not shipped"
    assert not [n for n in names if n.split("/")[0] in MAPPED], "a top-level package would be installed"
    assert len(names) == len(set(names)), "a file is in the wheel twice"


def test_a_bare_checkout_on_sys_path_imports_the_mapped_names(tmp_path):
    # no install at all: -S skips site's .pth files (so no editable finder); the checkout and
    # the dependencies are on PYTHONPATH, as for a peer venv or a benchmark's sys.path.insert:
    # the kvstore/tiers (etc.) links make the names resolve
    code = ("import sys, pathlib, kvstore.tiers.dram as d, kvstore.policies as p, kvstore.store\n"
            "print(pathlib.Path(d.__file__).resolve()); print(pathlib.Path(p.__file__).resolve())\n"
            "print(any(type(f).__name__ == '_EditableFinder' for f in sys.meta_path))\n")
    env = {"PYTHONPATH": f"{ROOT}:{site.getsitepackages()[0]}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [str(ROOT / "tiers" / "dram.py"), str(ROOT / "policies" / "__init__.py"),
                                       "False"]
