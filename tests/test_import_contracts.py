"""The import rules in ``.importlinter`` hold: ``lint-imports`` (import-linter) passes on
the tree, and it does fail, naming the contract, when a rule is broken."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _lint_imports(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    cmd = str(exe) if exe.exists() else shutil.which("lint-imports")
    assert cmd, "lint-imports not found: install the test extra (pip install -e '.[test]')"
    return subprocess.run([cmd, "--no-cache", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_every_import_contract_is_kept():
    out = _lint_imports(str(ROOT / ".importlinter"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_a_broken_contract_fails_and_is_named(tmp_path):
    # keys.py imports errors.py: a rule forbidding that must be reported broken
    config = tmp_path / "broken.ini"
    config.write_text("[importlinter]\nroot_packages =\n    kvstore\n\n"
                      "[importlinter:contract:keys-alone]\nname = keys imports nothing\ntype = forbidden\n"
                      "source_modules =\n    kvstore.keys\nforbidden_modules =\n    kvstore.errors\n")
    out = _lint_imports(str(config))
    assert out.returncode != 0
    assert "keys imports nothing BROKEN" in out.stdout and "kvstore.keys -> kvstore.errors" in out.stdout
