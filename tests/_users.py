"""A second OS user for the tests of another user's reach (issue 20, findings 5 and 7).

As root the user ``kvstore-test`` is created when absent (a system user: no home, no
login shell) and code runs as it in a forked child (no imports there: root's Python
tree may be unreadable to it). Anywhere else the tests skip with the reason.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from typing import Callable

import pytest

NAME = "kvstore-test"


def other_user() -> tuple[int, int]:
    """``(uid, gid)`` of the second user; skips the calling test where there is none."""
    if os.geteuid() != 0:
        pytest.skip(f"needs root: the test creates a second OS user ({NAME}) and acts as it; "
                    "an unprivileged run cannot switch users")
    try:
        entry = pwd.getpwnam(NAME)
    except KeyError:
        useradd = shutil.which("useradd")
        if useradd is None:
            pytest.skip(f"needs useradd to create the second OS user {NAME}")
        subprocess.run([useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", NAME],
                       check=True, capture_output=True)
        entry = pwd.getpwnam(NAME)
    assert entry.pw_uid != 0
    return entry.pw_uid, entry.pw_gid


def run_as(uid: int, gid: int, action: Callable[[], int]) -> int:
    """Run ``action`` as ``uid:gid`` in a forked child; its return value (or 99 when it
    raised) is the exit code returned here."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            code = action()
        except BaseException:
            code = 99
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


__all__ = ["NAME", "other_user", "run_as"]
