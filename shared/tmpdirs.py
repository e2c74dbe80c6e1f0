"""Private temporary directories that do not outlive their owner: each records the pid that
made it, and the next process to make one with the same prefix removes those whose owner is
gone (killed with SIGKILL, or a machine's crash), so ``/tmp`` does not fill up over restarts.

    make_private_dir("baton-core-")  → /tmp/baton-core-XXXX/ with owner.pid; stale ones swept
"""

import os
import shutil
import tempfile
from pathlib import Path

OWNER_FILE = "owner.pid"


def make_private_dir(prefix: str) -> Path:
    """A new directory (mode 0700, as ``mkdtemp`` makes it) owned by this process, after
    removing the stale ones of the same prefix."""
    sweep_stale(prefix)
    path = Path(tempfile.mkdtemp(prefix=prefix))
    (path / OWNER_FILE).write_text(str(os.getpid()))
    return path


def sweep_stale(prefix: str, root: str | None = None) -> list[Path]:
    """Remove this user's ``{root}/{prefix}*`` directories whose recorded owner is not alive;
    returns them. A directory without an owner file (another program's) is left alone."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{prefix}*"):
        try:
            if not path.is_dir() or path.stat().st_uid != os.getuid():
                continue
            pid = int((path / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    """Whether a process has this pid (another user's counts: kill(0) then says EPERM)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
