"""Review 3 of f22d71a: a symlink whose target this user may not search is
called a link "which leads nowhere".

``_refuse_dangling`` takes ``os.path.exists`` False for "no target", but
``exists`` is False on EACCES too: a store path through a link into a
directory the service user may not enter is a ConfigError telling it to
"create the link's target (or mount its file system)", where the target is
there and the fix is a permission (before f22d71a: a TierError "permission
denied", naming the access to give). Real directories and a real user
without the permission (as root: the child runs as ``nobody`` through
``setpriv``): no mock.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)


def test_link_into_unsearchable_directory_is_a_permission_error() -> None:
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: no user to lack the permission")
    base = Path(tempfile.mkdtemp(prefix="ucm-review3-"))
    try:
        base.chmod(0o755)
        (base / "secret" / "sub").mkdir(parents=True)
        (base / "link").symlink_to(base / "secret" / "sub")
        (base / "secret").chmod(0o000)
        code = ("import ucm_db\ntry:\n    ucm_db.open(%r)\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
                % str(base / "link" / "store"))
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        out = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env=env, cwd="/", check=False)
        assert out.stdout.startswith("TierError") and "permission denied" in out.stdout, out.stdout + out.stderr[-300:]
    finally:
        (base / "secret").chmod(0o700)
        shutil.rmtree(base, ignore_errors=True)
