"""The import rules in ``.importlinter`` hold: ``lint-imports`` (import-linter) passes on
the tree, and it does fail, naming the contract, when a rule is broken.

``tiers/``, ``policies/`` and ``connectors/`` install as ``kvstore.tiers``,
``kvstore.policies`` and ``kvstore.connectors`` (pyproject.toml's ``package-dir``); the
links ``kvstore/tiers -> ../tiers`` (and so on) give the checkout that layout, so
import-linter, which finds a package's modules by walking its folder, lints the tree as
it is: plain ``lint-imports`` in the checkout is the same check."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAPPED = ("tiers", "policies", "connectors")


def test_the_checkout_links_the_mapped_folders_into_kvstore():
    for name in MAPPED:
        link = ROOT / "kvstore" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve(), f"kvstore/{name} -> ../{name}"


def _lint_imports(config: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    cmd = str(exe) if exe.exists() else shutil.which("lint-imports")
    assert cmd, "lint-imports not found: install the test extra (pip install -e '.[test]')"
    return subprocess.run([cmd, "--no-cache", str(config)], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_every_import_contract_is_kept():
    out = _lint_imports(ROOT / ".importlinter")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout
    assert "kvstore.tiers" in out.stdout or "Tiers" in out.stdout   # the mapped packages were linted


def _lint_one_rule(tmp_path: Path, name: str, source: str, forbidden: str) -> str:
    """Lint the tree against one rule, "``source`` never imports ``forbidden``"; its output."""
    config = tmp_path / "one.ini"
    config.write_text(f"[importlinter]\nroot_packages =\n    kvstore\n\n"
                      f"[importlinter:contract:one]\nname = {name}\ntype = forbidden\n"
                      f"source_modules =\n    {source}\nforbidden_modules =\n    {forbidden}\n")
    out = _lint_imports(config)
    assert out.returncode != 0, out.stdout + out.stderr
    return out.stdout


def test_a_broken_contract_fails_and_is_named(tmp_path):
    # keys.py imports errors.py: a rule forbidding that must be reported broken
    out = _lint_one_rule(tmp_path, "keys imports nothing", "kvstore.keys", "kvstore.errors")
    assert "keys imports nothing BROKEN" in out and "kvstore.keys -> kvstore.errors" in out


def test_a_broken_rule_in_a_mapped_folder_is_seen(tmp_path):
    # the tiers/ folder is linted as kvstore.tiers: its imports of kvstore.buffers are real edges
    out = _lint_one_rule(tmp_path, "dram imports no buffers", "kvstore.tiers.dram",
                         "kvstore.buffers")
    assert "dram imports no buffers BROKEN" in out


def test_the_no_engine_rule_names_every_kvstore_module_but_the_connectors():
    parser = configparser.ConfigParser()
    parser.read(ROOT / ".importlinter")
    listed = set(parser["importlinter:contract:core-no-engine"]["source_modules"].split())
    present = {f"kvstore.{p.stem}" for p in (ROOT / "kvstore").iterdir()
               if (p.suffix == ".py" and p.stem not in ("__init__", "__main__"))
               or (p.is_dir() and not p.is_symlink() and (p / "__init__.py").exists())}
    present |= {"kvstore.tiers", "kvstore.policies"}
    assert listed == present, f"add to core-no-engine: {sorted(present - listed)}; gone: {sorted(listed - present)}"


def test_the_public_names_rule_forbids_every_private_core_module():
    parser = configparser.ConfigParser()
    parser.read(ROOT / ".importlinter")
    forbidden = set(parser["importlinter:contract:connectors-public-names"]["forbidden_modules"].split())
    private = {f"kvstore.{p.stem}" for p in (ROOT / "kvstore").glob("_*.py") if p.stem not in ("__init__", "__main__")}
    assert private <= forbidden, f"add to connectors-public-names: {sorted(private - forbidden)}"
