"""A second user on this machine, real (``useradd``, then ``runuser``), for the tests where whose a process or a file
is matters: another user's lock file (tests/machine/test_lock.py), another user's processes that are not ours to
read (tests/machine/test_unread.py). Making the user and running as it need root: :data:`root_only` skips without."""

from __future__ import annotations

import contextlib
import os
import pwd
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tuner.machine import processes

USER = "moetune-2nd"
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="a second user is made and run as with runuser: needs root")


def second_user() -> pwd.struct_passwd:
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(USER)
    made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
                          capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        pytest.skip(f"no second user could be made: {made.stderr.strip()}")
    return pwd.getpwnam(USER)


def python_for(user: str) -> str:
    """An interpreter the user may run (this venv's may live in root's home), with this venv's packages."""
    for exe in (sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"):
        ok = subprocess.run(["runuser", "-u", user, "--", exe, "-c", "import psutil"], capture_output=True,
                            env=user_env(), timeout=60)
        if ok.returncode == 0:
            return exe
    pytest.skip(f"no Python {sys.version_info.major}.{sys.version_info.minor} that {user} may run")


def user_env(*, scoped: bool = True) -> dict[str, str]:
    """The environment a second user's Python runs with: this checkout and its packages on the path; the suite's
    machine scope where ``scoped``."""
    site = next(p for p in sys.path if p.endswith("site-packages"))
    keep = ("PATH", "LANG", processes.SCOPE_ENV) if scoped else ("PATH", "LANG")
    env = {k: v for k, v in os.environ.items() if k in keep}
    return env | {"PYTHONPATH": f"{REPO}{os.pathsep}{site}"}
