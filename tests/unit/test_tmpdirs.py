"""Private temp directories do not outlive their owners: a dead owner's are swept by the next
one made with the same prefix, a live owner's and other programs' are left alone, and
``baton serve`` removes its own when it stops."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from baton.launcher import Cluster, ClusterSpec
from shared import tmpdirs
from shared.tmpdirs import OWNER_FILE, make_private_dir, sweep_stale


def owned(root: Path, name: str, pid: int | None) -> Path:
    path = root / name
    path.mkdir()
    if pid is not None:
        (path / OWNER_FILE).write_text(str(pid))
    return path


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_dead_owners_directories_are_swept(tmp_path: Path) -> None:
    dead = owned(tmp_path, "baton-core-dead", dead_pid())
    live = owned(tmp_path, "baton-core-live", os.getpid())
    foreign = owned(tmp_path, "baton-core-foreign", None)  # no owner file: not ours to judge
    other = owned(tmp_path, "baton-serve-dead", dead_pid())  # another prefix
    assert sweep_stale("baton-core-", root=str(tmp_path)) == [dead]
    assert not dead.exists() and live.exists() and foreign.exists() and other.exists()


def test_a_new_directory_sweeps_and_records_its_owner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tmpdirs.tempfile, "tempdir", str(tmp_path))
    stale = owned(tmp_path, "baton-serve-old", dead_pid())
    fresh = make_private_dir("baton-serve-")
    assert not stale.exists()
    assert (fresh / OWNER_FILE).read_text() == str(os.getpid())


def test_baton_serve_removes_its_directory_when_it_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tmpdirs.tempfile, "tempdir", str(tmp_path))
    cluster = Cluster(ClusterSpec(model="m"))
    assert cluster.tmp.is_dir() and cluster.tmp.parent == tmp_path
    cluster.stop()
    assert not cluster.tmp.exists()
