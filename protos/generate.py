"""Generate the Python gRPC stubs for ``protos/baton/v1/*.proto`` into ``shared/protos/``.

    python protos/generate.py            # write shared/protos/baton/v1/*_pb2*.py(i)
    python protos/generate.py --check    # exit 1 if the committed stubs are stale

protoc writes imports as ``from baton.v1 import common_pb2``, which would resolve to Baton's own
``baton`` package; they are rewritten to ``from shared.protos.baton.v1 import ...``.
"""

import argparse
import difflib
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT / "shared" / "protos"
PACKAGE = "shared.protos"


def generate(out_dir: Path) -> list[Path]:
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.glob("baton/v1/*.proto"))
    import grpc_tools

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{well_known}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            *protos,
        ]
    )
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")
    written = sorted(p for p in (out_dir / "baton").rglob("*") if p.is_file())
    for path in written:
        text = path.read_text().replace("from baton.v1 import", f"from {PACKAGE}.baton.v1 import")
        path.write_text(text)
    for pkg in (out_dir / "baton", out_dir / "baton" / "v1"):
        (pkg / "__init__.py").touch()
    return written


def stale_files() -> list[str]:
    """Names of stubs that differ from what the .proto files generate now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        diffs = []
        for path in sorted(fresh.rglob("*")):
            if not path.is_file():
                continue
            committed = OUT_DIR / path.relative_to(fresh)
            old = committed.read_text().splitlines() if committed.exists() else []
            if list(difflib.unified_diff(old, path.read_text().splitlines())):
                diffs.append(str(committed.relative_to(ROOT)))
        return diffs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print("stale gRPC stubs (run `make protos`):", *stale, sep="\n  ")
            sys.exit(1)
        print("gRPC stubs are up to date")
        return
    for path in generate(OUT_DIR):
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
